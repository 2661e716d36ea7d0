"""Where probes are dear and compiles run side by side: no probes. The cheapest candidates
are compiled at the capacity, `width` at a time; the first in cost order whose compile fits
is the choice, and each that fails rules out what its figure does. At 368M on v5e:1x1 a
failing compile took 12-17 s and a probe 12-16 s: a round of probes to decide what to
compile cost as much as compiling the candidates."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.search import model
from hbm_guard._src.search.driver import Driver
from hbm_guard._src.search.state import program

Plan = plan_lib.Plan


def contenders(driver: Driver, families: Sequence[Plan], counts: Sequence[int]
               ) -> list[Plan]:
  """The plans a race may compile: not failed, and not ruled out by a real figure."""
  return [model.at(f, k) for f in families for k in counts
          if not model.ruled_out(driver.state, model.at(f, k))
          and k not in driver.state.unmeasured]


def race(driver: Driver, families: Sequence[Plan], counts: Sequence[int],
         offload_bytes: int) -> tuple[Plan, int, float] | None:
  """(the cheapest plan that fits, its figure, its cost), or None if none does."""
  price = lambda p: driver.cost(p, offload_bytes)  # noqa: E731
  while True:
    ranked = sorted(contenders(driver, families, counts), key=price)
    if not ranked:
      return None
    first = ranked[0]
    if not driver.compiling(first):
      for plan in reversed(_round(driver, ranked)):
        driver.start_compile(plan)
    if driver.compiled_fits(first):
      return first, driver.state.needs.get(program(first)) or 0, price(first)


def _round(driver: Driver, ranked: Sequence[Plan]) -> list[Plan]:
  """What a round starts, cheapest first (started dearest first: the likeliest to fit, its
  longer compile begun while the others are lowered). The cheapest, and as many more as
  the compiles still running leave room for (one ruled out as it ran is not waited for,
  but holds its core); while the cheapest runs no more are started (at 368M a third
  compile beside the one that fit made it take 73 s, not 49).

  Where F + P / k through its family's failures puts the cheapest under the capacity, it
  is started alone: a loser beside it only slows the compile that decides (a 1B LM's
  microbatch(4): 143 s with losers beside, 110 s alone). Otherwise the last place goes to
  the cheapest plan so predicted, if any: the round then ends the race unless a cheaper
  plan fits (the 1B LM: remat at 1 beside microbatch(4), not remat at 1 and 2)."""
  first = ranked[0]
  if model.line_fits(driver.state, first):
    return [first]
  picked = list(ranked[:max(1, driver.width - driver.busy())])
  hopeful = next((p for p in ranked[1:] if model.line_fits(driver.state, p)
                  and not _may_rule_out(first, p)), None)
  if len(picked) > 1 and hopeful is not None and hopeful not in picked:
    picked[-1] = hopeful
  return picked


def _may_rule_out(first: Plan, plan: Plan) -> bool:
  """Whether `first`'s figure may rule `plan` out before it is read: `plan` has a remat
  policy and `first` is of its family without remat, donated as it is or not at all
  (`model.remat_no_help`)."""
  if plan.remat_policy is None:
    return False
  bare = dataclasses.replace(plan, remat_policy=None)
  return model.family_of(first) in (
      model.family_of(bare), model.family_of(dataclasses.replace(bare, donate_argnums=())))
