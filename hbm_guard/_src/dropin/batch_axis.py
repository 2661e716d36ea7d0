"""Where the batch goes in a loss: per example, summed over, or combined from sums.

Each value of a flat loss program gets a tag:
- no tag: independent of the batch (parameters, constants);
- `Batched(axis)`: per example; the batch is the major factor of `axis`;
- `SUM`: an additive sum over the batch (the microbatches' values add up to the batch's);
- `COMBINED`: computed from sums (a mean, `sum(l * w) / sum(w)`): evaluated once, from
  the whole batch's sums;
- `Position(axes)`: made from the batch's size, not from the batch (`jnp.arange(n)`, also
  over the batch merged with a sequence, `jnp.arange(n * L)`): it counts the examples, and
  a microbatch counts from 0 again. Along an axis other than the batch's (a sequence as
  long as the batch) it is a constant. Where per-example work reads it (a weight, a mask),
  the parameter-free value is taken as per-example data (`split`): computed once over the
  whole batch, as jax.jit computes it, and split like the batch; where that cannot be done
  (it depends on the parameters, or indexes the batch itself), the split is refused.
Where examples interact — a batch statistic feeding per-example work (BatchNorm), examples
paired with examples (in-batch negatives), a maximum over the batch — `NotSplittable` says
where, so the guard can say why it did not split.

The analysis is default-deny: a primitive applied to a value that carries the batch is
followed only where it has a rule here (`rules.RULES`, the listed elementwise primitives, the
units whose bodies are read); any other refuses the split, naming the primitive and the
user's source line. A constant (or a callback's result) with an axis of the batch's length
is a position along it unless it is provably the same at every position.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from hbm_guard._src.dropin import batch_rules as rules
from hbm_guard._src.dropin import batch_tags as tags
from hbm_guard._src.dropin import batch_units as units
from hbm_guard._src.dropin import custom_rules
from hbm_guard._src.dropin import jaxpr_flat as flat
from hbm_guard._src.dropin import own_rows


batch_long = tags.batch_long
NotSplittable, Batched, Position, Reduced = (tags.NotSplittable, tags.Batched, tags.Position,
                                            tags.Reduced)
SUM, COMBINED = tags.SUM, tags.COMBINED
EXTREMA = tags.EXTREMA
constant_tag, where = tags.constant_tag, tags.where
_where, _shape = tags.where, tags.shape_of
# Ops under which a sum stays additive: they only move or retype the summed values.
_LINEAR_1 = frozenset({"convert_element_type", "neg", "reshape", "squeeze", "broadcast_in_dim",
                       "transpose", "reduce_sum", "copy", "copy_p", "real", "imag",
                       # inside a shard_map: the shards' sums added up, or marked as such
                       "psum", "psum_invariant", "pvary", "pbroadcast"})
_UNITS = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "checkpoint",
                    "remat", "remat2", "custom_lin"})
CHECKPOINTS = frozenset({"checkpoint", "remat", "remat2"})  # jax.checkpoint, nn.remat, nnx.remat
MAX_DESIGNATIONS = 16  # values taken as per-example data in one loss, at most
# Ops that only move or retype a value: a statistic broadcast by them is hoisted before them.
_SHAPE_ONLY = frozenset({"broadcast_in_dim", "reshape", "convert_element_type", "copy",
                         "copy_p", "squeeze", "expand_dims", "transpose"})
CUSTOM_RULES = custom_rules.NAMES
# Primitives that act on each element (or, with an axis parameter, along that axis only:
# refused where it is the batch's). Everything else needs a rule of its own.
ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh",
    "bessel_i0e", "bessel_i1e", "cbrt", "ceil", "clamp", "clz", "complex", "conj",
    "convert_element_type", "copy", "copy_p", "cos", "cosh", "cumlogsumexp", "cummax",
    "cummin", "cumprod", "cumsum", "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp",
    "exp2", "expm1", "floor", "ge", "gt", "igamma", "igamma_grad_a", "igammac", "imag",
    "integer_pow", "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "max", "min",
    "mul", "ne", "neg", "nextafter", "not", "or", "polygamma", "population_count", "pow",
    "random_gamma_grad", "real", "reduce_precision", "regularized_incomplete_beta", "rem",
    "rev", "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "sign", "sin", "sinh", "sort", "sqrt", "square", "stop_gradient",
    "sub", "tan", "tanh", "xor", "zeta", "optimization_barrier", "sharding_constraint",
    "mesh_cast", "reshard", "bitcast_convert_type", "threefry2x32", "random_fold_in",
    "log2", "mulhi", "one_minus_square", "eq_to", "le_to", "lt_to", "polynomial",
    "name",  # checkpoint_name: the value, named for a remat policy
    "pvary",  # inside a shard_map: the value, marked as varying over devices
})
# Key primitives that keep a key array's leading axes (and append their own at the end).
_KEY_LEADING = frozenset({"random_bits", "random_split", "random_wrap", "random_unwrap"})
_CALLBACKS = frozenset({"pure_callback", "io_callback", "callback", "ffi_call"})


class _Designate(Exception):
  """A parameter-free value an op needs per example: the analysis starts again with it
  taken as per-example data (`split`)."""

  def __init__(self, var, tag: Batched, refusal: NotSplittable, own_index: bool = False):
    super().__init__(str(refusal))
    self.var, self.tag, self.refusal, self.own_index = var, tag, refusal, own_index


def analyse(prog: flat.Program, batched: dict[Any, Any], batch: int,
            consts: Sequence[Any] = (), hoisted: set | None = None,
            param_free: Callable[[Any], bool] | None = None,
            split: dict | None = None, own_index: set | None = None,
            staged: set | None = None) -> dict[Any, Any]:
  """Tags of every value of `prog`, given the batch inputs' axes (or tags) and the values
  of its constvars (`consts`, where known); raises NotSplittable.

  With `param_free` (which values do not depend on the parameters), a batch statistic that
  is parameter-free and meets per-example values (advantages normalised by their batch mean
  and deviation, `mask / mask.sum()`) is added to `hoisted` instead of refused: computed
  once over the whole batch, it is a constant to each microbatch. With `split` as well (a
  dict, which this fills), a parameter-free value as long as the batch that an op needs per
  example (a mask by position, `jnp.arange(n * L) < n_valid * L`; labels `jnp.zeros(n)`) is
  taken as per-example data: `split[value]` is its layout, and it is computed once over the
  whole batch and split like the batch, so each microbatch reads its own examples' entries.
  Of those, an `iota` over the batch that only indexes the batch's own rows (`x[jnp.arange(n),
  y]`) is in `own_index`: each microbatch counts its own rows, as it must. With `staged` (a
  set, which this fills), a batch statistic the parameters reach that meets per-example
  values (Pearson's `x - x.mean()`, VICReg's covariance of centred embeddings) is added to
  it instead of refused: totalled over the microbatches in a pass of its own, it is a
  constant to each microbatch in the next (`loss_split` decides whether that is allowed)."""
  if split is None or param_free is None:
    return _analyse(prog, batched, batch, consts, hoisted, param_free, None, None)
  while True:
    for found in (hoisted, staged):
      if found is not None:
        found.clear()
    try:
      return _analyse(prog, batched, batch, consts, hoisted, param_free, split, own_index,
                      staged)
    except _Designate as d:
      if (d.var in split and not d.own_index) or len(split) >= MAX_DESIGNATIONS or (
          d.own_index and own_index is None) or (own_index is not None and d.var in own_index):
        raise d.refusal from None
      split[d.var] = d.tag
      if d.own_index:
        own_index.add(d.var)


def _analyse(prog, batched, batch, consts, hoisted, param_free, split, own_index,
             staged=None) -> dict[Any, Any]:
  tags: dict[Any, Any] = {v: a if isinstance(a, (Batched, Position, Reduced)) else Batched(a)
                          for v, a in batched.items()}
  for v, c in zip(prog.constvars, consts):
    if v not in tags and (t := constant_tag(c, batch)) is not None:
      tags[v] = t
  if split:
    tags.update((v, t) for v, t in split.items() if v in set(prog.constvars))
  const_tags: dict[int, Position | None] = {}  # an inlined constant is read once
  producers: dict[Any, flat.Eqn] = {}
  own_gathers: set = set()  # gathers that read each example's own row

  def const_tag(c: flat.Const) -> Position | None:
    if id(c) not in const_tags:
      const_tags[id(c)] = constant_tag(c.value, batch)
    return const_tags[id(c)]

  for e in prog.eqns:
    producers.update((v, e) for v in e.outvars)
    ins = [tags.get(v) if flat.is_var(v) else (
        const_tag(v) if isinstance(v, flat.Const) else None) for v in e.invars]
    if not any(t is not None for t in ins):
      _untagged(e, tags, batch)
    elif param_free is not None and _free_extremum(e, ins, param_free):
      tags[e.outvars[0]] = COMBINED  # (logsumexp's maximum): evaluated over the whole batch
    else:
      if param_free is not None and any(isinstance(t, (Batched, Position)) for t in ins):
        for i, (v, t) in enumerate(zip(e.invars, ins)):
          if isinstance(t, Reduced) and flat.is_var(v) and param_free(v):
            hoisted.add(_before_broadcasts(v, producers, tags, param_free))
            ins[i] = None
          elif (staged is not None and t in (SUM, COMBINED) and flat.is_var(v)
                and not param_free(v)):
            staged.add(_before_broadcasts(v, producers, tags, lambda u: True))
            ins[i] = None
      try:
        if staged is not None and any(t in EXTREMA for t in ins) and not any(
            isinstance(t, (Batched, Position)) for t in ins):
          outs = [COMBINED] * len(e.outvars)  # (logsumexp's maximum, made safe: see loss_split)
        else:
          outs = _tag(e, ins, batch)
      except NotSplittable as refusal:
        chain = None if split is None else own_rows.chain(e, ins, producers)
        own = chain[-1] if chain else None
        if own is not None and own_index is not None and own in own_index:
          own_index.update(chain)  # (each microbatch counts them: its own rows)
          own_gathers.add(e)
          outs = [ins[1].at(own_rows.gathered(e)[ins[1].axis])]
          for v, t in zip(e.outvars, outs):
            tags[v] = t
          continue
        if own is not None and isinstance(tags.get(own), (Position, Batched)):
          raise _Designate(own, Batched(0), refusal, own_index=True) from None
        found = None if split is None else _designation(e, ins, batch, param_free, split,
                                                        producers, tags)
        if found is not None:
          raise _Designate(*found, refusal) from None
        if split is None or not all(param_free(v) for v in e.outvars):
          raise
        outs = [_whole_batch_only(v, batch) for v in e.outvars]
      for v, t in zip(e.outvars, outs):
        if t is not None:
          tags[v] = t
    if split:
      tags.update((v, split[v]) for v in e.outvars if v in split)
  if own_index:
    other = own_rows.only_as_own_rows(prog, own_index, own_gathers)
    if other is not None or any(v in own_index for v in prog.outvars):
      raise NotSplittable(f"{_where(other) if other is not None else 'the loss'} reads the "
                          f"examples' positions in the batch that also index their own rows "
                          f"(a microbatch counts its own)")
  return tags


def _whole_batch_only(v, batch: int) -> Position | Reduced:
  """The tag of a value a parameter-free op made from the batch in a way no rule follows
  (mixup's `x[::-1]`, a sort over the batch, counts by class): as long as the batch, a
  position along those axes (computed once over the whole batch and split with it where
  per-example work reads it); otherwise a statistic of the batch (computed once)."""
  axes = frozenset(i for i, d in enumerate(getattr(v.aval, "shape", ())) if batch_long(d, batch))
  return Position(axes) if axes else COMBINED


def _untagged(e: flat.Eqn, tags: dict, batch: int) -> None:
  """An op on values independent of the batch: an iota or a callback's result as long as
  the batch (or a multiple of it) is a position along that axis."""
  name = e.primitive.name
  if name == "iota" and batch_long(e.outvars[0].aval.shape[e.params["dimension"]], batch):
    tags[e.outvars[0]] = Position(frozenset({e.params["dimension"]}))
  elif name in _CALLBACKS:  # its result may differ at every position: never uniform
    for v in e.outvars:
      axes = frozenset(i for i, d in enumerate(getattr(v.aval, "shape", ()))
                       if batch_long(d, batch))
      if axes:
        tags[v] = Position(axes)


def _before_broadcasts(v, producers: dict, tags: dict, param_free) -> Any:
  """The statistic `v` as it was before ops that only broadcast or retype it (of those
  `param_free` allows): given there, so each microbatch broadcasts it to its own shape
  (`jnp.where(m, x.mean(), 0)`)."""
  for _ in range(len(producers)):
    e = producers.get(v)
    if e is None or e.primitive.name not in _SHAPE_ONLY:
      return v
    operands = [u for u in e.invars if flat.is_var(u)]
    if len(operands) != 1 or not isinstance(tags.get(operands[0]), Reduced) or not param_free(
        operands[0]):
      return v
    v = operands[0]
  return v


def _designation(e: flat.Eqn, ins: list, batch: int, param_free, split: dict, producers: dict,
                 tags: dict) -> tuple[Any, Batched] | None:
  """A parameter-free operand of `e` (or the parameter-free position it was made from) that,
  taken as per-example data in some layout, lets `e` be tagged: (value, layout), or None."""
  layouts = sorted({1} | {t.segments for t in ins if isinstance(t, Batched)})
  for i, (v, t) in enumerate(zip(e.invars, ins)):
    if not flat.is_var(v) or v in split or not (t is None or isinstance(t, Position)):
      continue
    if param_free(v):
      for tag in _layouts(v, batch, layouts):
        trial = list(ins)
        trial[i] = tag
        if _tag_or_none(e, trial, batch) is not None:
          return v, tag
    elif isinstance(t, Position):  # e.g. a parameter table read by position
      for source in _position_sources(v, producers, tags, param_free):
        axes = tags[source].axes
        if len(axes) == 1 and source not in split:
          return source, Batched(next(iter(axes)))
  return None


def designate(prog: flat.Program, tags: dict, v, batch: int) -> Batched | None:
  """A layout for the parameter-free value `v` as per-example data, from the first op that
  reads it and can take it so (None where none can). Ops that only reshape or broadcast it
  are followed to the op that meets it with per-example values: the layout that op takes
  (`jnp.repeat(w, n)` beside `jnp.tile(x, (2, 1))`: segments, not rows)."""
  layouts = sorted({1} | {t.segments for t in tags.values() if isinstance(t, Batched)})
  for e in prog.eqns:
    if not any(u is v for u in e.invars):
      continue
    fallback = None
    for tag in _layouts(v, batch, layouts):
      met = _meets(prog, tags, e, v, tag, batch)
      if met is True:
        return tag
      if met is None and fallback is None:
        fallback = tag
    if fallback is not None:
      return fallback
  return None


def _meets(prog: flat.Program, tags: dict, e: flat.Eqn, v, tag: Batched, batch: int,
           depth: int = 8) -> bool | None:
  """Whether `e`, reading `v` laid out as `tag`, takes it (True), refuses it (False), or
  takes it without meeting per-example values within `depth` shape-only ops (None)."""
  ins = [tags.get(u) if flat.is_var(u) else None for u in e.invars]
  trial = [tag if u is v else t for u, t in zip(e.invars, ins)]
  out = _tag_or_none(e, trial, batch)
  if out is None:
    return False
  if any(isinstance(t, Batched) for u, t in zip(e.invars, ins) if u is not v):
    return True
  if e.primitive.name not in _SHAPE_ONLY or depth <= 0 or not isinstance(out[0], Batched):
    return None
  w = e.outvars[0]
  readers = [r for r in prog.eqns if any(u is w for u in r.invars)]
  found = [_meets(prog, tags, r, w, out[0], batch, depth - 1) for r in readers]
  if any(f is False for f in found):
    return False
  return True if any(f is True for f in found) else None


def _layouts(v, batch: int, segments: list[int]):
  shape = tuple(getattr(v.aval, "shape", ()))
  for a, n in enumerate(shape):
    for s in segments:
      if batch_long(n, s * batch):
        yield Batched(a, s)


def _position_sources(v, producers: dict, tags: dict, param_free, limit: int = 64) -> list:
  """The parameter-free positions (iotas, constants) a position was made from."""
  out, todo, seen = [], [v], set()
  while todo and len(seen) < limit:
    u = todo.pop()
    if u in seen:
      continue
    seen.add(u)
    if isinstance(tags.get(u), Position) and param_free(u):
      out.append(u)
    elif (e := producers.get(u)) is not None:
      todo += [w for w in e.invars if flat.is_var(w) and isinstance(tags.get(w), Position)]
  return out


def _free_extremum(e: flat.Eqn, ins: list, param_free) -> bool:
  """A maximum (or another reduction that is not a sum) over the batch axis of a value the
  parameters do not reach: a batch statistic like a sum's, evaluated once."""
  if e.primitive.name not in rules.REDUCE_OTHER or len(ins) != 1 or len(e.outvars) != 1:
    return False
  (t,), (v,) = ins, e.invars
  return (isinstance(t, Batched) and t.axis in tuple(e.params.get("axes", ()))
          and flat.is_var(v) and param_free(v))


def _tag(e: flat.Eqn, ins: list, batch: int) -> list:
  if any(t in tags.EXTREMA for t in ins):
    raise NotSplittable(f"{_where(e)} reads a maximum or minimum over the batch of values of "
                        f"the parameters (examples interact; returned as it is, in has_aux, "
                        f"it splits)")
  if any(isinstance(t, Position) for t in ins):
    return _positional(e, ins, batch)
  n_out = len(e.outvars)
  has_b = any(isinstance(t, Batched) for t in ins)
  has_r = any(isinstance(t, Reduced) for t in ins)
  if has_b and has_r:
    raise NotSplittable(f"{_where(e)} combines per-example values with a value reduced over "
                        f"the batch (a batch statistic, as BatchNorm's)")
  if has_r:
    return [_reduced(e, ins)] * n_out
  name = e.primitive.name
  rule = rules.RULES.get(name)
  if rule is not None:
    return rule(e, ins, batch)
  if name in _UNITS or name in ("scan", "while", "cond", "shard_map"):
    return units.tag(e, ins, batch, analyse)
  if name in units.COLLECTIVES:
    return units.collective(e, ins)
  if name in ELEMENTWISE:
    return rules.elementwise(e, ins)
  if name in _KEY_LEADING:
    return rules.key_leading(e, ins, batch)
  if name in _CALLBACKS:
    raise NotSplittable(f"{_where(e)} calls back to Python with per-example values (the "
                        f"guard cannot see what it does with the batch)")
  raise NotSplittable(f"{_where(e)}: the guard has no rule for `{name}` on per-example "
                      f"values (it may write or read at batch positions)")


def _positional(e: flat.Eqn, ins: list, batch: int) -> list:
  """An op reading the examples' positions. With per-example values: refused where a
  position lands where the batch does (a weight, a mask, an index by position), otherwise
  the op is tagged as without them. Alone (or with batch sums: evaluated once, at the whole
  batch): their axes are followed as a batch axis's would be, one at a time; an op that
  moves them some other way lets them go."""
  plain = [None if isinstance(t, Position) else t for t in ins]
  if not any(isinstance(t, Batched) for t in plain):
    return _tag(e, plain, batch) if any(t is not None for t in plain) else _follow(e, ins, batch)
  joint = [Batched(min(t.axes)) if isinstance(t, Position) else t for t in ins]
  try:
    tagged = _tag(e, plain, batch)
  except NotSplittable:
    if _tag_or_none(e, joint, batch) is None:
      raise
    raise _read_positions(e) from None  # refused for where the positions go: say so
  for ps in _one_position_each(ins):
    moved = _tag_or_none(e, ps, batch) or ()
    if any(t is not None and t == b for t, b in zip(moved, tagged)):
      raise _read_positions(e)
  return tagged


def _tag_or_none(e: flat.Eqn, ins: list, batch: int) -> list | None:
  try:
    return _tag(e, ins, batch)
  except NotSplittable:
    return None


def _one_position_each(ins: list):
  for i, t in enumerate(ins):
    for axis in sorted(t.axes) if isinstance(t, Position) else ():
      yield [Batched(axis) if j == i else None for j in range(len(ins))]


def _follow(e: flat.Eqn, ins: list, batch: int) -> list:
  outs: list[set[int]] = [set() for _ in e.outvars]
  for ps in _one_position_each(ins):
    for out, t in zip(outs, _tag_or_none(e, ps, batch) or ()):
      if isinstance(t, Batched):
        out.add(t.axis)
  return [Position(frozenset(o)) if o else None for o in outs]


def _read_positions(e: flat.Eqn) -> NotSplittable:
  return NotSplittable(f"{_where(e)} reads the examples' positions in the batch (from "
                       f"`jnp.arange` over it, or a constant or callback result the batch's "
                       f"length that differs along it; a microbatch counts from 0 again). To "
                       f"take each example's entry, `jnp.take_along_axis` splits; per-example "
                       f"weights split when passed with the batch")


def _reduced(e: flat.Eqn, ins: list) -> Reduced:
  """A sum stays a sum under linear maps; anything else makes a combined value."""
  name = e.primitive.name
  if COMBINED in ins:
    return COMBINED
  kinds = list(ins)
  if name in _LINEAR_1 and kinds[0] is SUM and all(t is None for t in kinds[1:]):
    return SUM
  if name in ("add", "sub", "add_any") and all(t is SUM for t in kinds):
    return SUM
  # Scaling by a constant is linear too, but the constant may be the batch's size (a mean's
  # divisor): it is applied once, to the totals, where it is the whole batch's.
  return COMBINED
