"""Which of the plans that fit is kept: the search's choice, compared by estimated step
time against plans near it (`estimated_rivals`, for a target), or timed against them in the
first steps (`timed_rivals`: a `tournament.Tournament`, run by the guard as its step).

The guard calls `choose` after a fit: it compiles and times through the fit and the
backend, writes the report, and returns what to install (a `Kept`); installing it (the
guard's tables of signatures) is the guard's.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
from absl import logging

from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.backends import estimated as estimated_lib
from hbm_guard._src.backends import options as options_lib
from hbm_guard._src.backends import steps as steps_lib
from hbm_guard._src.guard import climb as climb_lib
from hbm_guard._src.guard import fit as fit_lib
from hbm_guard._src.guard import tournament as tournament_lib
from hbm_guard._src.plans import layout as layout_lib
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.record import record as record_lib
from hbm_guard._src.search import planner as planner_lib
from hbm_guard._src.search import rivals as rivals_lib


@dataclasses.dataclass(frozen=True)
class Kept:
  """What a fit leaves to install: the plan kept, the jit that runs its signature, what
  the next call runs (that jit, or a tournament timing rivals), the rivals estimated."""
  plan: "plan_lib.Plan"
  entry: steps_lib.PlanJit
  hot: "steps_lib.PlanJit | tournament_lib.Tournament"
  estimated: estimated_lib.Outcome | None


def choose(fit: fit_lib.Fit, result: climb_lib.Result, step: steps_lib.StepBuilder, backend,
           options: options_lib.GuardOptions, ledger: fit_lib.Ledger, key, args, kwargs,
           others: list, settle: Callable) -> Kept:
  """The plan a fit keeps for signature `key`, its jit, and the report written.
  `others`: the jits of the signatures fitted before (a tournament only where all share
  one); `settle(entry_of, outcome)`: installs the plan the first steps settled on."""
  compared = compare_estimates(fit, result, options, step.name)
  if compared is not None:
    result = dataclasses.replace(result, plan=compared.winner)
  entry = step.plan_jit(backend.runnable(result.plan), args)
  entry.allowed.add(key)
  hot = entry
  if all(e is entry for e in others):
    hot = tournament(fit, result, step, backend, options, key, args, kwargs, settle) or entry
  if compared is not None:
    ledger.write(fit_lib.Status.FITS, final_plan=result.plan, estimated=compared.to_dict())
    fit.remember(result.plan, tuple(a.to_dict() for a in ledger.attempts))
  elif len(result.attempts) > 1 or ledger.path is not None:
    ledger.write(fit_lib.Status.FITS, final_plan=result.plan)
  if len(result.attempts) > 1:
    logging.info("hbm_guard: %s fits with %s after %d compile(s)", step.name,
                 result.plan.describe(), len(result.attempts))
  return Kept(result.plan, entry, hot, compared)


def settled(fit: fit_lib.Fit, ledger: fit_lib.Ledger, name: str,
            outcome: tournament_lib.Outcome) -> None:
  """Writes down the plan the first steps settled on: the report, the plan cache, a line."""
  timed = {"why": outcome.why, "plans": [t.to_dict() for t in outcome.timings]}
  ledger.write(fit_lib.Status.FITS, final_plan=outcome.winner, timed=timed)
  fit.remember(outcome.winner, tuple(a.to_dict() for a in ledger.attempts))
  logging.info("hbm_guard: %s settles on %s: %s", name, outcome.winner.describe(),
               ", ".join(f"{t.plan.describe()} {1000 * t.median:.2f} ms"
                         for t in outcome.timings))


def compare_estimates(fit: fit_lib.Fit, result: climb_lib.Result,
                      options: options_lib.GuardOptions, name: str
                      ) -> estimated_lib.Outcome | None:
  """For a target, where the user allows it (`estimated_rivals`): plans near the
  search's choice compiled, the one estimated fastest kept (`estimated`); None where
  nothing was compared. Rivals stop where the fit's time budget would not cover one."""
  field = fit.rivals(result, estimated=True) if options.estimated_rivals else None
  if field is None or not result.attempts:
    return None

  def compile_plans(plans):
    out = []
    for plan, trial in zip(plans, fit.spend.compile_rivals(plans)):
      if trial is None:  # past the time budget
        out.append(None)
        continue
      e = estimated_lib.Estimated.of(plan, trial)
      logging.info("hbm_guard: %s, estimated against %s: %s%s", plan.describe(),
                   result.plan.describe(), trial.outcome,
                   "" if e.seconds is None else f", {1000 * e.seconds:.2f} ms a step")
      out.append(e)
    return out
  chosen = estimated_lib.Estimated.of(result.plan, result.attempts[-1])
  outcome = estimated_lib.compare(field, chosen, compile_plans, options.estimated_rivals,
                                  width=fit.spend.rival_width)
  if outcome.winner != result.plan:
    logging.info("hbm_guard: %s: %s in place of %s: %s", name, outcome.winner.describe(),
                 result.plan.describe(), outcome.why)
  return outcome


def donated_alive(entry: steps_lib.PlanJit, args, options: options_lib.GuardOptions) -> bool:
  """Whether every argument the plan donates is still there (not consumed)."""
  donated = set(entry.plan.donate_argnums) | set(options.user_donate)
  return not any(getattr(x, "is_deleted", lambda: False)()
                 for i in donated if i < len(args) for x in jax.tree_util.tree_leaves(args[i]))


def tournament(fit: fit_lib.Fit, result: climb_lib.Result, step: steps_lib.StepBuilder,
               backend, options: options_lib.GuardOptions, key, args, kwargs,
               settle: Callable[[Callable, tournament_lib.Outcome], None]
               ) -> tournament_lib.Tournament | None:
  """Where the step runs here and the search left plans near its choice: the first steps
  time them against it (one process only: several must agree on a plan); None where there
  is nothing to time. `settle(entry_of, outcome)` installs the plan the steps settled on."""
  field = (fit.rivals(result) if options.timed_rivals and jax.process_count() == 1
           else None)
  if field is None or rivals_lib.next_rival(
      field, result.plan, frozenset({planner_lib.program(result.plan)})) is None:
    return None
  shapes = layout_lib.abstract_tree((args, kwargs))

  def entry(plan):
    e = step.plan_jit(backend.runnable(plan), shapes[0])
    e.allowed.add(key)
    return e

  def compile_fits(plan):
    trial = backend.compile(plan, key, *shapes)
    logging.info("hbm_guard: %s, to time against %s: %s", plan.describe(),
                 result.plan.describe(), trial.outcome)
    return trial.outcome is compile_lib.Outcome.FITS

  def recoverable(error, call_args):  # a rival's allocation failed: nothing consumed
    rec = record_lib.parse(error)
    return (rec is not None and not rec.is_compile_time
            and donated_alive(entry(result.plan), call_args, options))
  return tournament_lib.Tournament(
      field, result.plan, entry, compile_fits, lambda outcome: settle(entry, outcome),
      max_rivals=options.timed_rivals, recoverable=recoverable)
