"""Past the planned rungs: the ladder's XLA flags and dtype, walked from the plan that came
closest, each passed over without a compile where a probe or a real figure says it cannot
fit (at 368M a probe of the flags took 87-168 s, a failing compile 20)."""

from __future__ import annotations

from typing import Sequence

from hbm_guard._src.plans import ladder as ladder_lib
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.plans import rungs as rungs_lib
from hbm_guard._src.search import model
from hbm_guard._src.search.driver import Driver
from hbm_guard._src.search.state import program

Plan = plan_lib.Plan


def _may_fit(driver: Driver, plan: Plan) -> bool:
  """Whether a probe leaves `plan` worth a compile; where the driver races, no probe is
  made (it would cost what the compile does: 68 s against 70 for the 368M step's flags)."""
  if driver.races:
    return program(plan) not in driver.state.failed
  need = driver.need(plan)
  return need is None or need <= driver.state.capacity


def _why_not(driver: Driver, plan: Plan) -> str | None:
  """Why a ladder plan (flags, a dtype) is passed over without a compile, or None."""
  why = model.cannot_close(driver.state, plan)
  if why is None and not _may_fit(driver, plan):
    why = f"probed: {plan.describe()} needs {driver.need(plan)} bytes"
  return why


def _skip(plan: Plan, why: str) -> rungs_lib.Skip:
  return rungs_lib.Skip(plan.rungs[-1] if plan.rungs else plan.describe(), why,
                         rungs_lib.SkipKind.CANNOT_CLOSE_GAP)


def _flag_chain(rest, first: Plan, facts, rec, max_class) -> list[Plan]:
  """The ladder's XLA-flag plans from `first` on, each adding a rung: weakest first."""
  chain, plan = [], first
  while plan is not None and plan.compiler_options and plan.compute_dtype == first.compute_dtype:
    chain.append(plan)
    plan, _ = ladder_lib.next_plan(rest, plan, facts, rec, max_class)
  return chain


def _strongest_flags_first(driver: Driver, rest, first: Plan, facts, rec, max_class
                           ) -> tuple[Plan | None, list[rungs_lib.Skip]]:
  """Where probes cost what compiles do, XLA's flags are judged by one probe: all of them
  at once. If that plan does not fit by its figure, no weaker one is probed (each flag only
  adds rematerialization); the ladder goes on past them. If it fits, it is compiled."""
  chain = _flag_chain(rest, first, facts, rec, max_class)
  if len(chain) < 2:
    return first, []
  strongest = chain[-1]
  why = model.cannot_close(driver.state, strongest)
  if why is None and _may_fit(driver, strongest):
    return strongest, []
  why = why or (f"compiled with every XLA flag at once: {strongest.describe()} does not fit"
                if program(strongest) in driver.state.failed else
                f"probed with every XLA flag at once: {strongest.describe()} needs "
                f"{driver.need(strongest)} bytes of {driver.state.capacity}")
  nxt, more = ladder_lib.next_plan(rest, strongest, facts, rec, max_class)
  return nxt, [_skip(p, why) for p in chain] + more


def walk(driver: Driver, rungs: Sequence[rungs_lib.Rung], closest: Plan, planned: Sequence[str],
         facts: rungs_lib.StepFacts, rec, max_class: rungs_lib.RungClass
         ) -> tuple[Plan | None, list[rungs_lib.Skip]]:
  """The next plan of the ladder's remaining rungs (those not `planned`) from `closest`."""
  rest = [r for r in rungs if r.kind not in planned]
  nxt, skips = ladder_lib.next_plan(rest, closest, facts, rec, max_class)
  if nxt is not None and driver.state.dear:
    nxt, more = _strongest_flags_first(driver, rest, nxt, facts, rec, max_class)
    skips += more
  # XLA's flags and a dtype are priced by probes too: a plan the probe's own figure puts
  # over the capacity is passed over without a compile.
  while nxt is not None and (why := _why_not(driver, nxt)) is not None:
    skips.append(_skip(nxt, why))
    nxt, more = ladder_lib.next_plan(rest, nxt, facts, rec, max_class)
    skips += more
  return nxt, skips
