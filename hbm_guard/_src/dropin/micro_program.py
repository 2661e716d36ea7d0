"""The loss traced on one microbatch, held equation for equation against the whole batch's.

The batch analysis (`batch_axis`) reads the loss at the whole batch. A microbatch runs the
loss traced again at the microbatch's size, so whatever the loss computes from the batch's
*size* rather than from its examples is where the two programs can part: a constant as
long as the batch, `jnp.arange(n * L)`, `x / n`. This module traces the microbatch program
and checks, equation by equation of its per-example part:
- every per-example value is its whole-batch value with the batch axis k times shorter;
- every other value has the same shape and the same parameters in both programs, unless it
  is provably the same along the axes that shrank (a broadcast of a scalar: `zeros(n)`), or
  drawn from a random key (each microbatch draws its own numbers);
- every literal is the same number in both (not the batch's size).
Where a parameter-free equation fails, its values are computed once over the whole batch
instead (`Hoist`): a part of the loss that reads no parameter is what jax.jit computes, and
each microbatch is given its share. Anywhere else the split is refused by name.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Any, Callable

import jax
import numpy as np

from hbm_guard._src.dropin import batch_axis
from hbm_guard._src.dropin import jaxpr_flat as flat

# Equations that act on each element (those with an axis of their own excepted): a value
# made by them from values the same along an axis is the same along it.
_SAME_ALONG = batch_axis.ELEMENTWISE - {"cumsum", "cumprod", "cummax", "cummin",
                                        "cumlogsumexp", "sort", "rev", "threefry2x32",
                                        "random_fold_in"}


class Check(enum.StrEnum):
  """Which check an equation of the microbatch program failed."""
  SHRINKS = "does not shrink with the microbatch"
  SHAPE = "is as long as the batch but not split with it"
  PARAMS = "is built from the batch's size"
  LITERAL = "uses the batch size as a number in per-example work"
  SEGMENTS = "takes segments of the batch at other offsets"


class Hoist(Exception):
  """A parameter-free equation of the per-example part differs at a microbatch: its values
  are to be computed once over the whole batch."""

  def __init__(self, eqn: flat.Eqn, check: Check):
    super().__init__(f"{batch_axis.where(eqn)} {check.value}")
    self.eqn, self.check = eqn, check


@dataclasses.dataclass(frozen=True)
class MicroProgram:
  """The loss on one microbatch: its program, and where the whole program's values are."""
  closed: Any
  prog: flat.Program
  slot: dict  # whole-batch slot -> microbatch slot
  frontier: list  # microbatch slots of the batch sums
  outs: list  # microbatch slots of the per-example outputs
  indices: list  # the equations a microbatch evaluates
  given: list  # microbatch slots computed once over the whole batch (hoisted, split)


class OnMicrobatch(batch_axis.NotSplittable):
  """Refused on a microbatch's trace, the whole batch's analysis having split it: a
  reading of the batch that got this far says more than one refused at the whole batch."""


def abstract_of(x) -> jax.ShapeDtypeStruct:
  """`x`'s type as it is (its dtype, weak type and sharding, as `microbatch_of` keeps)."""
  if not getattr(x, "shape", ()):
    aval = jax.typeof(x)
    return jax.ShapeDtypeStruct((), x.dtype, weak_type=getattr(aval, "weak_type", False))
  return microbatch_of(x, x.shape[0], 0)


def microbatch_of(x, rows: int, axis: int) -> jax.ShapeDtypeStruct:
  """`x`'s type with `axis` `rows` long (a microbatch's share): its dtype, weak type and,
  where the step is traced under a mesh, its sharding (whose absence would trace otherwise:
  a scalar meeting it is resharded, as in flax's attention masks)."""
  aval = jax.typeof(x)
  sharding = getattr(aval, "sharding", None)
  if sharding is not None and getattr(getattr(sharding, "mesh", None), "empty", True):
    sharding = None
  shape = tuple(x.shape)
  return jax.ShapeDtypeStruct(shape[:axis] + (rows,) + shape[axis + 1:], x.dtype,
                              sharding=sharding, weak_type=getattr(aval, "weak_type", False))


def trace(g: Callable, inputs: tuple, whole: flat.Program, consts, tags: dict, axes,
          frontier, batched_outs, given: dict, batch: int, k: int,
          param_free: Callable[[Any], bool], own_index: frozenset = frozenset(),
          again: Callable[[int], Any] | None = None) -> MicroProgram:
  """Traces `g(diff, other, batch values)` at a microbatch of `batch // k` examples and holds
  it against `whole`; raises NotSplittable, or `Hoist` for a parameter-free equation.
  `given`: whole-batch slots computed once over the whole batch (their tag, or None);
  `own_index`: an iota's values that index each example's own row (counted per microbatch,
  with the microbatch's size where the whole counts the batch's); `again(k)`: the loss
  traced again from the step's own call at a microbatch's shapes, tried where the loss
  alone does not trace there as it does at the whole batch (sizes read before the loss)."""
  held = functools.partial(_held, whole=whole, tags=tags, frontier=frontier,
                           batched_outs=batched_outs, given=given, k=k,
                           param_free=param_free, own_index=own_index)
  try:
    return held(*_alone(g, inputs, whole, consts, axes, batch, k))
  except OnMicrobatch as refused:
    if again is None:
      raise
    try:
      prog, closed = _through_the_step(again, whole, consts, inputs, tags, k)
    except OnMicrobatch:
      raise refused from None
    return held(prog, closed)  # (held there, its own refusal names the equation)


def _alone(g: Callable, inputs: tuple, whole: flat.Program, consts, axes, batch: int, k: int):
  """The loss alone traced at a microbatch's shapes: (program, closed jaxpr)."""
  m = batch // k
  diff, other, batch_vals = inputs
  axes = [a.axis if isinstance(a, batch_axis.Batched) else a for a in axes]
  shapes = [microbatch_of(x, x.shape[a] // k, a) for x, a in zip(batch_vals, axes)]
  try:
    closed = jax.make_jaxpr(g)(diff, other, shapes)
  except Exception as e:  # pylint: disable=broad-except  (a shape fixed at the batch's size)
    at = batch_axis.tags.raised_at(e)
    raise OnMicrobatch(
        f"the loss does not trace on a microbatch of {m} examples ({type(e).__name__}: "
        f"{str(e).splitlines()[0] if str(e) else ''}{' at ' + at if at else ''}); a value "
        f"sized by the whole batch meets per-example values: an argument not split with "
        f"it, or an array the loss makes at a size taken outside it "
        f"(`jax.random.uniform(key, (B, 1))` with B read before the loss, or `lp[:n]` with "
        f"`n = x.shape[0]` read before it: read it from the batch's own shape inside the "
        f"loss)") from None
  prog = flat.flatten(closed)
  if not flat.same_structure(whole, prog) or len(closed.consts) != len(consts):
    raise OnMicrobatch(_parted(whole, prog, m, batch))
  return prog, closed


def _through_the_step(again: Callable[[int], Any], whole: flat.Program, consts, inputs,
                      tags: dict, k: int):
  """The loss as the step traced again at a microbatch's shapes calls it: (program,
  closed jaxpr with the whole trace's constants). Its inputs must be the whole batch's,
  the batch's shrunk, its constants the same, else OnMicrobatch."""
  try:
    closed = again(k).closed
  except Exception as e:  # pylint: disable=broad-except  (the step does not trace there)
    raise OnMicrobatch(f"the step does not trace on a microbatch ({type(e).__name__})") from None
  prog = flat.flatten(closed)
  if (not flat.same_structure(whole, prog) or len(closed.consts) != len(consts)
      or len(prog.invars) != len(whole.invars)
      or [v.aval for v in whole.constvars] != [v.aval for v in prog.constvars]
      or any(tuple(u.aval.shape) != _shrunk(v.aval.shape, tags.get(v), k)
             or u.aval.dtype != v.aval.dtype for v, u in zip(whole.invars, prog.invars))):
    raise OnMicrobatch("the step traced on a microbatch calls the loss otherwise")
  return prog, closed.replace(consts=list(consts))


def _held(prog: flat.Program, closed, *, whole: flat.Program, tags: dict, frontier,
          batched_outs, given: dict, k: int, param_free, own_index) -> MicroProgram:
  """The microbatch's program held against the whole's, equation by equation."""
  slot = {a: b for x, y in zip(whole.eqns, prog.eqns) for a, b in zip(x.outvars, y.outvars)}
  slot.update(zip(whole.invars, prog.invars))
  slot.update(zip(whole.constvars, prog.constvars))
  for v, tag in given.items():
    want = _shrunk(v.aval.shape, tag, k)
    if tuple(slot[v].aval.shape) != want:
      raise OnMicrobatch(
          f"a value computed once over the whole batch ({v.aval.str_short()}) is "
          f"{slot[v].aval.str_short()} on a microbatch, not {list(want)}: it is sized by the "
          f"whole batch, not by the batch it is computed from")
  micro_frontier = [slot[v] for v in frontier]
  outs = [prog.outvars[i] for i in batched_outs]
  indices = flat.needed(prog, micro_frontier + outs, given=[slot[v] for v in given])
  random = _random_values(whole)
  producers = {v: e for e in whole.eqns for v in e.outvars}
  for i in indices:
    w, u = whole.eqns[i], prog.eqns[i]
    if all(v in own_index for v in w.outvars):
      continue
    check = _check(w, u, tags, k, random, producers)
    if check is None:
      continue
    if all(param_free(v) for v in w.outvars):
      raise Hoist(w, check)
    raise OnMicrobatch(_refusal(w, u, check))
  return MicroProgram(closed, prog, slot, micro_frontier, outs, indices,
                      [slot[v] for v in given])


def _parted(whole: flat.Program, micro: flat.Program, m: int, batch: int) -> str:
  """Where the microbatch's trace leaves the whole batch's: Python that branches on the
  batch's size (`if x.shape[0] > 8`, a loop over its length) or a shape-dependent library
  path, named by its primitive and line."""
  w, u = flat.first_difference(whole, micro)
  at = (f"{batch_axis.where(w)}, where the trace at {m} examples has "
        f"{u.primitive.name if u is not None else 'nothing'}" if w is not None
        else f"{batch_axis.where(u)} at {m} examples, past the end of the trace at {batch}")
  why = ("jax's own functions skip work on an axis of length 1, as `take_along_axis` does: "
         "a count that leaves 2 or more examples a microbatch" if m == 1
         else "Python that branches or loops on the batch's size")
  return (f"the loss traces differently on a microbatch of {m} examples than on the batch "
          f"of {batch}: {at} ({why})")


def _shrunk(shape, tag, k: int) -> tuple:
  shape = tuple(shape)
  if not isinstance(tag, batch_axis.Batched):
    return shape
  return shape[:tag.axis] + (shape[tag.axis] // k,) + shape[tag.axis + 1:]


def _check(w: flat.Eqn, u: flat.Eqn, tags: dict, k: int, random: set, producers: dict
           ) -> Check | None:
  """The first check equation `u` (the microbatch's) fails against `w` (the whole's)."""
  for a, b in zip(w.invars, u.invars):
    if _literal(a) is not None and not np.array_equal(_literal(a), _literal(b)):
      return Check.LITERAL
  batched = reshaped = False
  for v, x in zip(w.outvars, u.outvars):
    tag = tags.get(v)
    ws, ms = tuple(v.aval.shape), tuple(x.aval.shape)
    if isinstance(tag, batch_axis.Batched):
      batched = True
      if ms != _shrunk(ws, tag, k):
        return Check.SHRINKS
    elif ws != ms:
      reshaped = True  # (its parameters say so too: not compared)
      if v not in random and not same_along(
          v, {d for d, (p, q) in enumerate(zip(ws, ms)) if p != q} if len(ws) == len(ms)
          else None, producers):
        return Check.SHAPE
  if any(isinstance(tags.get(v), batch_axis.Batched) for v in w.invars if flat.is_var(v)):
    batched = True
    if w.primitive.name in ("slice", "split") and not _segments_scale(w, u, tags, k):
      return Check.SEGMENTS
  if not (batched or reshaped) and not any(v in random for v in w.outvars) and not _same_params(w, u):
    return Check.PARAMS
  return None


def _refusal(w: flat.Eqn, u: flat.Eqn, check: Check) -> str:
  shapes = (f" ({', '.join(v.aval.str_short() for v in w.outvars)} at the whole batch, "
            f"{', '.join(v.aval.str_short() for v in u.outvars)} at a microbatch)")
  why = {
      Check.SHRINKS: ": a value as long as the batch that is not split with it (a constant "
                     "or an argument) meets per-example values",
      Check.SHAPE: ": its entries would count from 0 again in each microbatch (a position "
                   "or a constant sized by the batch, read by work on the parameters)",
      Check.PARAMS: ": a shape or a count taken from the batch's size, read by work on the "
                    "parameters",
      Check.LITERAL: " (e.g. x / batch_size before a sum, on values of the parameters)",
      Check.SEGMENTS: ": the batch's segments are cut where the microbatch's are not",
  }[check]
  return f"{batch_axis.where(w)} {check.value}{shapes if check is not Check.LITERAL else ''}{why}"


def _literal(atom):
  return None if flat.is_var(atom) or isinstance(atom, flat.Const) else np.asarray(atom.val)


def _random_values(prog: flat.Program) -> set:
  """Values drawn from random keys (each microbatch draws its own: a dropout mask)."""
  out: set = set()
  for e in prog.eqns:
    name = e.primitive.name
    if name.startswith(("random_", "threefry")) or any(
        flat.is_var(v) and v in out for v in e.invars):
      out.update(e.outvars)
  return out


def same_along(v, axes: set | None, producers: dict, depth: int = 0) -> bool:
  """Whether `v` is provably the same at every index of `axes` (a broadcast of what does
  not hold them, and elementwise ops of such values)."""
  if axes is None or depth > 32:
    return False
  if not axes:
    return True
  e = producers.get(v)
  if e is None:
    return False
  name = e.primitive.name
  if name == "broadcast_in_dim":
    (operand,) = e.invars[:1]
    dims = tuple(e.params["broadcast_dimensions"])
    shape = batch_axis.tags.shape_of(operand)
    inner = {dims.index(d) for d in axes if d in dims and shape[dims.index(d)] != 1}
    return not inner or (flat.is_var(operand) and same_along(operand, inner, producers,
                                                              depth + 1))
  if name in ("reshape", "squeeze", "expand_dims") and flat.is_var(e.invars[0]):
    inner = _unit_dims_moved(batch_axis.tags.shape_of(e.invars[0]), tuple(v.aval.shape), axes)
    return inner is not None and same_along(e.invars[0], inner, producers, depth + 1)
  if name in _SAME_ALONG:
    return all(_operand_same_along(x, axes, producers, depth) for x in e.invars)
  if name == "transpose":
    perm = tuple(e.params["permutation"])
    return same_along(e.invars[0], {perm[d] for d in axes}, producers, depth + 1)
  if name in ("reduce_sum", "reduce_max", "reduce_min"):
    reduced = tuple(e.params["axes"])
    kept = [d for d in range(len(batch_axis.tags.shape_of(e.invars[0]))) if d not in reduced]
    return same_along(e.invars[0], {kept[d] for d in axes}, producers, depth + 1)
  if name == "dot_general":
    return _dot_same_along(e, axes, producers, depth)
  return False


def _operand_same_along(x, axes: set, producers: dict, depth: int) -> bool:
  shape = batch_axis.tags.shape_of(x)
  if not shape or all(d >= len(shape) or shape[d] == 1 for d in axes):
    return True  # a scalar, or broadcast along them
  if not flat.is_var(x):  # a constant: the same along them if it is
    value = np.asarray(flat.read(x, {}))
    return all(np.array_equal(value, np.broadcast_to(np.take(value, [0], axis=d), value.shape))
               for d in axes)
  return same_along(x, axes, producers, depth + 1)


def _dot_same_along(e: flat.Eqn, axes: set, producers: dict, depth: int) -> bool:
  """A product's output axis comes from a free axis of one operand (the same along it if
  that operand is) or a batch axis of both."""
  (lc, rc), (lb, rb) = e.params["dimension_numbers"]
  ranks = [len(batch_axis.tags.shape_of(v)) for v in e.invars[:2]]
  free = [[d for d in range(ranks[s]) if d not in (lc, rc)[s] and d not in (lb, rb)[s]]
          for s in (0, 1)]
  origin = ([[(0, a), (1, b)] for a, b in zip(lb, rb)] + [[(0, d)] for d in free[0]]
            + [[(1, d)] for d in free[1]])
  want: list[set] = [set(), set()]
  for d in axes:
    for side, a in origin[d]:
      want[side].add(a)
  return all(not want[s] or (flat.is_var(e.invars[s]) and same_along(
      e.invars[s], want[s], producers, depth + 1)) for s in (0, 1))


def _unit_dims_moved(shape_in: tuple, shape_out: tuple, axes: set) -> set | None:
  """`axes` of `shape_out` as axes of `shape_in`, where the reshape only adds or drops
  dimensions of size 1 (`labels[:, None]`); None otherwise."""
  keep_in = [d for d, n in enumerate(shape_in) if n != 1]
  keep_out = [d for d, n in enumerate(shape_out) if n != 1]
  if [shape_in[d] for d in keep_in] != [shape_out[d] for d in keep_out]:
    return None
  if any(d not in keep_out for d in axes):
    return None
  return {keep_in[keep_out.index(d)] for d in axes}


def _segments_scale(w: flat.Eqn, u: flat.Eqn, tags: dict, k: int) -> bool:
  """A slice or split along the batch axis cuts the microbatch where it cuts the batch,
  k times nearer the start."""
  tag = next(t for v in w.invars if flat.is_var(v)
             and isinstance(t := tags.get(v), batch_axis.Batched))
  a = tag.axis
  if w.primitive.name == "split":
    return (w.params["axis"] != a or all(
        p == q * k for p, q in zip(w.params["sizes"], u.params["sizes"])))
  return (w.params["start_indices"][a] == u.params["start_indices"][a] * k
          and w.params["limit_indices"][a] == u.params["limit_indices"][a] * k)


def _same_params(w: flat.Eqn, u: flat.Eqn) -> bool:
  """Whether the plain-data parameters of two equations agree (shapes, counts, indices);
  functions and nested programs are not compared."""
  for key, a in w.params.items():
    b = u.params.get(key)
    if _plain(a) and _plain(b):
      try:
        if not bool(np.array_equal(np.asarray(a, dtype=object), np.asarray(b, dtype=object))):
          return False
      except Exception:  # pylint: disable=broad-except  (not comparable: not compared)
        continue
  return True


def _plain(x, depth: int = 0) -> bool:
  if depth > 4:
    return False
  if x is None or isinstance(x, (bool, int, float, str, np.integer, np.floating)):
    return True
  if isinstance(x, (tuple, list)):
    return all(_plain(y, depth + 1) for y in x)
  return False
