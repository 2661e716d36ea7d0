"""How a traced loss splits over the batch: its batch sums, how each microbatch is
differentiated, and what is computed once over the whole batch.

`batch_axis` tags every value of the loss's program; this module reads the tags as a
split: the sums the combining part reads (the frontier), which of them a gradient reaches,
the scheme that pulls each microbatch back (`Scheme`), and, at a microbatch count, the
loss traced on one microbatch and held against the whole (`micro_program`), moving to the
whole batch what reads no parameter and a microbatch could not compute alike.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hbm_guard._src.dropin import auto_grad
from hbm_guard._src.dropin import batch_axis
from hbm_guard._src.dropin import batch_context
from hbm_guard._src.dropin import custom_rules
from hbm_guard._src.dropin import jaxpr_flat as flat
from hbm_guard._src.dropin import micro_program
from hbm_guard._src.dropin import sum_cotangent

Traced = auto_grad.Traced
describe_leaf = batch_context.describe_leaf


class Scheme(enum.StrEnum):
  """How each microbatch is differentiated (the report states it)."""
  # the sums' cotangent reads neither the parameters nor the sums that depend on them (a
  # mean: 1/B): each microbatch pulled back with the very cotangent jax.jit gives it
  KNOWN = "known"
  # otherwise, the sums totalled first in a forward pass over the microbatches, then each
  # microbatch pulled back with the cotangent the totals give: any function of any number
  # of sums, and a custom rule inside sees jax.jit's cotangent (one more forward each)
  TOTALS_FIRST = "totals first"
  # one sum of one element (`log(mean(l))`): its gradient accumulated, scaled once
  PER_ELEMENT = "per element"
  # batch statistics the parameters reach, read per example by the loss (Pearson's centred
  # moments, VICReg's covariance): their sums totalled in a pass of their own, then the
  # loss's sums with the statistics given, then each microbatch pulled back through the
  # loss's sums and, with the cotangent that gives the statistics, through theirs
  STAGED = "staged"


_HOW = {
    Scheme.KNOWN: "; each microbatch pulled back with the cotangent jax.jit gives the sums, "
                  "known before the totals",
    Scheme.TOTALS_FIRST: "; the sums totalled first, in a forward pass over the "
                         "microbatches, then each microbatch pulled back with the cotangent "
                         "the totals give (one more forward pass per microbatch)",
    Scheme.PER_ELEMENT: "; the sum's gradient accumulated and scaled once by the cotangent "
                        "of the total",
    Scheme.STAGED: "; the statistics' sums totalled first, stage by stage, then the sums "
                   "that read them, then each microbatch pulled back through all of them "
                   "(per stage, one more forward pass and one more pullback per microbatch, "
                   "and one more forward pass for the loss's sums)",
}
_MAX_HOISTS = 32  # parameter-free equations moved to the whole batch, at most
MAX_STAGES = 4  # batch statistics computed from one another, at most this deep


@dataclasses.dataclass(frozen=True)
class Split:
  """How the loss splits: its batch sums, which carry gradients, what is per example."""
  tags: dict
  frontier: tuple  # sums the combining part reads (slots of the whole-batch program)
  dep: tuple[bool, ...]  # per frontier sum: does a gradient reach it from the parameters
  batched_outs: tuple[int, ...]  # output positions that are per example
  description: str
  scheme: Scheme | None = None  # None: not decided (traced whole)
  # Parameter-free batch statistics read by per-example work: evaluated once over the whole
  # batch, given to each microbatch as constants.
  hoisted: tuple = ()
  # Parameter-free values as long as the batch that per-example work reads (positions,
  # batch-length constants, values the batch's size shaped): evaluated once over the whole
  # batch and split like it; slot -> its layout (batch_axis.Batched).
  split: tuple = ()
  micro: micro_program.MicroProgram | None = None  # the loss on one microbatch, checked
  # Batch statistics the parameters reach that per-example work reads (`Scheme.STAGED`),
  # in stages: ((statistics, the sums they are computed from), ...), each stage's sums
  # reading only earlier stages' statistics; each microbatch is given their totals.
  stages: tuple = ()

  @property
  def staged(self) -> tuple:
    return tuple(v for stats, _ in self.stages for v in stats)

  @property
  def stage_sums(self) -> tuple:
    return tuple(dict.fromkeys(v for _, sums in self.stages for v in sums))


def analyse(t: Traced, batch: int, k: int = 1) -> Split:
  """How the traced loss splits over the batch into `k` microbatches (1: traced whole, for
  the default plan); raises batch_axis.NotSplittable. At k > 1 the loss is also traced on
  one microbatch and held against the whole (`micro_program`)."""
  prog = t.prog
  n_diff = sum(k_ == "diff" for k_ in t.kinds)
  n_other = sum(k_ == "other" for k_ in t.kinds)
  batch_slots = prog.invars[n_diff + n_other:]
  if not batch_slots:
    raise batch_axis.NotSplittable(
        f"no input of the loss holds the step's batch of {batch} examples (a part of it, "
        f"such as minibatches the step scans over itself, is not split again)")
  for c in t.closed.consts:
    if (isinstance(c, jax.core.Tracer) and getattr(c, "ndim", 0) >= 1 and c.shape[0] == batch
        and id(c) not in t.state_ids):  # a state leaf the batch's size (BatchNorm's 128 means)
      # or a leaf of an argument that is not the batch
      raise batch_axis.NotSplittable(
          f"a batch-sized value {describe_leaf(c)} reaches the loss other than through its "
          f"arguments or closure (pass it as an argument)")
  params = set(prog.invars[:n_diff])
  value_dep = _depends(prog, params)
  grad_dep = _grad_depends(prog, params)
  param_free = lambda v: v not in value_dep  # noqa: E731
  split: dict = {}  # values taken as per-example data: value -> layout
  own_index: set = set()  # of those, iotas that index each example's own row: counted per microbatch
  forced: set = set()  # of those, ones a microbatch cannot compute alike: split, never computed
  extra: set = set()  # values moved to the whole batch by the microbatch program's checks
  producers = {v: e for e in prog.eqns for v in e.outvars}
  for _ in range(_MAX_HOISTS):
    seen: list = []
    hoisted: set = set()
    staged: set = set()
    token = custom_rules.SEEN.set(seen)
    try:
      tags = batch_axis.analyse(prog, dict(zip(batch_slots, t.axes)), batch, t.closed.consts,
                                hoisted, param_free, split, own_index, staged)
    finally:
      custom_rules.SEEN.reset(token)
    hoisted = (hoisted | extra) - split.keys()
    # A value the same in every example (`zeros(n)` as labels) each microbatch computes for
    # itself; any other (a position) is computed once over the whole batch and split.
    shared = {v: tag for v, tag in split.items() if v not in own_index and (
        v in forced or not micro_program.same_along(v, {tag.axis}, producers))}
    given = hoisted | shared.keys() | staged
    outs = [tags.get(v) if flat.is_var(v) else None for v in prog.outvars]
    if outs[0] in batch_axis.tags.EXTREMA:
      raise batch_axis.NotSplittable("the loss is a maximum or minimum over the batch "
                                     "(examples interact)")
    if not isinstance(outs[0], batch_axis.Reduced):
      raise batch_axis.NotSplittable("the loss does not depend on the batch")
    frontier = tuple(v for v in _frontier(prog, tags, prog.outvars, given) if v not in staged)
    _refuse_extrema(prog, tags, frontier, False, staged)
    stages = _stages(prog, tags, staged, given - staged, value_dep, frontier)
    stage_sums = tuple(dict.fromkeys(v for _, sums in stages for v in sums))
    _refuse_extrema(prog, tags, stage_sums, True, staged)
    if not frontier and outs[0] is batch_axis.COMBINED:  # (split, it would save nothing)
      raise batch_axis.NotSplittable(
          "no part of the loss is computed per example: it reads the whole batch at once "
          "(as a recurrence carried across examples does)")
    # per-example outputs, and extrema over the batch (both from each microbatch, combined)
    batched_outs = tuple(i for i, tag in enumerate(outs) if isinstance(tag, batch_axis.Batched)
                         or tag in batch_axis.tags.EXTREMA)
    for i in batched_outs:
      if isinstance(outs[i], batch_axis.Batched) and outs[i].axis != 0 and (
          prog.outvars[i].aval.shape[outs[i].axis] % batch):
        raise batch_axis.NotSplittable(f"output {i} holds the batch unevenly")
    if k <= 1:
      micro = None
      break
    try:
      micro = micro_program.trace(
          t.g, t.inputs(), prog, t.closed.consts, tags, t.axes,
          list(dict.fromkeys([*frontier, *stage_sums])), batched_outs,
          {**{v: None for v in hoisted | staged}, **shared}, batch, k, param_free,
          frozenset(own_index), again=t.again)
      break
    except micro_program.Hoist as h:
      if all(v in given for v in h.eqn.outvars):
        raise batch_axis.NotSplittable(str(h)) from None
      for v in h.eqn.outvars:
        shares, stats = _to_the_whole_batch(prog, tags, v, batch, param_free, str(h))
        for u, tag in shares.items():
          split[u] = split.get(u, tag)
          forced.add(u)
        extra.update(stats)
  else:
    raise batch_axis.NotSplittable(f"more than {_MAX_HOISTS} parameter-free values differ "
                                   f"on a microbatch")
  dep = tuple(v in grad_dep for v in frontier)
  before_stats = _custom_vjp_rules(prog, flat.needed(prog, list(stage_sums), given=given),
                                   grad_dep)
  if before_stats:  # its backward would run twice, on the two parts of jax.jit's cotangent
    raise batch_axis.NotSplittable(
        f"a custom derivative rule ({batch_axis.where(before_stats[0])}) acts on values a "
        f"batch statistic of the parameters' values is computed from: split, it would see "
        f"the statistic's part of the cotangent apart from the rest")
  rules = _custom_vjp_rules(prog, flat.needed(prog, [*frontier, *stage_sums], given=given),
                            grad_dep)
  unseen = [e for e in rules if not any(e.eqn is s for s in seen)]
  if unseen:
    raise batch_axis.NotSplittable(
        f"a custom derivative rule ({batch_axis.where(unseen[0])}) acts on the parameters "
        f"before the batch: split, it would see each microbatch's part of the gradient")
  n_grads = sum(int(np.prod(v.aval.shape)) for v, d in zip(frontier, dep) if d)
  scheme = None
  if staged and (k > 1 or seen):
    scheme = Scheme.STAGED
  elif k > 1 or seen:
    scheme = Scheme.KNOWN if known_cotangent(t, frontier, dep) else (
        Scheme.PER_ELEMENT if n_grads <= 1 and not seen else Scheme.TOTALS_FIRST)
  n_sums = len(frontier)
  kind = "the sum" if n_sums == 1 and outs[0] is batch_axis.SUM else (
      f"a function of {n_sums} batch sum{'s' * (n_sums != 1)}")
  free = n_sums - sum(dep)
  if free and n_sums > 1:
    kind += f" ({free} of them carry no gradient)"
  rule_note = f"; {len(seen)} custom derivative rule(s) read per example" if seen else ""
  hoisted_t = _in_order(prog, hoisted)
  split_t = tuple((v, shared[v]) for v in [*prog.constvars, *prog.eqns_outvars()] if v in shared)
  stats = (f"; {len(hoisted_t)} parameter-free batch statistic(s) computed once over the "
           f"whole batch" if hoisted_t else "")
  if split_t:
    stats += (f"; {len(split_t)} parameter-free value(s) as long as the batch (positions, "
              f"constants) computed once over the whole batch and split with it")
  if staged:
    n_ext = sum(tags.get(v) in batch_axis.tags.EXTREMA for v in stage_sums)
    stats += (f"; {len(staged)} batch statistic(s) of the parameters' values (from "
              f"{len(stage_sums) - n_ext} sum(s)"
              f"{f' and {n_ext} maxima or minima' if n_ext else ''} over the batch, in "
              f"{len(stages)} stage(s)) totalled first and given to each microbatch")
  checkpoints = _checkpoints(prog, flat.needed(prog, list(frontier), given=given))
  if checkpoints:
    stats += f"; the step's own {checkpoints} checkpoint(s) kept in each microbatch"
  return Split(tags, frontier, dep, batched_outs,
               f"loss: {kind}, accumulated over microbatches and combined once"
               f"{_HOW.get(scheme, '')}{rule_note}{stats} (exact)", scheme, hoisted_t,
               split_t, micro, stages)


def _in_order(prog: flat.Program, values: set) -> tuple:
  return tuple(v for v in [*prog.constvars, *prog.eqns_outvars()] if v in values)


def _frontier(prog: flat.Program, tags: dict, targets, given) -> tuple:
  """The batch sums (and extrema) the combining part of `targets` reads (stopping at
  `given`)."""
  kept = (batch_axis.SUM, *batch_axis.tags.EXTREMA)
  found = []
  for i in flat.needed(prog, targets, given=given):
    e = prog.eqns[i]
    if tags.get(e.outvars[0]) is batch_axis.COMBINED:
      found += [v for v in e.invars if flat.is_var(v) and tags.get(v) in kept]
  # (a maximum returned as it is, a metric in has_aux, is a per-microbatch output instead)
  found += [v for v in targets if flat.is_var(v) and tags.get(v) is batch_axis.SUM]
  return tuple(dict.fromkeys(found))


def _refuse_extrema(prog: flat.Program, tags: dict, sums, allowed: bool, staged) -> None:
  """A maximum over the batch is combined from the microbatches' maxima only as a statistic
  no gradient flows through (logsumexp's, under its stop_gradient): refused elsewhere."""
  producers = {v: e for e in prog.eqns for v in e.outvars}
  for v in sums:
    if tags.get(v) not in batch_axis.tags.EXTREMA:
      continue
    if allowed and not _grad_depends(prog, {v}) & set(staged):
      continue
    e = producers.get(v)
    raise batch_axis.NotSplittable(
        f"{batch_axis.where(e) if e is not None else 'the loss'} reads a maximum or minimum "
        f"over the batch of values of the parameters that a gradient flows through "
        f"(examples interact; returned as it is, in has_aux, or under stop_gradient, it "
        f"splits)")


def _stages(prog: flat.Program, tags: dict, staged: set, given: set, value_dep: set,
            frontier: tuple) -> tuple:
  """The batch statistics in `staged` in stages, each with the sums it is computed from:
  a statistic of values another one centred (a standard deviation after the mean, a
  softmax over the batch after its maximum) is a stage later. Refuses, by name, per-example
  values a statistic reached that meet the parameters again (the layers after a
  BatchNorm: each such layer would need its own passes), and more than MAX_STAGES."""
  if not staged:
    return ()
  reached = _depends(prog, staged)
  for i in flat.needed(prog, list(frontier), given=given | staged):
    e = prog.eqns[i]
    if not any(isinstance(tags.get(u), batch_axis.Batched) for u in e.outvars):
      continue
    if not any(flat.is_var(u) and u in reached for u in e.invars):
      continue
    weights = [u for u in e.invars if flat.is_var(u) and u in value_dep and u not in reached
               and tags.get(u) is None]
    if weights:
      raise batch_axis.NotSplittable(
          f"{batch_axis.where(e)} applies the parameters to values a batch statistic "
          f"normalised (the layers after a BatchNorm): the statistic would need a pass of "
          f"its own over the microbatches before them")
  level: dict = {}
  for v in _in_order(prog, staged):  # (in program order: what a statistic reads is before it)
    readers = [prog.eqns[i] for i in flat.needed(prog, [v], given=given | (staged - {v}))]
    read = {u for e in readers for u in e.invars if flat.is_var(u) and u in staged}
    level[v] = 1 + max((level[u] for u in read), default=0)
    if level[v] > MAX_STAGES:
      e = next(e for e in readers if any(u in read for u in e.invars if flat.is_var(u)))
      raise batch_axis.NotSplittable(
          f"{batch_axis.where(e)} reads a batch statistic computed from another, "
          f"{level[v]} deep (more than {MAX_STAGES}): each would need a pass of its own "
          f"over the microbatches")
  stages = []
  for n in range(1, max(level.values()) + 1):
    stats = tuple(v for v in level if level[v] == n)
    stages.append((stats, _frontier(prog, tags, stats, given | (staged - set(stats)))))
  return tuple(stages)


def _to_the_whole_batch(prog: flat.Program, tags: dict, v, batch: int, param_free,
                        why: str, depth: int = 0) -> tuple[dict, set]:
  """How the parameter-free value `v` is computed once over the whole batch instead of
  per microbatch: ({value: layout} split like the batch, {value} given whole). As long as
  the batch, it is split where an op reads it per example; where none can (an `iota`
  feeding a sort over the batch), what its parameter-free readers make of it is, in turn;
  otherwise (a statistic) it is given whole."""
  tag = tags.get(v)
  if isinstance(tag, batch_axis.Batched):
    return {v: tag}, set()
  if not any(batch_axis.batch_long(n, batch) for n in getattr(v.aval, "shape", ())):
    return {}, {v}
  tag = batch_axis.designate(prog, tags, v, batch)
  if tag is not None:
    return {v: tag}, set()
  readers = [e for e in prog.eqns if any(u is v for u in e.invars)]
  if any(u is v for u in prog.outvars) or depth > 8 or not all(
      param_free(u) for e in readers for u in e.outvars):
    raise batch_axis.NotSplittable(f"{why}: no op reads it as per-example data")
  shares, stats = {}, set()
  for e in readers:
    for u in e.outvars:
      more, whole = _to_the_whole_batch(prog, tags, u, batch, param_free, why, depth + 1)
      shares.update(more)
      stats |= whole
  return shares, stats


def _checkpoints(prog: flat.Program, indices) -> int:
  """The step's own `jax.checkpoint` / `nn.remat` units among `indices` (at any depth)."""
  return sum(1 for _ in _own_checkpoints(prog, indices))


def _own_checkpoints(prog: flat.Program, indices):
  for i in indices:
    e = prog.eqns[i]
    if e.primitive.name in batch_axis.CHECKPOINTS:
      yield e.eqn
    for sub in _nested(e.eqn):
      yield from (x for x in _all_eqns(sub) if x.primitive.name in batch_axis.CHECKPOINTS)


def own_checkpoints(prog: flat.Program) -> str | None:
  """What the step's own checkpoints do (for the report), e.g. "the step checkpoints 3
  units itself (nothing_saveable)"; None where it has none."""
  units = list(_own_checkpoints(prog, range(len(prog.eqns))))
  if not units:
    return None
  policies = collections.Counter(
      getattr(e.params.get("policy"), "__name__", None) or (
          "everything recomputed" if e.params.get("policy") is None else "a custom policy")
      for e in units)
  said = ", ".join(f"{name} x{n}" if n > 1 else name for name, n in policies.most_common())
  return (f"the step checkpoints {len(units)} unit{'s' * (len(units) != 1)} itself ({said}); "
          f"a remat plan checkpoints the layers around them")


def known_cotangent(t: Traced, frontier, dep) -> bool:
  """Whether the sums' cotangent reads neither the parameters nor the dependent sums."""
  loss = sum_cotangent.combined_fn(t.prog, t.closed.consts, frontier, dep, t.n_diff,
                                   t.inputs()[1], t.inputs()[2])
  return sum_cotangent.known_in_advance(
      loss, [v.aval for v, d in zip(frontier, dep) if d],
      [v.aval for v, d in zip(frontier, dep) if not d], t.inputs()[0])


def _custom_vjp_rules(prog: flat.Program, indices, dep_slots) -> list:
  """The custom_vjp equations (at any depth) among `indices` that depend on the parameters."""
  found = []
  for i in indices:
    e = prog.eqns[i]
    if not any(v in dep_slots for v in e.outvars):
      continue
    if e.primitive.name in batch_axis.CUSTOM_RULES and e.primitive.name != "custom_jvp_call":
      found.append(e)
    for sub in _nested(e.eqn):
      found += [_Nested(x) for x in _all_eqns(sub) if x.primitive.name in
                batch_axis.CUSTOM_RULES and x.primitive.name != "custom_jvp_call"]
  return found


@dataclasses.dataclass(frozen=True)
class _Nested:
  """A custom_vjp equation inside a nested jaxpr (a scan's body), as an `Eqn`-like."""
  eqn: Any
  name_stack: str = ""

  @property
  def primitive(self):
    return self.eqn.primitive


def _nested(eqn) -> list:
  out = []
  for v in eqn.params.values():
    for x in (v if isinstance(v, (tuple, list)) else (v,)):
      inner = getattr(x, "jaxpr", x)
      if hasattr(inner, "eqns"):
        out.append(inner)
  return out


def _all_eqns(jaxpr):
  for e in jaxpr.eqns:
    yield e
    for sub in _nested(e):
      yield from _all_eqns(sub)


def _depends(prog: flat.Program, roots: set) -> set:
  """The values computed from `roots` (their value, whether or not a gradient flows)."""
  dep = set(roots)
  for e in prog.eqns:
    if any(flat.is_var(v) and v in dep for v in e.invars):
      dep.update(e.outvars)
  return dep


def _grad_depends(prog: flat.Program, roots: set) -> set:
  """The values a gradient from `roots` can reach: not through `stop_gradient`, nor into
  integer or boolean values (a router's `argmax`, its one-hot counts: jax gives them no
  cotangent)."""
  dep = set(roots)
  for e in prog.eqns:
    if e.primitive.name == "stop_gradient" or not any(
        flat.is_var(v) and v in dep for v in e.invars):
      continue
    dep.update(v for v in e.outvars if _differentiable(v.aval))
  return dep


def _differentiable(aval) -> bool:
  try:
    return bool(jnp.issubdtype(aval.dtype, jnp.inexact))
  except (AttributeError, TypeError):
    return False
