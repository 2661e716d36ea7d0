"""How each primitive moves the batch axis of a per-example operand: one rule per primitive
(`RULES`), and the elementwise rule. A rule returns its outputs' tags or raises
`NotSplittable` saying where examples would interact."""

from __future__ import annotations

import math

from hbm_guard._src.dropin import batch_tags as tags
from hbm_guard._src.dropin import jaxpr_flat as flat

Batched, Position, NotSplittable = tags.Batched, tags.Position, tags.NotSplittable
SUM = tags.SUM
_where, _shape = tags.where, tags.shape_of
_AXIS_PARAMS = ("axis", "axes", "dimension", "dimensions")
REDUCE_OTHER = frozenset({"reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or",
                           "reduce_xor", "argmax", "argmin"})


def _the(ins: list) -> tuple[int, int]:
  """(operand index, batch axis) of the first batched operand."""
  i = next(i for i, t in enumerate(ins) if isinstance(t, Batched))
  return i, ins[i].axis


def _params_axes(e: flat.Eqn) -> set[int]:
  out: set[int] = set()
  for name in _AXIS_PARAMS:
    value = e.params.get(name)
    if isinstance(value, int) and not isinstance(value, bool):
      out.add(value)
    elif isinstance(value, (tuple, list)) and all(isinstance(x, int) for x in value):
      out.update(value)
  return out


def elementwise(e: flat.Eqn, ins: list) -> list:
  """An op whose outputs have its batched operands' shape (up to lax's broadcasting of size-1
  dimensions) keeps the batch axis."""
  batched = [(v, t) for v, t in zip(e.invars, ins) if isinstance(t, Batched)]
  layouts = {t for _, t in batched}
  outs = {tuple(getattr(v.aval, "shape", ())) for v in e.outvars}
  if len(layouts) == 1 and len(outs) == 1:
    tag, out = layouts.pop(), outs.pop()
    axis = tag.axis
    if all(len(_shape(v)) == len(out) and _shape(v)[axis] == out[axis] and all(
        d in (1, o) for d, o in zip(_shape(v), out)) for v, _ in batched):
      if axis in _params_axes(e):
        raise NotSplittable(f"{_where(e)} runs along the batch axis (examples interact)")
      return [tag] * len(e.outvars)
  if len({t.axis for t in layouts}) > 1:
    raise NotSplittable(f"{_where(e)} pairs examples with other examples: its operands hold "
                        f"the batch on different axes (as `[n]` broadcast against `[n, 1]` "
                        f"does)")
  raise NotSplittable(f"{_where(e)}: the guard does not know how it moves the batch axis")


def key_leading(e, ins, batch):
  """random_bits / random_split / random_wrap / random_unwrap: the key array's axes lead the
  output's (per-example keys give per-example bits)."""
  (t,) = [t for t in ins if t is not None] or [None]
  if not isinstance(t, Batched) or len(ins) != 1 or t.axis >= len(_shape(e.invars[0])) - (
      e.primitive.name == "random_wrap"):
    raise NotSplittable(f"{_where(e)} moves the batch axis of a key array")
  return [t] * len(e.outvars)


def _reduce_sum(e, ins, batch):
  axes = tuple(e.params["axes"])
  i, a = _the(ins)
  return [SUM if a in axes else ins[i].at(a - sum(x < a for x in axes))]


def _reduce_other(e, ins, batch):
  axes = tuple(e.params["axes"])
  i, a = _the(ins)
  if a in axes and e.primitive.name in _EXTREMA:  # (a metric: refused where it is read)
    return [_EXTREMA[e.primitive.name]]
  if a in axes:
    raise NotSplittable(f"{_where(e)} reduces over the batch axis without summing "
                        f"(examples interact)")
  return [ins[i].at(a - sum(x < a for x in axes))]


_EXTREMA = {"reduce_max": tags.MAX, "reduce_min": tags.MIN}


def _broadcast_in_dim(e, ins, batch):
  if not isinstance(ins[0], Batched):
    return elementwise(e, ins)
  return [ins[0].at(tuple(e.params["broadcast_dimensions"])[ins[0].axis])]


def _reshape(e, ins, batch):
  """The batch stays the major factor of an axis (merged with a sequence, `[B, L] ->
  [B * L]`, or split from one). Segments stay whole, or become an axis of their own
  (`[2B, D] -> [2, B, D]`: the batch on the second axis), or an axis before the batch's
  merges into it as segments (`[2, B, D] -> [2B, D]`: jnp.tile's copies, older jax)."""
  if e.params.get("dimensions") is not None or not isinstance(ins[0], Batched):
    raise NotSplittable(f"{_where(e)} reorders the batch axis")
  t = ins[0]
  a, s = t.axis, t.segments
  shape_in = _shape(e.invars[0])
  shape_out = tuple(e.outvars[0].aval.shape)
  prefix = math.prod(shape_in[:a])
  for b in range(len(shape_out)):
    before = math.prod(shape_out[:b])
    if before == prefix and shape_out[b] >= s * batch and shape_out[b] % (s * batch) == 0:
      return [t.at(b)]
    if s > 1 and before == prefix * s and shape_out[b] >= batch and shape_out[b] % batch == 0:
      return [Batched(b)]
    for j in range(a):  # the axes j..a merged into b, the batch's axis last of them
      if before == math.prod(shape_in[:j]) and (
          before * shape_out[b]) % (prefix * shape_in[a]) == 0:
        return [Batched(b, s * math.prod(shape_in[j:a]))]
    if before > prefix * s:
      break
  raise NotSplittable(f"{_where(e)} splits the batch axis {shape_in} -> {shape_out}")


def _transpose(e, ins, batch):
  return [ins[0].at(tuple(e.params["permutation"]).index(ins[0].axis))]


def _squeeze(e, ins, batch):
  dims = tuple(e.params["dimensions"])
  a = ins[0].axis
  return [ins[0].at(a - sum(d < a for d in dims))]


def _dot_general(e, ins, batch):
  (lc, rc), (lb, rb) = e.params["dimension_numbers"]
  ranks = [len(_shape(v)) for v in e.invars[:2]]
  free = [[d for d in range(ranks[s]) if d not in (lc, rc)[s] and d not in (lb, rb)[s]]
          for s in (0, 1)]
  where = []
  for side in (0, 1):
    t = ins[side]
    if not isinstance(t, Batched):
      where.append(None)
    elif t.axis in (lc, rc)[side]:
      where.append(("contract", tuple((lc, rc)[side]).index(t.axis)))
    elif t.axis in (lb, rb)[side]:
      where.append(("batch", tuple((lb, rb)[side]).index(t.axis)))
    else:
      offset = len(lb) + (0 if side == 0 else len(free[0]))
      where.append(("free", offset + free[side].index(t.axis)))
  l, r = where
  if l is not None and r is not None:
    same = ins[0].segments == ins[1].segments
    if l == r and l[0] == "contract" and same:
      return [SUM]
    if l == r and l[0] == "batch" and same:
      return [ins[0].at(l[1])]
    raise NotSplittable(f"{_where(e)} pairs examples with other examples (in-batch "
                        f"interaction, as a contrastive loss's)")
  kind, pos = l or r
  if kind == "contract":
    return [SUM]
  return [(ins[0] if l else ins[1]).at(pos)]


def _gather(e, ins, batch):
  dn = e.params["dimension_numbers"]
  out_rank = len(e.outvars[0].aval.shape)
  gathered = [d for d in range(out_rank) if d not in tuple(dn.offset_dims)]
  op, idx = ins[0], ins[1]
  op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
  idx_batching = tuple(getattr(dn, "start_indices_batching_dims", ()))
  if isinstance(idx, Batched) and idx.axis < len(_shape(e.invars[1])) - 1:
    if op is None or (op.axis in op_batching and op.segments == idx.segments
                      and idx_batching[op_batching.index(op.axis)] == idx.axis):
      return [idx.at(gathered[idx.axis])]
  if isinstance(op, Batched) and idx is None:
    kept = [d for d in range(len(_shape(e.invars[0])))
            if d not in tuple(dn.collapsed_slice_dims) and d not in op_batching]
    full = tuple(e.params["slice_sizes"])[op.axis] == _shape(e.invars[0])[op.axis]
    if op.axis in kept and full and op.axis not in tuple(dn.start_index_map):
      return [op.at(tuple(dn.offset_dims)[kept.index(op.axis)])]
  raise NotSplittable(f"{_where(e)} gathers across examples")


def _concatenate(e, ins, batch):
  """Along another axis: every operand per example, or without the batch but as long as it
  along the batch axis (a CLS token broadcast over the batch: the same in every example).
  Along the batch axis: batches one after another (`[chosen; rejected]`), segments of one
  axis, each split alike."""
  layouts = {t for t in ins if isinstance(t, Batched)}
  dim = e.params["dimension"]
  if len(layouts) == 1 and dim != next(iter(layouts)).axis:
    tag = next(iter(layouts))
    a, size = tag.axis, _shape(e.outvars[0])[tag.axis]
    if all(isinstance(t, Batched) or (t is None and len(_shape(v)) > a and _shape(v)[a] == size)
           for v, t in zip(e.invars, ins)):
      return [tag]
  if all(isinstance(t, Batched) and t.axis == dim for t in ins):
    per = {_shape(v)[dim] // t.segments for v, t in zip(e.invars, ins)}
    if len(per) == 1:
      return [Batched(dim, sum(t.segments for t in ins))]
  raise NotSplittable(f"{_where(e)} concatenates along or beside the batch axis")


def _tile(e, ins, batch):
  """jnp.tile (a primitive in newer jax): along the batch axis, r copies of the batch one
  after another (`jnp.tile(x, (2, 1))`: two views), each copy a segment split alike;
  along any other axis, each example's own values repeated."""
  (t,) = ins
  reps = tuple(e.params.get("reps", ()))
  if len(reps) != len(_shape(e.invars[0])):
    raise NotSplittable(f"{_where(e)} tiles the batch into more axes than it has")
  return [Batched(t.axis, t.segments * reps[t.axis])]


def _stack(e, ins, batch):
  """jnp.stack (jax's own primitive in newer jax): every operand per example on one axis, or
  without the batch and as long as it there; the new axis moves the batch's past it."""
  layouts = {t for t in ins if isinstance(t, Batched)}
  if len(layouts) == 1 and not any(isinstance(t, Position) for t in ins):
    tag = next(iter(layouts))
    a = tag.axis
    size = _shape(next(v for v, t in zip(e.invars, ins) if isinstance(t, Batched)))[a]
    if all(t is not None or (len(_shape(v)) > a and _shape(v)[a] == size)
           for v, t in zip(e.invars, ins)):
      return [tag.at(a if a < e.params["axis"] else a + 1)]
  raise NotSplittable(f"{_where(e)} stacks values that hold the batch differently")


def _unstack(e, ins, batch):
  i, a = _the(ins)
  if e.params["axis"] == a:
    raise NotSplittable(f"{_where(e)} takes the batch apart example by example")
  return [ins[i].at(a if a < e.params["axis"] else a - 1)] * len(e.outvars)


def _split(e, ins, batch):
  """lax.split (jnp.split, an LSTM cell's gates): each piece keeps the batch axis whole;
  along an axis of segments, at their boundaries (`jnp.split(both, 2)`: chosen, rejected)."""
  i, a = _the(ins)
  t = ins[i]
  if e.params["axis"] != a:
    return [t] * len(e.outvars)
  per = _shape(e.invars[0])[a] // t.segments
  sizes = tuple(e.params["sizes"])
  if t.segments > 1 and all(n > 0 and n % per == 0 for n in sizes):
    return [Batched(a, n // per) for n in sizes]
  raise NotSplittable(f"{_where(e)} splits the batch axis")


def _full_on_batch_axis(e, ins, batch):
  """slice / pad / dynamic_slice: fine when the batch axis is taken whole."""
  i, a = _the(ins)
  if i != 0:
    raise NotSplittable(f"{_where(e)} indexes by a per-example value")
  name = e.primitive.name
  size = _shape(e.invars[0])[a]
  t = ins[i]
  if name == "slice" and t.segments > 1:  # whole segments of the batch (`both[:n]`)
    per, p = size // t.segments, e.params
    start, limit = p["start_indices"][a], p["limit_indices"][a]
    if (start % per == 0 and limit % per == 0 and limit > start
        and (p["strides"] is None or p["strides"][a] == 1)):
      return [Batched(a, (limit - start) // per)]
  ok = {
      "slice": lambda p: (p["start_indices"][a] == 0 and p["limit_indices"][a] == size
                          and (p["strides"] is None or p["strides"][a] == 1)),
      "pad": lambda p: tuple(p["padding_config"][a]) == (0, 0, 0),
      "dynamic_slice": lambda p: p["slice_sizes"][a] == size,
  }[name](e.params)
  if not ok:
    raise NotSplittable(f"{_where(e)} takes part of the batch axis")
  return [t]


def _top_k(e, ins, batch):
  i, a = _the(ins)
  if a == len(_shape(e.invars[0])) - 1:
    raise NotSplittable(f"{_where(e)} ranks across examples")
  return [ins[i]] * len(e.outvars)


def _reduce_window(e, ins, batch):
  i, a = _the(ins)
  p = e.params
  if (p["window_dimensions"][a] != 1 or p["window_strides"][a] != 1
      or tuple(p["padding"][a]) != (0, 0)):
    raise NotSplittable(f"{_where(e)} pools across examples")
  return [ins[i]] * len(e.outvars)


def _conv(e, ins, batch):
  dn = e.params["dimension_numbers"]
  if isinstance(ins[1], Batched) or e.params.get("batch_group_count", 1) != 1:
    raise NotSplittable(f"{_where(e)} convolves with a per-example kernel")
  if ins[0].axis != dn.lhs_spec[0]:
    raise NotSplittable(f"{_where(e)} convolves along the batch axis")
  return [ins[0].at(dn.out_spec[0])]


def _scatter(e, ins, batch):
  """A write beside the batch axis (`x.at[:, i].set(v)`: the same positions in every
  example, the batch axis written whole), or, under `vmap`, at each example's own index
  into its own row (operand and indices batched alike)."""
  op, idx, up = ins[0], ins[1], ins[2]
  dn = e.params["dimension_numbers"]
  shapes = [_shape(v) for v in e.invars[:3]]
  inserted, to_operand = tuple(dn.inserted_window_dims), tuple(dn.scatter_dims_to_operand_dims)
  op_b = tuple(getattr(dn, "operand_batching_dims", ()))
  idx_b = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
  windows = [d for d in range(len(shapes[0])) if d not in inserted and d not in op_b]
  up_window = tuple(dn.update_window_dims)
  tags = [t for t in (op, idx, up) if isinstance(t, Batched)]
  if tags and len({t.segments for t in tags}) == 1:
    t = tags[0]
    if idx is None:
      a = op.axis if isinstance(op, Batched) else (
          windows[up_window.index(up.axis)] if up.axis in up_window else None)
      if a is not None and a in windows and a not in to_operand:
        ua = up_window[windows.index(a)]
        if (shapes[2][ua] == shapes[0][a] and (op is None or op == t.at(a))
            and (up is None or up == t.at(ua))):
          return [t.at(a)]
    elif isinstance(idx, Batched) and idx.axis in idx_b and idx.axis < len(shapes[1]) - 1:
      a = op_b[idx_b.index(idx.axis)]
      scatter_dims = [d for d in range(len(shapes[2])) if d not in up_window]
      ua = scatter_dims[idx.axis]
      if (op is None or op == t.at(a)) and (up is None or up == t.at(ua)):
        return [t.at(a)]
  raise NotSplittable(f"{_where(e)} writes at batch positions")


_LINALG = frozenset({"cholesky", "eig", "eigh", "hessenberg", "householder_product", "lu",
                     "qr", "schur", "svd", "triangular_solve", "tridiagonal", "geqrf",
                     "geqp3", "ormqr", "symmetric_product", "cholesky_update"})


def _linalg(e, ins, batch):
  """Linear algebra on each example's own matrices: the batch on a leading dimension of
  every operand, the matrices the last two (`solve_triangular`, `cholesky` under vmap)."""
  layouts = {t for t in ins if isinstance(t, Batched)}
  if len(layouts) == 1:
    t = next(iter(layouts))
    if all(t.axis < len(_shape(v)) - 2 for v in e.invars if len(_shape(v)) >= 2) and all(
        len(v.aval.shape) > t.axis for v in e.outvars):
      return [t] * len(e.outvars)
  raise NotSplittable(f"{_where(e)} solves across the batch axis")


RULES = {
    **{name: _scatter for name in ("scatter", "scatter-add", "scatter_add", "scatter-mul",
                                   "scatter_mul", "scatter-min", "scatter_min", "scatter-max",
                                   "scatter_max")},
    **{name: _linalg for name in _LINALG},
    "reduce_sum": _reduce_sum,
    **{name: _reduce_other for name in REDUCE_OTHER},
    "broadcast_in_dim": _broadcast_in_dim,
    "reshape": _reshape,
    "transpose": _transpose,
    "squeeze": _squeeze,
    "dot_general": _dot_general,
    "gather": _gather,
    "concatenate": _concatenate,
    "split": _split,
    "stack": _stack,
    "tile": _tile,
    "unstack": _unstack,
    "slice": _full_on_batch_axis,
    "pad": _full_on_batch_axis,
    "dynamic_slice": _full_on_batch_axis,
    "conv_general_dilated": _conv,
    "top_k": _top_k,
    **{name: _reduce_window for name in ("reduce_window_sum", "reduce_window_max",
                                         "reduce_window_min", "reduce_window")},
}
