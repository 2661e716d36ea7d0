"""One family's fewest microbatches predicted to fit: need falls with the count, so the
counts are bisected by probes (thirds, two at a time, where probes run side by side), from
the fewest a failure leaves where that is likely, or by two figures where probes are dear
(`two_point`)."""

from __future__ import annotations

from typing import Callable, Sequence

from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.search import model
from hbm_guard._src.search import space
from hbm_guard._src.search import state as state_lib
from hbm_guard._src.search import tuning
from hbm_guard._src.search import two_point
from hbm_guard._src.search.driver import Driver
from hbm_guard._src.search.state import program

Plan = plan_lib.Plan
# (bound, this family's unresolved plans) -> whether a later family's compile was started
Ahead = Callable[[Plan, Sequence[Plan]], bool]


def smallest_count(driver: Driver, family: Plan, counts: Sequence[int],
                   decisive: bool = False, ahead: Ahead | None = None) -> int | None:
  """The fewest microbatches predicted to fit in this family. `decisive`: the most would
  be the choice if no fewer fit, so where probes are cheap it is compiled, not probed.
  `ahead`: may start a later family's decisive compile once one round is left."""
  if not counts:
    return None
  most = model.at(family, counts[-1])
  if model.ruled_out(driver.state, most):
    return None
  if decisive and driver.compile_beside(most):
    return _below_compiled(driver, family, counts)
  low = prefetch_family(driver, family, counts)
  if low is not None:
    low_need = driver.need(low)
    if driver.state.fits(low_need):
      return low.microbatches
    if low_need is None:
      driver.update(state_lib.unmeasured, low.microbatches)
    counts = [k for k in counts if k > low.microbatches]  # the floor and all below: out
    prefetch_family(driver, family, counts)  # the top, and the midpoint above the floor
  need = driver.need(most)
  for _ in range(tuning.MAX_PASSED_OVER):
    if len(counts) < 2 or not model.says_nothing_of_fewer(driver.state, most, need):
      break
    if need is None:
      driver.update(state_lib.unmeasured, most.microbatches)
    counts = counts[:-1]
    most = model.at(family, counts[-1])
    if model.ruled_out(driver.state, most):
      return None
    prefetch_family(driver, family, counts)
    need = driver.need(most)
  if not driver.state.fits(need):
    return None
  if driver.state.dear and len(counts) > 1:
    return two_point.fewest(driver, family, counts)
  return counts[bisect(driver, family, counts, thirds=driver.side_by_side, ahead=ahead)]


def floor(driver: Driver, family: Plan, counts: Sequence[int]) -> Plan | None:
  """Where probes are cheap: the family's fewest microbatches that real figures leave
  possible, where they rule out the lower half of the counts and it is not the most. If it
  fits it is the bisection's answer (the README job: its failed compile rules out 4 and
  fewer, and 8 fits: one probe, not two). Where fewer are ruled out it is a long shot."""
  if driver.state.dear or len(counts) < 2:
    return None
  plans = [model.at(family, k) for k in counts if k not in driver.state.unmeasured]
  middle = counts[(len(counts) - 1) // 2]
  for i, plan in enumerate(plans[:-1]):
    if not model.ruled_out(driver.state, plan):
      return plan if i > 0 and plan.microbatches >= middle else None
  return None


def prefetch_family(driver: Driver, family: Plan, counts: Sequence[int]) -> Plan | None:
  """Starts the first figures a family's search reads, together and before the pricing:
  its top count, and where probes are dear the other count its model needs, else the
  bisection's first midpoint; or its floor, which it returns."""
  most = model.at(family, counts[-1]) if counts else None
  if most is None or model.ruled_out(driver.state, most):
    return None
  low = floor(driver, family, counts)
  if low is not None:
    # The top is read only if the floor does not fit: started beside it where a core is
    # left over (on two, it slowed the README job's fit by 0.3 s).
    driver.prefetch([low, most] if driver.width > 2 else [low])
    return low
  anchored = (bool(model.anchors(driver.state, family, counts[-1]))
              or two_point.started_second(driver, family, counts) is not None)
  driver.prefetch(space.first_probes(family, counts, driver.state.dear, anchored))
  return None


def _below_compiled(driver: Driver, family: Plan, counts: Sequence[int]) -> int | None:
  """The fewest that fit, where the most is being compiled: the fewer counts are bisected
  by probes meanwhile, one at a time, and the compile is waited for only if none fits.
  Only counts at least `BESIDE_GAIN` cheaper than the one compiling are worth a probe."""
  top = model.at(family, counts[-1])
  counts = [k for k in counts[:-1]
            if _worth_a_probe(driver, model.at(family, k), top)] + [counts[-1]]
  lo = bisect(driver, family, counts, thirds=False)  # counts[-1]: compiling, taken to fit
  if lo < len(counts) - 1:
    return counts[lo]
  return counts[-1] if driver.compiled_fits(model.at(family, counts[-1])) else None


def _worth_a_probe(driver: Driver, plan: Plan, compiling: Plan) -> bool:
  """Whether `plan` is worth a probe beside the compile of `compiling` (its family's, more
  microbatches): priced `BESIDE_GAIN` cheaper by the model."""
  return driver.cost(plan, 0) <= driver.cost(compiling, 0) * (1 - tuning.BESIDE_GAIN)


def bisect(driver: Driver, family: Plan, counts: Sequence[int], thirds: bool,
           ahead: Ahead | None = None) -> int:
  """The index of the fewest microbatches predicted to fit, the most taken to fit. One
  probe a round, or with `thirds` two side by side: the thirds of what is left. Once one
  round of two is left, `ahead` may start a later family's compile: then one at a time."""
  at = lambda i: model.at(family, counts[i])  # noqa: E731
  def ok(i):
    if program(at(i)) in driver.state.failed or model.bounded_out(driver.state, at(i)):
      return False
    need = driver.need(at(i))
    return driver.state.fits(need)
  lo, hi, downward = 0, len(counts) - 1, False
  while lo < hi:
    if (thirds and ahead is not None and hi - lo <= 3
        and model.next_likely_fails(driver.state, family, counts, hi)
        and ahead(at(hi), [at(i) for i in range(lo, hi)
                           if program(at(i)) not in driver.state.failed])):
      # The compile started ahead is the choice if none of these fits, as is likeliest.
      # From the top down, one at a time: the first that does not fit ends the search.
      thirds, downward = False, True
    if (thirds and hi - lo == 1 and not downward and driver.compiles_beside
        and model.next_likely_fails(driver.state, family, counts, hi)):
      # One count left, predicted not to fit: the bound, the likely answer, is compiled
      # now, beside that count's probe (the MoE: microbatch(16) beside the probe of 8).
      driver.start_compile(at(hi))
      if not _worth_a_probe(driver, at(lo), at(hi)):
        return hi
    mid = hi - 1 if downward else (lo + hi) // 2
    if thirds and hi - lo >= 2 and not driver.started(at(mid)):
      a, b = lo + (hi - lo) // 3, lo + 2 * (hi - lo) // 3
      driver.prefetch([at(a), at(b)])
      lo, hi = (lo, a) if ok(a) else (a + 1, b) if ok(b) else (b + 1, hi)
    elif ok(mid):
      hi = mid
    else:
      lo = mid + 1
  return lo
