"""Where probes are dear (a probe costs what a compile does): a family's fewest microbatches
predicted to fit from two figures of need(k) ~ F + P / k, not a bisection."""

from __future__ import annotations

from typing import Sequence

from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.search import model
from hbm_guard._src.search import space
from hbm_guard._src.search import state as state_lib
from hbm_guard._src.search.driver import Driver
from hbm_guard._src.search.state import program

Plan = plan_lib.Plan


def fewest(driver: Driver, family: Plan, counts: Sequence[int]) -> int | None:
  """Two figures of this family: its probe at the most microbatches, and at fewer its
  latest failed compile, else a probe read or running (`started_second`), else one at the
  fewest split. Another family's figure is no anchor: a split step holds accumulators an
  unsplit one does not (at 368M the unsplit step's early figure read below its split:
  19.37 GiB, then 20.47 at k = 2)."""
  k1 = counts[-1]
  n1 = driver.need(model.at(family, k1))
  anchors = model.anchors(driver.state, family, k1)
  scale = driver.state.scale if driver.state.ratios else 1.0  # probes against real: no prior
  room = driver.state.headroom * driver.state.capacity
  if not anchors:
    k0 = started_second(driver, family, counts) or space.anchor_count(counts)
    n0 = driver.need(model.at(family, k0))
    if n0 is None:
      return k1  # no second figure: the most microbatches, which its probe said fit
    if n0 * scale <= room:
      # the anchor itself fits: the one count below it (unsplit: another program, so
      # probed, not extrapolated) may too
      below = [k for k in counts
               if k < k0 and program(model.at(family, k)) not in driver.state.failed]
      n_below = driver.need(model.at(family, below[-1])) if below else None
      if n_below is not None and n_below * scale <= room:
        return below[-1]
      return k0
    anchors = [(k0, n0)]
  k0, n0 = anchors[-1]
  fixed, per = model.two_point(k0, n0, k1, n1 * scale)
  for k in counts:
    plan = program(model.at(family, k))
    predicted = int((fixed + per / k) / scale)  # in probe units, as the state keeps them
    if (plan not in driver.state.failed and k > k0 and not model.bounded_out(driver.state, plan)
        and predicted * scale <= room):
      driver.update(state_lib.predicted, plan, predicted)
      return k
  return None


def started_second(driver: Driver, family: Plan, counts: Sequence[int]) -> int | None:
  """The fewest split count below the most whose probe was read with a figure or is
  running (the opening's: a mixture of experts' probe of 4, started while its plain step
  compiled): the second figure is read there, not at a new round's."""
  def known(k):
    plan = model.at(family, k)
    return driver.pending(plan) or driver.state.needs.get(program(plan)) is not None
  return next((k for k in counts[:-1] if k > 1 and known(k)), None)

