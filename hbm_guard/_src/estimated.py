"""For a target: plans near the search's choice compiled, and the one the chip's own cost
model prices fastest kept (`estimated_rivals`).

Where the step only compiles for a target nothing can be timed, and the search ranks plans
by flops before they compile; the compiled program says more. On v5e a 2-layer LM's
programs (`step_time`: libtpu's per-op cycles) ran from 36 ms (full remat, unsplit) to 74
ms (no remat, 4 microbatches), where flops put the second first. Each rival is a compile
at the capacity: the user chooses how many (0 by default, so a fit costs what it did).
The rivals are the tournament's (`rivals`): neighbours in remat and microbatches, compiled
side by side where the host has the cores (libtpu compiles a program on one).
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
            compile_plans: Callable[[list[Plan]], list[tuple[bool, float | None] | None]],
            max_rivals: int, width: int = 1) -> Outcome:
  """Compiles up to `max_rivals` neighbours of the best so far, `width` at a time
  (`compile_plans(plans) -> [(fits, estimated seconds)]`, None for one past the time
  budget: then no more), keeping a rival that fits and is estimated MARGIN faster. A round
  of `width` costs the wall time of one compile where the host has the cores (libtpu
  compiles on one), so more of the field is seen for the same wait."""
  estimates = [Estimated(chosen, True, chosen_seconds)]
  if chosen_seconds is None:
    return Outcome(chosen, tuple(estimates), "the search's choice: its program gave no "
                   "estimate to compare against")
  best, best_s, tried, stopped = chosen, chosen_seconds, {program(chosen)}, ""
  while not stopped and len(estimates) - 1 < max_rivals:
    round_ = _next_round(field, best, tried, min(width, max_rivals - len(estimates) + 1))
    if not round_:
      break
    tried.update(round_)
    for rival, compiled in zip(round_, compile_plans(round_)):
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


def _next_round(field: rivals_lib.Field, best: Plan, tried: set[Plan], width: int
                ) -> list[Plan]:
  """Up to `width` untried neighbours of `best`, most promising first."""
  round_: list[Plan] = []
  while len(round_) < width:
    rival = rivals_lib.next_rival(field, best, frozenset(tried | set(round_)))
    if rival is None:
      break
    round_.append(rival)
  return round_
