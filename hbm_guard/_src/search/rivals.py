"""The plans worth timing against the one the search chose: what a flop count cannot rank.

On the device that runs the step, a plan's speed is measured, not priced (`tournament`).
The search leaves a `Field`: its families, the microbatch counts, and the plans it knows
fit or fail. From an incumbent, the next rival is a neighbour that may run faster: about
twice the microbatches in its family (on a CPU each then fits in cache; on an accelerator
the measurement says), less rematerialisation at the fewest count that may fit, more
rematerialisation at fewer microbatches (on a GPU that won), or fewer microbatches.
Rivals differ from the incumbent only in remat policy and microbatch count: the same
donation and layout, so the state moves between them as it is."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator, Sequence

from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.search import model
from hbm_guard._src.search.state import SearchState, program

Plan = plan_lib.Plan


@dataclasses.dataclass(frozen=True)
class Field:
  """What the search knew around its choice, when the choice was made."""
  chosen: Plan
  families: tuple[Plan, ...]  # in the search's order: lighter remat first
  counts: tuple[int, ...]
  fitting: frozenset[Plan]  # programs a full compile said fit
  failing: frozenset[Plan]
  unmeasured: frozenset[int] = frozenset()


def field(state: SearchState, chosen: Plan, families: Sequence[Plan],
          counts: Sequence[int], *, estimated: bool = False) -> Field | None:
  """The field around `chosen`; None where `chosen` is not one of the searched families,
  or its figures are not a full compile's (a target: its probes are estimates) unless
  `estimated`: then only compiles say a plan fits, and a probe whose own figure is over
  the capacity counts as its failure (each rival is a compile: none is spent on a sure
  failure). Its figure, not the search's scaled prediction: libtpu's early figure reads
  0.67-0.95 of the real need, so the scale that keeps the search's first compile safe hid
  the estimated fastest from the rivals (full remat unsplit, the lm at 35%)."""
  if model.family_of(chosen) not in {program(f) for f in families}:
    return None
  if state.exact:
    fitting = {p for p, n in state.needs.items() if n is not None and n <= state.capacity}
    failing = set(state.failed)
  elif estimated:
    fitting = set()
    failing = set(state.failed) | {p for p, n in state.needs.items()
                                   if n is not None and n > state.capacity}
    # and what a failed compile rules out (368M: no remat at 2 and 4 microbatches, bounded
    # at 41 and 23 GiB of 15.75 by the unsplit 81 GiB, compiled 54 s to say no)
    failing |= {model.at(program(f), k) for f in families for k in counts
                if model.ruled_out(state, model.at(program(f), k))}
  else:
    return None
  fitting |= state.fit_by_compile | {program(chosen)}
  return Field(program(chosen), tuple(program(f) for f in families), tuple(counts),
               frozenset(fitting), frozenset(failing - fitting), state.unmeasured)


def _same_but_remat(a: Plan, b: Plan) -> bool:
  return dataclasses.replace(a, remat_policy=None) == dataclasses.replace(b, remat_policy=None)


def _may_fit(f: Field, plan: Plan) -> bool:
  """Whether nothing known rules `plan` out: a compile said it fits, or none of its family
  failed at as many microbatches or more (split; unsplit is another program)."""
  if plan in f.fitting:
    return True
  k, family = plan.microbatches, model.family_of(plan)
  return not any(model.family_of(p) == family and (p.microbatches == k or p.microbatches > k > 1)
                 for p in f.failing)


def _fewest(f: Field, family: Plan, counts: Sequence[int]) -> Iterator[Plan]:
  """`family` at the fewest of `counts` that may fit, if any."""
  yield from itertools.islice(
      (model.at(family, k) for k in counts if _may_fit(f, model.at(family, k))), 1)


def _neighbours(f: Field, plan: Plan) -> Iterator[Plan]:
  """Near `plan`, most promising first: about twice its microbatches; a lighter remat
  family (lightest first) at the fewest count that may fit, from `plan`'s up or where a
  compile said it fits (the search may never have measured it: the rival's compile says);
  a heavier one (nearest first) at the fewest that may fit below `plan`'s count, then at
  up to it (on a GPU fewer, larger microbatches with more recompute ran faster; on a CPU
  full remat unsplit beat lighter remat at 4 microbatches by 1.15: the corner, not a step
  towards it; for v5e, from no remat at 2 with dots unsplit over the capacity, full remat
  unsplit was estimated 1.06x faster and dots at 2 no faster); its
  own family at about half its count; and, last, about four times its count."""
  counts = [k for k in f.counts if k not in f.unmeasured]
  k = plan.microbatches
  more = [n for n in counts if n >= 2 * k]
  if more:
    yield model.at(plan, more[0])
  family = model.family_of(plan)
  if family not in f.families:
    return
  kin = [g for g in f.families if _same_but_remat(g, family)]
  known = lambda g, n: model.at(g, n) in f.fitting  # noqa: E731
  for lighter in kin[:kin.index(family)]:
    yield from _fewest(f, lighter, [n for n in counts if n >= k or known(lighter, n)])
  heavier = kin[kin.index(family) + 1:]
  for g in heavier:  # fewer microbatches first: each is the point of more recompute
    yield from _fewest(f, g, [n for n in counts if n < k])
  # then up to as many (full remat unsplit beat no remat unsplit on v5e); where one below
  # may fit this yields it again, and `next_rival` skips what was tried
  for g in heavier:
    yield from _fewest(f, g, [n for n in counts if n <= k])
  # about half the microbatches of its own family, where an earlier move left it more
  # than it needs
  yield from _fewest(f, family, [n for n in counts if k // 2 <= n < k])
  # about four times its microbatches: past a plateau (a small CNN on a CPU ran alike at 8
  # and 16 microbatches of 32 examples, 1.10x behind one example each)
  further = [n for n in counts if n >= 4 * k]
  if further:
    yield model.at(plan, further[0])


def learn(f: Field, plan: Plan, fits: bool) -> Field:
  """`f` once a compile of `plan` said whether it fits."""
  if fits:
    return dataclasses.replace(f, fitting=f.fitting | {program(plan)})
  return dataclasses.replace(f, failing=f.failing | {program(plan)})


def next_rival(f: Field, incumbent: Plan, tried: frozenset[Plan]) -> Plan | None:
  """The next plan to time against `incumbent`, or None: nothing untried is near it."""
  for plan in _neighbours(f, program(incumbent)):
    if plan not in tried and plan not in f.failing:
      return plan
  return None
