"""Where the batch goes in a loss: per example, summed over, or combined from sums.

Each value of a flat loss program gets a tag:
- no tag: independent of the batch (parameters, constants);
- `Batched(axis)`: per example; the batch is the major factor of `axis`;
- `SUM`: an additive sum over the batch (the microbatches' values add up to the batch's);
- `COMBINED`: computed from sums (a mean, `sum(l * w) / sum(w)`): evaluated once, from
  the whole batch's sums;
- `Position(axes)`: made from the batch's size, not from the batch (`jnp.arange(n)`): it
  counts the examples, and a microbatch counts from 0 again, so per-example work that
  reads it (a weight, a mask, `x[jnp.arange(n), y]`) is refused. Along an axis other than
  the batch's (a sequence as long as the batch) it is a constant.
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

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from hbm_guard._src import batch_rules as rules
from hbm_guard._src import batch_tags as tags
from hbm_guard._src import custom_rules
from hbm_guard._src import jaxpr_flat as flat


NotSplittable, Batched, Position, Reduced = (tags.NotSplittable, tags.Batched, tags.Position,
                                            tags.Reduced)
SUM, COMBINED = tags.SUM, tags.COMBINED
constant_tag, where = tags.constant_tag, tags.where
_where, _shape = tags.where, tags.shape_of
# Ops under which a sum stays additive: they only move or retype the summed values.
_LINEAR_1 = frozenset({"convert_element_type", "neg", "reshape", "squeeze", "broadcast_in_dim",
                       "transpose", "reduce_sum", "copy", "copy_p", "real", "imag"})
_UNITS = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr", "checkpoint",
                    "remat", "custom_lin"})
CUSTOM_RULES = custom_rules.NAMES
# Primitives that act on each element (or, with an axis parameter, along that axis only:
# refused where it is the batch's). Everything else needs a rule of its own.
_ELEMENTWISE = frozenset({
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
})
# Key primitives that keep a key array's leading axes (and append their own at the end).
_KEY_LEADING = frozenset({"random_bits", "random_split", "random_wrap", "random_unwrap"})
_CALLBACKS = frozenset({"pure_callback", "io_callback", "callback", "ffi_call"})


def analyse(prog: flat.Program, batched: dict[Any, Any], batch: int,
            consts: Sequence[Any] = (), hoisted: set | None = None,
            param_free: Callable[[Any], bool] | None = None) -> dict[Any, Any]:
  """Tags of every value of `prog`, given the batch inputs' axes (or tags) and the values
  of its constvars (`consts`, where known); raises NotSplittable.

  With `param_free` (which values do not depend on the parameters), a batch statistic that
  is parameter-free and meets per-example values (advantages normalised by their batch mean
  and deviation, `mask / mask.sum()`) is added to `hoisted` instead of refused: computed
  once over the whole batch, it is a constant to each microbatch."""
  tags: dict[Any, Any] = {v: a if isinstance(a, (Batched, Position, Reduced)) else Batched(a)
                          for v, a in batched.items()}
  for v, c in zip(prog.constvars, consts):
    if v not in tags and (t := constant_tag(c, batch)) is not None:
      tags[v] = t
  const_tags: dict[int, Position | None] = {}  # an inlined constant is read once

  def const_tag(c: flat.Const) -> Position | None:
    if id(c) not in const_tags:
      const_tags[id(c)] = constant_tag(c.value, batch)
    return const_tags[id(c)]

  for e in prog.eqns:
    ins = [tags.get(v) if flat.is_var(v) else (
        const_tag(v) if isinstance(v, flat.Const) else None) for v in e.invars]
    if not any(t is not None for t in ins):
      name = e.primitive.name
      if name == "iota" and e.outvars[0].aval.shape[e.params["dimension"]] == batch:
        tags[e.outvars[0]] = Position(frozenset({e.params["dimension"]}))
      elif name in _CALLBACKS:  # its result may differ at every position: never uniform
        for v in e.outvars:
          axes = frozenset(i for i, d in enumerate(getattr(v.aval, "shape", ())) if d == batch)
          if axes:
            tags[v] = Position(axes)
      continue
    if param_free is not None and _free_extremum(e, ins, param_free):
      tags[e.outvars[0]] = COMBINED  # (logsumexp's maximum): evaluated over the whole batch
      continue
    if param_free is not None and any(isinstance(t, (Batched, Position)) for t in ins):
      for i, (v, t) in enumerate(zip(e.invars, ins)):
        if isinstance(t, Reduced) and flat.is_var(v) and param_free(v):
          hoisted.add(v)
          ins[i] = None
    for v, t in zip(e.outvars, _tag(e, ins, batch)):
      if t is not None:
        tags[v] = t
  return tags


def _free_extremum(e: flat.Eqn, ins: list, param_free) -> bool:
  """A maximum (or another reduction that is not a sum) over the batch axis of a value the
  parameters do not reach: a batch statistic like a sum's, evaluated once."""
  if e.primitive.name not in rules.REDUCE_OTHER or len(ins) != 1 or len(e.outvars) != 1:
    return False
  (t,), (v,) = ins, e.invars
  return (isinstance(t, Batched) and t.axis in tuple(e.params.get("axes", ()))
          and flat.is_var(v) and param_free(v))


def _tag(e: flat.Eqn, ins: list, batch: int) -> list:
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
  if name in _UNITS or name == "scan" or name == "cond":
    return _unit(e, ins, batch)
  if name == "while":
    raise NotSplittable(f"{_where(e)} loops over per-example values")
  if name in _ELEMENTWISE:
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


def _unit(e: flat.Eqn, ins: list, batch: int) -> list:
  """custom_jvp / custom_vjp / checkpoint / scan / cond: the tags of their body."""
  name = e.primitive.name
  if name == "scan":
    return _scan(e, ins, batch)
  if name == "cond":
    outs = None
    if ins[0] is not None:
      raise NotSplittable(f"{_where(e)} branches on a per-example value")
    for branch in e.params["branches"]:
      got = _body(branch, ins[1:], batch)
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
  outs = _no_combined(e, _body(sub, ins[len(ins) - n_in:], batch))
  if name in CUSTOM_RULES:
    custom_rules.check(e, ins, outs, batch, analyse, NotSplittable, _where(e))
  return outs


def _no_combined(e, outs):
  if COMBINED in outs:
    raise NotSplittable(f"{_where(e)} computes from batch sums inside itself")
  return outs


def _body(closed, ins: Sequence, batch: int) -> list:
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


def _scan(e: flat.Eqn, ins: list, batch: int) -> list:
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
    x_tags.append(Batched(t.axis - 1) if isinstance(t, Batched) else t)
  if any(isinstance(t, Reduced) for t in ins):
    raise NotSplittable(f"{_where(e)} carries a batch sum")
  # A carry that sums from a literal zero (a loss summed chunk by chunk) adds up over the
  # microbatches as the whole batch's; one from any other start would count it k times.
  from_zero = [_is_zero(a) for a in e.invars[n_consts:n_consts + n_carry]]
  for _ in range(n_carry + 3):
    outs = _body(p["jaxpr"], [*consts, *carry, *x_tags], batch)
    new_carry = [_carried(e, a, b, zero) for a, b, zero in zip(outs[:n_carry], carry, from_zero)]
    if new_carry == list(carry):
      break
    carry = new_carry
  else:
    raise NotSplittable(f"{_where(e)}: its carry changes how it holds the batch")
  ys = [Batched(t.axis + 1) if isinstance(t, Batched) else t for t in outs[n_carry:]]
  return _no_combined(e, [*carry, *ys])


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


