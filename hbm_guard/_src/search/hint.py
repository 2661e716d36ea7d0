""""A wider class would fit": the hint a refusal gives, found for the price of a few probes.

When nothing within `max_class` fits, the search has already measured each family's
unsplit plan. Need is modelled as `F + P / k` (F: the state the step replaces, which a
split does not divide), the fewest count predicted to fit is probed, and where that figure
says no, the two figures predict the count probed next. At most `PROBES_PER_FAMILY` probes
a family, families cheapest first: a refusal costs no more than the search that fits."""

from __future__ import annotations

from typing import Sequence

from hbm_guard._src import plan as plan_lib
from hbm_guard._src.search import cheapest
from hbm_guard._src.search import model
from hbm_guard._src.search import state as state_lib
from hbm_guard._src.search.driver import Driver

Plan = plan_lib.Plan
PROBES_PER_FAMILY = 2


def _predicted_count(driver: Driver, counts: Sequence[int], fixed: float, per: float,
                     above: int) -> int | None:
  """The fewest count above `above` whose modelled need fits."""
  for k in counts:
    if k > above and driver.state.fits(int(fixed + per / k)):
      return k
  return None


def _in_family(driver: Driver, family: Plan, counts: Sequence[int]) -> int | None:
  unsplit = driver.state.figure(model.at(family, 1))
  if unsplit is None:
    return None
  fixed = float(driver.state.state_bytes)
  per, last = max(0.0, unsplit - fixed), 1
  for _ in range(PROBES_PER_FAMILY):
    k = _predicted_count(driver, counts, fixed, per, last)
    if k is None:
      return None
    need = driver.need(model.at(family, k))
    if driver.state.fits(need):
      return k
    if need is None:  # the trace does not split there: the next count may
      driver.update(state_lib.unmeasured, k)
      last = k
      continue
    fixed, per = model.two_point(1, unsplit, k, need)
    last = k
  return None


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
                             f"probed: {need} bytes")
  return best
