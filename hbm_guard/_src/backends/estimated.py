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

from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.search import rivals as rivals_lib
from hbm_guard._src.search.state import program

Plan = plan_lib.Plan
MARGIN = 0.02  # a rival must be estimated this much faster: estimates are estimates


@dataclasses.dataclass(frozen=True)
class Estimated:
  """A plan compiled for the target: whether it fits, its estimated step seconds, and its
  peak (what a kept rival needs: the report and preflight say the plan kept's, not the
  search's)."""
  plan: Plan
  fits: bool
  seconds: float | None  # None: it did not fit, or the program gave no estimate
  peak_bytes: int | None = None  # the compiled program's, where it fits

  @classmethod
  def of(cls, plan: Plan, compiled: Any) -> "Estimated":
    """From a compile's trial (or the climb's attempt): its outcome, estimate and peak."""
    fits = compiled.outcome is compile_lib.Outcome.FITS
    return cls(plan, fits, compiled.estimate.seconds if fits and compiled.estimate else None,
               (compiled.memory or {}).get("peak") if fits else None)

  def to_dict(self) -> dict[str, Any]:
    return {"plan": self.plan.describe(), "fits": self.fits,
            "estimated_seconds": None if self.seconds is None else round(self.seconds, 6),
            "peak_bytes": self.peak_bytes}


@dataclasses.dataclass(frozen=True)
class Outcome:
  """The plan kept, and every plan compiled for the comparison (the search's choice first)."""
  winner: Plan
  estimates: tuple[Estimated, ...]
  why: str

  @property
  def kept(self) -> Estimated:
    """The winner's own estimate."""
    return next(e for e in self.estimates if e.plan == self.winner)

  def to_dict(self) -> dict[str, Any]:
    return {"why": self.why, "plans": [e.to_dict() for e in self.estimates]}


def compare(field: rivals_lib.Field, chosen: Estimated,
            compile_plans: Callable[[list[Plan]], list[Estimated | None]],
            max_rivals: int, width: int = 1) -> Outcome:
  """Compiles up to `max_rivals` neighbours of the best so far, `width` at a time
  (`compile_plans(plans)`: each one's Estimated, None for one past the time budget: then
  no more), keeping a rival that fits and is estimated MARGIN faster than the search's
  `chosen`. A round of `width` costs the wall time of one compile where the host has the
  cores (libtpu compiles on one), so more of the field is seen for the same wait."""
  estimates = [chosen]
  if chosen.seconds is None:
    return Outcome(chosen.plan, tuple(estimates), "the search's choice: its program gave no "
                   "estimate to compare against")
  best, tried, stopped = chosen, {program(chosen.plan)}, ""
  while not stopped and len(estimates) - 1 < max_rivals:
    round_ = _next_round(field, best.plan, tried, min(width, max_rivals - len(estimates) + 1))
    if not round_:
      break
    tried.update(round_)
    for rival, compiled in zip(round_, compile_plans(round_)):
      if compiled is None:
        stopped = "; stopped at the fit's time budget"
        break
      field = rivals_lib.learn(field, rival, compiled.fits)
      estimates.append(compiled)
      if compiled.fits and compiled.seconds is not None and (
          compiled.seconds < (1 - MARGIN) * best.seconds):
        best = compiled
  compiled = len(estimates) - 1
  if best is chosen:
    why = (f"the search's choice: no rival of {compiled} compiled is estimated "
           f"{MARGIN:.0%} faster")
  else:
    why = (f"estimated {chosen.seconds / best.seconds:.2f}x faster than the search's choice, "
           f"of {compiled} rival(s) compiled")
  return Outcome(best.plan, tuple(estimates), why + stopped + "; estimated from the compiled "
                 "programs: the compiler's per-op cycles, else a roofline")


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
