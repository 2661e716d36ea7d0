"""The plans worth timing against the one the search chose: what a flop count cannot rank.

On the device that runs the step, a plan's speed is measured, not priced (`tournament`).
The search leaves a `Field`: its families, the microbatch counts, and the plans it knows
fit or fail. From an incumbent, the next rival is a neighbour that may run faster: about
twice the microbatches in its family (on a CPU each then fits in cache; on an accelerator
the measurement says), or less rematerialisation at its family's fewest fitting count.
Rivals differ from the incumbent only in remat policy and microbatch count: the same
donation and layout, so the state moves between them as it is."""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

from hbm_guard._src import plan as plan_lib
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
          counts: Sequence[int]) -> Field | None:
  """The field around `chosen`; None where its figures are not a full compile's (a target:
  its probes are estimates) or `chosen` is not one of the searched families."""
  if not state.exact or model.family_of(chosen) not in {program(f) for f in families}:
    return None
  fitting = {p for p, n in state.needs.items() if n is not None and n <= state.capacity}
  fitting |= state.fit_by_compile | {program(chosen)}
  return Field(program(chosen), tuple(program(f) for f in families), tuple(counts),
               frozenset(fitting), frozenset(state.failed), state.unmeasured)


def _same_but_remat(a: Plan, b: Plan) -> bool:
  return dataclasses.replace(a, remat_policy=None) == dataclasses.replace(b, remat_policy=None)


def _neighbours(f: Field, plan: Plan) -> Iterator[Plan]:
  counts = [k for k in f.counts if k not in f.unmeasured]
  more = [k for k in counts if k >= 2 * plan.microbatches]
  if more:
    yield model.at(plan, more[0])
  family = model.family_of(plan)
  if family in f.families:
    for lighter in f.families[:f.families.index(family)]:
      if _same_but_remat(lighter, family):
        fits = [k for k in counts if model.at(lighter, k) in f.fitting]
        if fits:
          yield model.at(lighter, fits[0])


def next_rival(f: Field, incumbent: Plan, tried: frozenset[Plan]) -> Plan | None:
  """The next plan to time against `incumbent`, or None: nothing untried is near it."""
  for plan in _neighbours(f, program(incumbent)):
    if plan not in tried and plan not in f.failing:
      return plan
  return None
