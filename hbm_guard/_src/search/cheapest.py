"""The cheapest plan predicted to fit, over families priced cheapest first: each family's
fewest microbatches by `bisection`, a later family searching only the counts cheaper than
the best so far (the README job: 6 probes, not 8), and the compiles that decide it started
beside the probes where the host has the cores."""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.record import diagnose
from hbm_guard._src.search import bisection
from hbm_guard._src.search import model
from hbm_guard._src.search import race as race_lib
from hbm_guard._src.search import space
from hbm_guard._src.search.driver import Driver
from hbm_guard._src.search.state import program

Plan = plan_lib.Plan


@dataclasses.dataclass(frozen=True)
class Choice:
  plan: Plan
  predicted_bytes: int
  cost: float
  why: str


def choose(driver: Driver, families: Sequence[Plan], counts: Sequence[int],
           offload_bytes: int, *, race: bool = False) -> Choice | None:
  """The cheapest plan predicted to fit. `race`: where the driver races, the cheapest that
  fits by compiles at the capacity."""
  if race and driver.races:
    won = race_lib.race(driver, families, counts, offload_bytes)
    if won is None:
      return None
    plan, need, cost = won
    return Choice(plan, need, cost,
                  f"cheapest that fits: compiled at the capacity, {_fmt(need)}, the cheapest "
                  f"candidates compiled first, two at a time; cost {cost:.3g} flops")
  if families:
    bisection.prefetch_family(driver, min(families, key=space.likely_cost), counts)
  priced = sorted(families, key=lambda f: driver.cost(f, offload_bytes))
  best: Choice | None = None
  for i, family in enumerate(priced):
    if best is not None and driver.cost(family, offload_bytes) >= best.cost:
      break  # every plan of this family costs more than the best already found
    later = priced[i + 1:]
    worth = _worth(driver, family, counts, best and best.cost, offload_bytes)
    if best is None:
      _lower_ahead(driver, family, worth, later, counts, offload_bytes)
    # Its most microbatches is the choice if no fewer fit: where a fitting plan bounds the
    # counts, and no later family offers anything cheaper; or its compile started ahead.
    decisive = bool(worth) and (
        best is not None and _undercuts(driver, family, worth, later, counts, offload_bytes)
        or driver.compiling(model.at(family, worth[-1])))
    ahead = functools.partial(_compile_ahead, driver, later, counts, offload_bytes)
    k = bisection.smallest_count(driver, family, worth, decisive, ahead)
    if k is None:
      continue
    plan = model.at(family, k)
    cost = driver.cost(plan, offload_bytes)
    if best is None or cost < best.cost:
      best = _choice(driver, plan, cost)
  return best


def _choice(driver: Driver, plan: Plan, cost: float) -> Choice:
  need, s = driver.figure(plan), driver.state
  if program(plan) in s.fit_by_compile:
    return Choice(plan, need, cost, f"cheapest that fits: compiled beside the probes of "
                  f"fewer microbatches, {_fmt(need)}; cost {cost:.3g} flops")
  why = (f"cheapest that fits: compiled at {_fmt(need)} <= {_fmt(s.capacity)}; " if s.exact else
         f"cheapest predicted to fit: probe {_fmt(need)} x {s.scale:.2f} <= "
         f"{s.headroom} x {_fmt(s.capacity)}; ")
  return Choice(plan, int(need * s.scale), cost, why + f"cost {cost:.3g} flops")


def _worth(driver: Driver, family: Plan, counts: Sequence[int], best_cost: float | None,
           offload_bytes: int) -> list[int]:
  """The counts of `family` worth searching: measurable, and cheaper than the best."""
  return [k for k in counts if k not in driver.state.unmeasured and (
      best_cost is None or driver.cost(model.at(family, k), offload_bytes) < best_cost)]


def _undercuts(driver: Driver, family: Plan, worth: Sequence[int], later: Sequence[Plan],
               counts: Sequence[int], offload_bytes: int) -> bool:
  """Whether `family` at its most worthwhile count costs no more than any plan of the
  later families: then, if no fewer fit, that plan is the choice."""
  top = driver.cost(model.at(family, worth[-1]), offload_bytes)
  return all(driver.cost(model.at(f, counts[0]), offload_bytes) >= top for f in later)


def _lower_ahead(driver: Driver, family: Plan, counts: Sequence[int], later: Sequence[Plan],
                 all_counts: Sequence[int], offload_bytes: int) -> None:
  """While the first family's floor is probed: lowers the compile the next family would
  start beside its probes if the floor fits (the README job: the remat family's
  microbatch(4) lowered for 0.5 s of an idle core before its compile began)."""
  low = bisection.floor(driver, family, counts) if driver.can_stage_ahead and later else None
  if low is None or not driver.pending(low):
    return  # no floor, or its figure is in: the choice follows at once
  nxt, rest = later[0], later[1:]
  worth = _worth(driver, nxt, all_counts, driver.cost(low, offload_bytes), offload_bytes)
  if not worth or not _undercuts(driver, nxt, worth, rest, all_counts, offload_bytes):
    return
  plan = model.at(nxt, worth[-1])
  if not model.ruled_out(driver.state, plan):
    driver.stage_ahead(plan)


def _compile_ahead(driver: Driver, later: Sequence[Plan], counts: Sequence[int],
                   offload_bytes: int, bound: Plan, unresolved: Sequence[Plan]) -> bool:
  """Starts the compile of the dearest plan cheaper than `bound` (which fits), where that
  plan is a later family's and this family has one round left (`unresolved`): it is the
  choice if nothing cheaper fits, and compiled now it saves the rounds before it (the
  README job: 4 probes after its failed compile, not 5)."""
  if not driver.compiles_beside or driver.state.dear:
    return False
  limit = driver.cost(bound, offload_bytes)
  candidates = [p for p in list(unresolved) + [model.at(f, k) for f in later for k in counts]
                if driver.cost(p, offload_bytes) < limit
                and not model.ruled_out(driver.state, p)
                and p.microbatches not in driver.state.unmeasured]
  if not candidates:
    return False
  dearest = max(candidates, key=lambda p: driver.cost(p, offload_bytes))
  if program(dearest) in {program(p) for p in unresolved}:
    return False  # this family's own: its bisection decides it
  return driver.compile_beside(dearest)


_fmt = diagnose.format_bytes
