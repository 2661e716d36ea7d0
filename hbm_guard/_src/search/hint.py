""""A wider class would fit": the hint a refusal gives, found for the price of a few probes.

When nothing within `max_class` fits, the search has already measured each family's
unsplit plan. Need is modelled as `F + P / k` (F: the state the step replaces, which a
split does not divide), the fewest count predicted to fit is probed, and where that figure
says no, the two figures predict the count probed next, or (where they predict none) the
family's floor, its most microbatches, is probed. At most `PROBES_PER_FAMILY` probes a
family, families cheapest first: a refusal costs no more than the search that fits."""

from __future__ import annotations

from typing import Sequence

from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.record import diagnose
from hbm_guard._src.search import cheapest
from hbm_guard._src.search import model
from hbm_guard._src.search import state as state_lib
from hbm_guard._src.search.driver import Driver

Plan = plan_lib.Plan
PROBES_PER_FAMILY = 3


def _predicted_count(driver: Driver, counts: Sequence[int], fixed: float, per: float,
                     above: int, below: int) -> int | None:
  """The fewest count strictly between `above` and `below` whose modelled need fits."""
  for k in counts:
    if above < k < below and driver.state.fits(int(fixed + per / k)):
      return k
  return None


def _in_family(driver: Driver, family: Plan, counts: Sequence[int]) -> int | None:
  """The fewest count of `family` a probe says fits, within `PROBES_PER_FAMILY` probes.

  Each probe is the count the model predicts; where the model predicts none (the figure
  did not shrink between two counts: inputs the split does not divide), the most
  microbatches are probed, the family's floor: if that fails, nothing in it fits; if it
  fits, the model through the floor and the last failure picks a count between them."""
  unsplit = driver.state.figure(model.at(family, 1))
  if unsplit is None or not counts:
    return None
  fixed = float(driver.state.state_bytes)
  per = max(0.0, unsplit - fixed)
  failed_k, failed_need = 1, float(unsplit)
  fitting: int | None = None
  for _ in range(PROBES_PER_FAMILY):
    below = fitting if fitting is not None else counts[-1] + 1
    k = _predicted_count(driver, counts, fixed, per, failed_k, below)
    if k is None:
      if fitting is not None or counts[-1] <= failed_k:
        break
      k = counts[-1]  # the floor
    need = driver.need(model.at(family, k))
    if need is None:  # the trace does not split there: another count may
      driver.update(state_lib.unmeasured, k)
      counts = [c for c in counts if c != k]
      if not counts:
        break
      continue
    if driver.state.fits(need):
      fitting = k
      fixed, per = model.two_point(failed_k, failed_need, k, need)
    else:
      failed_k, failed_need = k, float(need)
      fixed, per = model.two_point(1, unsplit, k, need)
  return fitting


def wider(driver: Driver, families: Sequence[Plan], counts: Sequence[int],
          offload_bytes: int) -> cheapest.Choice | None:
  """The cheapest plan of `families` predicted to fit, with a figure measured for it."""
  counts = [k for k in counts if k > 1 and k not in driver.state.unmeasured]
  best: cheapest.Choice | None = None
  for family in sorted(families, key=lambda f: driver.cost(f, offload_bytes)):
    if best is not None and driver.cost(family, offload_bytes) >= best.cost:
      break
    k = _in_family(driver, family, counts)
    if k is None:
      continue
    plan = model.at(family, k)
    cost = driver.cost(plan, offload_bytes)
    if best is None or cost < best.cost:
      need = driver.state.figure(plan)
      best = cheapest.Choice(plan, int(need * driver.state.scale), cost,
                             f"predicted by F + P / k from the unsplit plan's figure, then "
                             f"probed: {diagnose.format_bytes(need)}")
  return best
