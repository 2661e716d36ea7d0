"""The batch analysis inside units with a body of their own: custom derivative rules,
checkpoints (the user's `jax.checkpoint`, `nn.remat`), `scan`, `cond` and a data-parallel
`shard_map`. Each body is read by the batch analysis itself (passed in as `analyse`, which
calls back here for nested units): its outputs' tags are the unit's."""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from hbm_guard._src.dropin import batch_tags as tags
from hbm_guard._src.dropin import custom_rules
from hbm_guard._src.dropin import jaxpr_flat as flat

NotSplittable, Batched, Position, Reduced = (tags.NotSplittable, tags.Batched, tags.Position,
                                            tags.Reduced)
SUM, COMBINED = tags.SUM, tags.COMBINED
_where = tags.where
CUSTOM_RULES = custom_rules.NAMES
# Collectives inside a shard_map's body: over mesh axes that do not shard the batch (a
# vocabulary split over devices) they act within each example.
COLLECTIVES = frozenset({"psum", "psum_invariant", "pmax", "pmin", "pbroadcast"})
# The mesh axes the batch is sharded over, in the shard_map body being read (None: outside).
_BATCH_MESH_AXES: contextvars.ContextVar[frozenset | None] = contextvars.ContextVar(
    "hbm_guard_batch_mesh_axes", default=None)


def collective(e: flat.Eqn, ins: list) -> list:
  """A collective on per-example values inside a shard_map: over mesh axes that do not
  shard the batch, each example's shards combined (a max over a vocabulary's shards);
  over those that do, examples of other shards would meet: refused."""
  batch_axes = _BATCH_MESH_AXES.get()
  axes = e.params.get("axes", e.params.get("axis_name", ()))
  axes = frozenset((axes,) if isinstance(axes, str) else tuple(axes))
  tags_in = {t for t in ins if isinstance(t, Batched)}
  if batch_axes is None or axes & batch_axes or len(tags_in) != 1:
    raise NotSplittable(f"{_where(e)} combines examples across the devices that share the "
                        f"batch")
  return [next(iter(tags_in))] * len(e.outvars)


def tag(e: flat.Eqn, ins: list, batch: int, analyse: Callable) -> list:
  """custom_jvp / custom_vjp / checkpoint / scan / while / cond / shard_map: the tags of their
  body, read by `analyse` (the batch analysis itself)."""
  name = e.primitive.name
  if name == "scan":
    return _scan(e, ins, batch, analyse)
  if name == "while":
    return _while(e, ins, batch, analyse)
  if name == "shard_map":
    return _shard_map(e, ins, batch, analyse)
  if name == "cond":
    outs = None
    if ins[0] is not None:
      raise NotSplittable(f"{_where(e)} branches on a per-example value")
    for branch in e.params["branches"]:
      got = _body(branch, ins[1:], batch, analyse)
      if outs is not None and got != outs:
        raise NotSplittable(f"{_where(e)}: branches move the batch differently")
      outs = got
    return _no_combined(e, outs)
  sub = next((v for v in e.params.values()
              if hasattr(v, "eqns") or hasattr(getattr(v, "jaxpr", None), "eqns")), None)
  if sub is None:
    raise NotSplittable(f"{_where(e)}: the guard cannot see into it")
  inner = getattr(sub, "jaxpr", sub)
  n_in = len(inner.invars)
  outs = _no_combined(e, _body(sub, ins[len(ins) - n_in:], batch, analyse))
  if name in CUSTOM_RULES:
    custom_rules.check(e, ins, outs, batch, analyse, NotSplittable, _where(e))
  return outs


def _shard_map(e: flat.Eqn, ins: list, batch: int, analyse: Callable) -> list:
  """A `shard_map` inside the loss (data parallel): each shard holds a block of the batch's
  examples, its body is read at that block's size, and a sum it `psum`s over the shards is
  a batch sum. Per-example values must leave as they came (sharded on their batch axis)."""
  p = e.params
  mesh_shape = dict(getattr(p["mesh"], "shape", {}))

  def shards(spec, axis: int) -> int | None:
    entries = tuple(spec) if spec is not None else ()
    names = entries[axis] if axis < len(entries) else None
    names = () if names is None else (names,) if isinstance(names, str) else tuple(names)
    try:
      return int(np.prod([mesh_shape[n] for n in names])) if names else 1
    except KeyError:
      return None

  def names(spec, axis: int) -> frozenset:
    entries = tuple(spec) if spec is not None else ()
    got = entries[axis] if axis < len(entries) else None
    return frozenset(() if got is None else (got,) if isinstance(got, str) else tuple(got))

  local, batch_axes = set(), frozenset()
  for t, spec in zip(ins, p["in_specs"]):
    if isinstance(t, Batched):
      n = shards(spec, t.axis)
      if n is None or batch % n:
        raise NotSplittable(f"{_where(e)} shards the batch unevenly")
      local.add(batch // n)
      batch_axes |= names(spec, t.axis)
  if len(local) != 1:
    raise NotSplittable(f"{_where(e)} shards the batch's arrays differently")
  body_batch = local.pop()
  token = _BATCH_MESH_AXES.set(batch_axes)
  try:
    outs = _body(p["jaxpr"], ins, body_batch, analyse)
  finally:
    _BATCH_MESH_AXES.reset(token)
  for t, spec in zip(outs, p["out_specs"]):
    if t is COMBINED or (isinstance(t, Batched) and shards(spec, t.axis) != batch // body_batch):
      raise NotSplittable(f"{_where(e)} returns the batch otherwise than it came in (a "
                          f"mean inside it, or examples gathered across its shards)")
  return outs


def _no_combined(e, outs):
  if COMBINED in outs:
    raise NotSplittable(f"{_where(e)} computes from batch sums inside itself")
  return outs


def _body(closed, ins: Sequence, batch: int, analyse: Callable) -> list:
  """Output tags of a unit's body. Its operands carry no batch sums (see `_tag`), except a
  scan's running sum from zero (`_carried`)."""
  closed = closed if hasattr(closed, "jaxpr") else _Closed(closed)
  prog = flat.flatten(closed)
  tags = analyse(prog, {v: t for v, t in zip(prog.invars, ins)
                       if isinstance(t, (Batched, Position)) or t is SUM}, batch,
                 getattr(closed, "consts", ()))
  return [tags.get(v) if flat.is_var(v) else None for v in prog.outvars]


@dataclasses.dataclass(frozen=True)
class _Closed:
  jaxpr: Any
  consts: tuple = ()


def _scan(e: flat.Eqn, ins: list, batch: int, analyse: Callable) -> list:
  p = e.params
  if "num_consts" in p:
    n_consts, n_carry = p["num_consts"], p["num_carry"]
  else:  # newer jax: the operands' groups (consts, carry, xs) as a flat tree
    groups = getattr(p.get("ft_in"), "elts", None)
    if groups is None or len(groups) != 3:
      raise NotSplittable(f"{_where(e)}: a scan the guard cannot read")
    n_consts, n_carry = len(groups[0]), len(groups[1])
  consts, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
  x_tags = []
  for t in xs:
    if isinstance(t, Batched) and t.axis == 0:
      raise NotSplittable(f"{_where(e)} scans over the batch axis")
    x_tags.append(t.at(t.axis - 1) if isinstance(t, Batched) else t)
  if any(isinstance(t, Reduced) for t in ins):
    raise NotSplittable(f"{_where(e)} carries a batch sum")
  # A carry that sums from a literal zero (a loss summed chunk by chunk) adds up over the
  # microbatches as the whole batch's; one from any other start would count it k times.
  from_zero = [_is_zero(a) for a in e.invars[n_consts:n_consts + n_carry]]
  for _ in range(n_carry + 3):
    outs = _body(p["jaxpr"], [*consts, *carry, *x_tags], batch, analyse)
    new_carry = [_carried(e, a, b, zero) for a, b, zero in zip(outs[:n_carry], carry, from_zero)]
    if new_carry == list(carry):
      break
    carry = new_carry
  else:
    raise NotSplittable(f"{_where(e)}: its carry changes how it holds the batch")
  ys = [t.at(t.axis + 1) if isinstance(t, Batched) else t for t in outs[n_carry:]]
  return _no_combined(e, [*carry, *ys])


def _while(e: flat.Eqn, ins: list, batch: int, analyse: Callable) -> list:
  """A while loop over per-example values (a per-row bisection, a fixed-point iteration):
  exact split where each example's carry stays its own and the stopping test reads no
  example (a counter): every microbatch then runs the whole batch's iterations."""
  p = e.params
  nc, nb = p["cond_nconsts"], p["body_nconsts"]
  cond_consts, body_consts, carry = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
  if any(isinstance(t, Reduced) for t in ins):
    raise NotSplittable(f"{_where(e)} carries a batch sum")
  for _ in range(len(carry) + 3):
    outs = _body(p["body_jaxpr"], [*body_consts, *carry], batch, analyse)
    if any(isinstance(t, Reduced) for t in outs):
      raise NotSplittable(f"{_where(e)} computes from batch sums inside itself")
    new = [b if a is None else a for a, b in zip(outs, carry)]
    if any(b is not None and a != b for a, b in zip(new, carry)):
      raise NotSplittable(f"{_where(e)}: its carry changes how it holds the batch")
    if new == list(carry):
      break
    carry = new
  else:
    raise NotSplittable(f"{_where(e)}: its carry changes how it holds the batch")
  test = _body(p["cond_jaxpr"], [*cond_consts, *carry], batch, analyse)
  if any(t is not None for t in test):
    raise NotSplittable(f"{_where(e)} stops on a test that reads the batch (its count of "
                        f"iterations would differ on a microbatch)")
  return carry


def _is_zero(atom) -> bool:
  if flat.is_var(atom):
    return False
  try:
    return not np.any(np.asarray(flat.read(atom, {})))
  except Exception:  # pylint: disable=broad-except  (not a concrete constant)
    return False


def _carried(e, out, before, from_zero: bool):
  """A scan carry's tag for the next pass over the body: as before, or what the body made
  of it; a batch sum only where it starts from zero and stays a sum."""
  if before is None and from_zero and isinstance(out, Reduced):
    return SUM  # try it as a running sum: the next pass says whether it stays one
  if before is SUM and out is SUM:
    return SUM
  if isinstance(out, Reduced) or before is SUM or (
      out is not None and before is not None and out != before):
    raise NotSplittable(f"{_where(e)}: its carry changes how it holds the batch")
  return out if out is not None else before




def reworked_whole(prog: flat.Program, params: Sequence, batch: Sequence,
                   table: Sequence) -> bool:
  """Whether the program computes, from `table` and the parameters but not from the
  batch, a value: work a microbatch would repeat whole (an array set apart from the batch
  that the network transforms, as in-batch keys or embeddings of all examples are).
  Bodies of units count as reading all their operands."""
  table_, params_, other_ = 1, 2, 4
  mask = {v: params_ for v in params}
  mask.update({v: other_ for v in batch})
  mask.update({v: table_ for v in table})
  for e in prog.eqns:
    got = 0
    for v in e.invars:
      got |= mask.get(v, 0) if flat.is_var(v) else 0
    for v in e.outvars:
      mask[v] = got
    if got & (table_ | params_) == table_ | params_ and not got & other_:
      return True
  return False
