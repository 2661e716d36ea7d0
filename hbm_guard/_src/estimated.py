"""For a target: plans near the search's choice compiled, and the one the chip's own cost
model prices fastest kept (`estimated_rivals`).

Where the step only compiles for a target nothing can be timed, and the search ranks plans
by flops before they compile; the compiled program says more. On v5e a 2-layer LM's
programs (`step_time`: libtpu's per-op cycles) ran from 36 ms (full remat, unsplit) to 74
ms (no remat, 4 microbatches), where flops put the second first. Each rival is a compile
at the capacity: the user chooses how many (0 by default, so a fit costs what it did).
The rivals are the tournament's (`rivals`): neighbours in remat and microbatches.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from hbm_guard._src import plan as plan_lib
from hbm_guard._src.search import rivals as rivals_lib
from hbm_guard._src.search.state import program

Plan = plan_lib.Plan
MARGIN = 0.02  # a rival must be estimated this much faster: estimates are estimates


@dataclasses.dataclass(frozen=True)
class Estimated:
  """A plan compiled for the target: whether it fits, and its estimated step seconds."""
  plan: Plan
  fits: bool
  seconds: float | None  # None: it did not fit, or the program gave no estimate

  def to_dict(self) -> dict[str, Any]:
    return {"plan": self.plan.describe(), "fits": self.fits,
            "estimated_seconds": None if self.seconds is None else round(self.seconds, 6)}


@dataclasses.dataclass(frozen=True)
class Outcome:
  """The plan kept, and every plan compiled for the comparison (the search's choice first)."""
  winner: Plan
  estimates: tuple[Estimated, ...]
  why: str

  def to_dict(self) -> dict[str, Any]:
    return {"why": self.why, "plans": [e.to_dict() for e in self.estimates]}


def compare(field: rivals_lib.Field, chosen: Plan, chosen_seconds: float | None,
            compile_plan: Callable[[Plan], tuple[bool, float | None] | None],
            max_rivals: int) -> Outcome:
  """Compiles up to `max_rivals` neighbours of the best so far (`compile_plan(plan) ->
  (fits, estimated seconds)`, None past the time budget: then no more), keeping a rival
  that fits and is estimated MARGIN faster."""
  estimates = [Estimated(chosen, True, chosen_seconds)]
  if chosen_seconds is None:
    return Outcome(chosen, tuple(estimates), "the search's choice: its program gave no "
                   "estimate to compare against")
  best, best_s, tried, stopped = chosen, chosen_seconds, {program(chosen)}, ""
  for _ in range(max_rivals):
    rival = rivals_lib.next_rival(field, best, frozenset(tried))
    if rival is None:
      break
    tried.add(rival)
    compiled = compile_plan(rival)
    if compiled is None:
      stopped = "; stopped at the fit's time budget"
      break
    fits, seconds = compiled
    field = rivals_lib.learn(field, rival, fits)
    estimates.append(Estimated(rival, fits, seconds if fits else None))
    if fits and seconds is not None and seconds < (1 - MARGIN) * best_s:
      best, best_s = rival, seconds
  compiled = len(estimates) - 1
  if best == chosen:
    why = (f"the search's choice: no rival of {compiled} compiled is estimated "
           f"{MARGIN:.0%} faster")
  else:
    why = (f"estimated {chosen_seconds / best_s:.2f}x faster than the search's choice, of "
           f"{compiled} rival(s) compiled")
  return Outcome(best, tuple(estimates), why + stopped + "; estimated from the compiled programs: "
                 "the compiler's per-op cycles, else a roofline")
