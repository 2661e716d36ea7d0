"""How a fit that found no plan ends: the report written and the typed error raised (the
climb exhausted, fallback off, the time budget spent, or exhausted before, by the cache)."""

from __future__ import annotations

from absl import logging

from hbm_guard._src.backends import options as options_lib
from hbm_guard._src.files import report as report_lib
from hbm_guard._src.guard import budget as budget_lib
from hbm_guard._src.guard import climb as climb_lib
from hbm_guard._src.guard import ledger as ledger_lib
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.plans import rungs as rungs_lib
from hbm_guard._src.record import diagnose as diagnose_lib
from hbm_guard._src.record import errors
from hbm_guard._src.search import planner as planner_lib

Status = report_lib.Status
AboveClass = ledger_lib.AboveClass


def above_class(driver: planner_lib.Driver | None,
                last: tuple[plan_lib.Plan, rungs_lib.StepFacts] | None,
                options: options_lib.GuardOptions) -> AboveClass | None:
  """When nothing allowed fits: would a plan of a higher class? Priced by the probes of
  the search that priced the climb, from its last failed plan."""
  if driver is None or last is None:
    return None
  plan, facts = last
  found = planner_lib.above(driver, options.ladder, plan, facts, options.max_class)
  if found is None:
    return None
  klass, choice = found
  return AboveClass(klass, choice.plan.describe(), choice.predicted_bytes)


def nothing_fits(result: climb_lib.Result, ledger: ledger_lib.Ledger, name: str,
                 options: options_lib.GuardOptions, search: planner_lib.Driver | None,
                 last: tuple[plan_lib.Plan, rungs_lib.StepFacts] | None):
  """No plan the options allow fits (or fallback is off): the report written, and the
  error a person can act on raised (the compiler's own, unchanged, with fallback off)."""
  trial, attempts = result.last, result.attempts
  diag, rec = attempts[-1].diagnosis, trial.record
  if result.status is climb_lib.Status.DIAGNOSED:
    written = ledger.write(Status.DIAGNOSED)
    logging.error("hbm_guard: %s does not fit (%s); auto fallback is off. Report: %s",
                  name, diag.summary, ledger.path if written else None)
    if trial.error is not None:
      raise trial.error  # the compiler's own error, unchanged
    raise errors.CapacityExceededError.over(
        name=name, need=rec.required_bytes, capacity=rec.available_bytes,
        scenario=diag.scenario, summary=diag.summary,
        report_path=ledger.path if written else None, attempts=attempts)
  try:
    above = above_class(search, last, options)
  except budget_lib.OutOfTime:
    above = None  # no time left to price a higher class
  written = ledger.write(Status.EXHAUSTED, above=above)
  planning = attempts[-1].planning
  measured = [p for p in (planning.probes if planning is not None else ())
              if p.need_bytes is not None]
  gap = {}
  if measured:  # why no other plan was compiled: the closest the search measured
    best = min(measured, key=lambda p: p.need_bytes)
    gap[f"the closest plan the search measured, {best.plan.describe()}, needs "
        f"{diagnose_lib.format_bytes(best.need_bytes)}"] = None
  gap.update({s.reason: None for s in attempts[-1].skipped
              if s.kind is rungs_lib.SkipKind.CANNOT_CLOSE_GAP})
  raise errors.LadderExhaustedError.nothing_fits(
      name=name, capacity=rec.available_bytes, attempts=attempts, need=rec.required_bytes,
      scenario=diag.scenario, summary=diag.summary, above=above, passed_over=list(gap),
      refused=list(ledger.refused.items()),
      report_path=ledger.path if written else None) from trial.error


def out_of_time(ledger: ledger_lib.Ledger, progress: budget_lib.Progress,
                b: budget_lib.Budget, e: budget_lib.OutOfTime, attempts: list, name: str):
  """The time budget could not pay for the next compile or probe: the report says where
  the fit stopped, and a FitTimeBudgetError the plan that came closest."""
  failed = [a for a in attempts if a.record is not None and a.record.required_bytes]
  closest = min(failed, key=lambda a: a.record.required_bytes).plan if failed else None
  progress.stopped(f"stopped: the time budget cannot pay for the next {e.kind} "
                   f"(about {e.estimate:.0f} s)")
  written = ledger.write(Status.EXHAUSTED, note=(
      f"stopped at the time budget max_fit_seconds={b.limit:g} after {b.elapsed:.0f} s"))
  raise errors.FitTimeBudgetError.spent(
      name=name, budget=b.limit, elapsed=b.elapsed,
      compiles=b.count(budget_lib.Spend.COMPILE), probes=b.count(budget_lib.Spend.PROBE),
      next_cost=e.estimate, closest=closest.describe() if closest else "none compiled",
      report_path=ledger.path if written else None, attempts=attempts)


def remembered_exhausted(cache, cache_key: str, parts: dict, cached,
                         ledger: ledger_lib.Ledger, name: str) -> None:
  """The plan cache remembers this program exhausted: a retry does not climb again (same
  program, same answer) unless asked to; the error says how old the answer is and what
  it covers."""
  path = cache.path(cache_key)
  ledger.write(Status.EXHAUSTED, attempts=list(cached.attempts),
                    note=f"from the plan cache {path}: no compile was made")
  raise errors.LadderExhaustedError.remembered(
      name=name, age_seconds=cached.age_seconds() or 0.0,
      compiles=len(cached.attempts), where=str(parts.get("where")),
      last=cached.plan.describe(), cache_dir=cache.directory,
      report_path=ledger.path)
