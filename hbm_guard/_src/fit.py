"""One fit of one input signature: cache lookup, climb, cache write, report, typed errors.

A `Fit` owns its planner for its whole life (so "would a higher class fit?" asks the
planner that priced this climb), compiles through a `Backend`, and returns the climb's
result, or raises the error a person can act on. Nothing here calls back into the guard.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import time
from typing import Callable, Sequence

import jax
from absl import logging

from hbm_guard._src import backend as backend_lib
from hbm_guard._src import budget as budget_lib
from hbm_guard._src import cache_key as cache_key_lib
from hbm_guard._src import climb as climb_lib
from hbm_guard._src import compile as compile_lib
from hbm_guard._src import diagnose as diagnose_lib
from hbm_guard._src import errors
from hbm_guard._src import hosts as hosts_lib
from hbm_guard._src import ladder as ladder_lib
from hbm_guard._src import rungs as rungs_lib
from hbm_guard._src import ledger as ledger_lib
from hbm_guard._src import options as options_lib
from hbm_guard._src import plan as plan_lib
from hbm_guard._src import plan_cache as plan_cache_lib
from hbm_guard._src import probing
from hbm_guard._src import planner as planner_lib
from hbm_guard._src import prepare as prepare_lib
from hbm_guard._src import report as report_lib
from hbm_guard._src import steps as steps_lib
from hbm_guard._src import thread_context
from hbm_guard._src import trace as trace_lib
from hbm_guard._src.search import rivals as rivals_lib
from hbm_guard._src.search import space

Status = report_lib.Status
AboveClass, Ledger = ledger_lib.AboveClass, ledger_lib.Ledger  # (where the fit writes)
MAX_PROBE_WORKERS = 4  # probes side by side, at most (and no more than the host's cores)


def _probe_pool() -> concurrent.futures.ThreadPoolExecutor | None:
  """Threads for probes' compiles (each is one core's work in libtpu), if the host has
  more than one core."""
  workers = _probe_workers()
  return concurrent.futures.ThreadPoolExecutor(
      workers, thread_name_prefix="hbm_guard-probe") if workers > 1 else None


def _probe_workers() -> int:
  return min(MAX_PROBE_WORKERS, os.cpu_count() or 1)


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


class Fit:
  """One fit of the input signature `key` (the guard serialises fits)."""

  def __init__(self, step: steps_lib.StepBuilder, backend, options: options_lib.GuardOptions,
               cache: plan_cache_lib.PlanCache | None, ledger: Ledger, key, args, kwargs):
    self.step, self.backend, self.options, self.cache = step, backend, options, cache
    self.ledger, self.key, self.args, self.kwargs = ledger, key, args, kwargs
    self._search: planner_lib.Driver | None = None
    self._low_effort: bool | None = None  # probes at XLA's lowest effort (dear probes)
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # probes' compiles
    self._last: tuple[plan_lib.Plan, rungs_lib.StepFacts] | None = None
    self.budget = budget_lib.Budget(options.max_fit_seconds)
    self.progress = budget_lib.Progress(step.name, self.budget, enabled=options.progress
                                        and jax.process_index() == 0)
    self._out_of_time: budget_lib.OutOfTime | None = None
    self._first = len(ledger.attempts)
    # program -> its compile started beside the probes (the planner's decisive plans),
    # waited for and paid for once
    self._beside: dict[plan_lib.Plan, Callable[[], compile_lib.Trial]] = {}

  # -- the fit ---------------------------------------------------------------------------

  def run(self, start: plan_lib.Plan, failed_run: compile_lib.Trial | None = None
          ) -> climb_lib.Result:
    """Climbs from `start` (or from a plan that failed at run time) to a plan that fits;
    the result, or the error that says why nothing did."""
    cache_key = parts = None
    self.cached_under = None
    given = start
    if failed_run is None and self.cache is not None and self.options.auto_fallback:
      parts = cache_key_lib.parts(self.step, self.backend, self.options, self.args, self.kwargs,
                          self.key)
      cache_key = plan_cache_lib.digest(parts)
      start = self._from_cache(cache_key, parts, start)
      if planner_lib.program(start) != plan_lib.Plan():
        self.backend.unstage()  # the key's lowering: not compiled
    if not self.step.replaced and (start.shard_state or start.offload_optimizer):
      self.step.learn_state(self.args, self.kwargs)  # a planned layout needs the state first

    o = self.options
    prepare = (failed_run is None and start is given and o.auto_fallback
               and o.search == options_lib.Search.PROBES and self.backend.stages)

    preparations = []

    def try_plan(p):
      if failed_run is not None and p == failed_run.plan:
        return failed_run
      if not prepare or self.budget.count(budget_lib.Spend.COMPILE):
        return self._compile(p)
      preparations.append(prepare_lib.Preparation(self.backend, self.step, o, self.key,
                                                  self.args, self.kwargs, p,
                                                  width=_probe_workers()))
      return self._compile(p, preparations[-1])

    try:
      result = self._climb(try_plan, start, preparations)
      if self._out_of_time is not None:
        self._stop_for_time()  # nothing fit in time: not remembered as exhausted
      if cache_key is not None:
        self.cached_under = (cache_key, parts)
        self.cache.put(cache_key, plan_cache_lib.Entry(
            status=Status.FITS if result.status is climb_lib.Status.FITS else Status.EXHAUSTED,
            plan=result.plan, attempts=tuple(a.to_dict() for a in result.attempts),
            parts=parts, written_at=time.time()))
      if result.status is not climb_lib.Status.FITS:
        self._fail(result)
      return result
    finally:  # the fit is over (its report priced): nothing left to price
      self.step.saw_traced(None, None, None, None)

  def rivals(self, result: climb_lib.Result, *, estimated: bool = False
             ) -> rivals_lib.Field | None:
    """What the search knew around the plan it chose, for timing plans against it where
    the step runs here (`tournament`), or, `estimated`, for comparing their compiled
    programs on a target (`estimated`); None where nothing was searched."""
    if (self._search is None or self._last is None
        or self.backend.runs_here == estimated
        or result.status is not climb_lib.Status.FITS):
      return None
    plan, facts = self._last
    o, state = self.options, self._search.state
    fams, counts, _ = space.families(o.ladder, plan, facts, o.max_class,
                                     state.data_parallel_failed)
    return rivals_lib.field(state, result.plan, fams, counts, estimated=estimated)

  def remember(self, plan: plan_lib.Plan, attempts: tuple[dict, ...]) -> None:
    """The plan the first steps settled on, in the plan cache in place of the search's."""
    if self.cached_under is None:
      return
    cache_key, parts = self.cached_under
    self.cache.put(cache_key, plan_cache_lib.Entry(
        status=Status.FITS, plan=plan, attempts=attempts, parts=parts,
        written_at=time.time()))

  def _climb(self, try_plan, start: plan_lib.Plan, preparations) -> climb_lib.Result | None:
    """The climb itself; what ran beside it is let go however it ends."""
    o = self.options
    try:
      return climb_lib.climb(
          self._in_step(try_plan), start, rungs=o.ladder, max_class=o.max_class,
          max_attempts=o.max_attempts,
          auto_fallback=o.auto_fallback,
          step_facts=lambda t: self.backend.step_facts(self.args, self.kwargs, t),
          first_number=len(self.ledger.attempts) + 1,
          signature=trace_lib.describe_args(self.args, self.kwargs, o.state_argnums),
          on_attempt=self.ledger.record,
          plan_next=(self._in_step(self._plan_next) if o.search == options_lib.Search.PROBES
                     else None))
    except budget_lib.OutOfTime as e:  # a compile the budget could not pay for
      self._out_of_time = e
      return None
    finally:
      for preparation in preparations:
        preparation.close()
      self.backend.unstage()
      if self._pool is not None:  # a probe still running is not waited for
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None

  def _in_step(self, fn: Callable) -> Callable:
    """With several processes and a time budget, a process out of time stops them all at
    the same point: after each compile and each choice, every process learns whether any
    is (one stopping alone would leave the others waiting for it at the next collective)."""
    if self.budget.limit is None or jax.process_count() == 1:
      return fn
    def in_step(*args, **kwargs):
      out_of_time = result = None
      try:
        result = fn(*args, **kwargs)
      except budget_lib.OutOfTime as e:
        out_of_time = e
      if hosts_lib.any_process(out_of_time is not None):
        raise out_of_time or budget_lib.OutOfTime(
            budget_lib.Spend.COMPILE, self.budget.estimate(budget_lib.Spend.COMPILE))
      return result
    return in_step

  def _from_cache(self, cache_key: str, parts: dict, start: plan_lib.Plan) -> plan_lib.Plan:
    cached = self.cache.get(cache_key,
                            lambda e: cache_key_lib.trusted_entry(self.options, e, len(self.args)))
    if cached is None:
      return start
    if cached.status == Status.EXHAUSTED:
      if jax.process_count() == 1 and not self.options.plan_cache_retry_exhausted:
        self._exhausted_from_cache(cache_key, parts, cached)  # many hosts never stop alone
      return start
    logging.info("hbm_guard: %s starts from the cached plan %s (%s)", self.step.name,
                 cached.plan.describe(), self.cache.path(cache_key))
    return cached.plan

  def _exhausted_from_cache(self, cache_key: str, parts: dict, cached) -> None:
    """A retry after exhaustion does not climb again: same program, same answer. Unless
    asked to: the error says how old the answer is and what it covers."""
    path = self.cache.path(cache_key)
    self.ledger.write(Status.EXHAUSTED, attempts=list(cached.attempts),
                      note=f"from the plan cache {path}: no compile was made")
    raise errors.LadderExhaustedError.remembered(
        name=self.step.name, age_seconds=cached.age_seconds() or 0.0,
        compiles=len(cached.attempts), where=str(parts.get("where")),
        last=cached.plan.describe(), cache_dir=self.cache.directory,
        report_path=self.ledger.path)

  # -- spending ----------------------------------------------------------------------------

  def _compile(self, plan: plan_lib.Plan, meanwhile: backend_lib.Meanwhile | None = None
               ) -> compile_lib.Trial:
    beside = self._beside.get(planner_lib.program(plan))
    if beside is not None:  # started beside the probes: waited for
      return dataclasses.replace(beside(), plan=plan)
    self.budget.check(budget_lib.Spend.COMPILE)
    compile_now = functools.partial(self.backend.compile, plan, self.key, self.args,
                                    self.kwargs, meanwhile=meanwhile)
    if self.budget.limit is None or self.budget.first:
      trial = compile_now()
    else:  # estimated within the budget, it may still run past it: waited for no longer
      # (with several processes, all then stop together: _in_step)
      trial = self.budget.wait(thread_context.submit(compile_now, "hbm_guard-compile"),
                               budget_lib.Spend.COMPILE)
    return self._paid(plan, trial)

  rival_width = property(lambda self: _probe_workers(), doc="Rivals a round: as probes.")

  def compile_rivals(self, plans: Sequence[plan_lib.Plan]
                     ) -> list[compile_lib.Trial | None]:
    """A target's rivals compiled at the capacity (`estimated`), side by side (each
    lowered here; a round of `rival_width` takes one compile's wall where the host has the
    cores); None for each the budget cannot pay or wait for (left to finish on its own)."""
    try:
      self.budget.check(budget_lib.Spend.COMPILE)
    except budget_lib.OutOfTime:
      return [None] * len(plans)
    pool = concurrent.futures.ThreadPoolExecutor(len(plans), thread_name_prefix="hbm_guard-rival")
    try:
      futures = [pool.submit(self.backend.staged_compile(p, self.key, self.args, self.kwargs))
                 for p in plans]
      out: list[compile_lib.Trial | None] = []
      for plan, future in zip(plans, futures):
        try:
          out.append(self._paid(plan, self.budget.wait(future, budget_lib.Spend.COMPILE)))
        except budget_lib.OutOfTime:
          out.append(None)
      return out
    finally:
      pool.shutdown(wait=False, cancel_futures=True)

  def _refused(self, plan: plan_lib.Plan, why: str | None) -> None:
    """A refusal met tracing `plan`, in the report and the progress line (once each)."""
    if why and self.ledger.refuse(plan, why):
      said = self.progress.stopped(f"{plan.describe()}: the batch was not split: {why}")
      log = logging.debug if said else logging.info  # said once, where a person looks
      log("hbm_guard: %s: the batch was not split under %s: %s", self.step.name,
          plan.describe(), why)

  def _paid(self, plan: plan_lib.Plan, trial: compile_lib.Trial) -> compile_lib.Trial:
    """A compile's seconds counted against the budget, and its line of progress."""
    self._refused(plan, probing.refused(trial))
    if trial.outcome is compile_lib.Outcome.UNEVEN:  # traced, not compiled
      self.progress.stopped(f"{plan.describe()}: {trial.uneven} The climb takes a count "
                            f"that divides it.")
      return trial
    self.budget.record(budget_lib.Spend.COMPILE, trial.seconds)
    rec = trial.record
    self.progress.compiled(
        plan.describe(), trial.outcome is compile_lib.Outcome.FITS,
        rec.required_bytes if rec else (trial.memory or {}).get("peak"),
        rec.available_bytes if rec else self.backend.capacity(self.args), trial.seconds,
        trial.breakdown.summary() if trial.breakdown is not None else None)
    return trial

  def _start_compile(self, plan: plan_lib.Plan):
    """Starts a real compile of `plan` in the probes' pool (lowered here); a call that
    waits for (figure, seconds, fits). The compile is the one the climb then uses."""
    self.budget.check(budget_lib.Spend.COMPILE)
    self._pool = self._pool or _probe_pool()
    run = self.backend.staged_compile(plan, self.key, self.args, self.kwargs)
    future = self._pool.submit(run)
    trial = self._beside[planner_lib.program(plan)] = functools.cache(
        lambda: self._paid(plan, self.budget.wait(future, budget_lib.Spend.COMPILE)))
    def read():
      t = trial()
      return probing.figure(t), t.seconds, t.outcome is compile_lib.Outcome.FITS
    read.done = future.done  # a compile a race no longer waits for still holds its core
    return read

  def _probe(self, plan: plan_lib.Plan) -> int | None:
    return self._start_probes([plan])[0]()[0]

  def _start_probes(self, plans) -> list:
    """Starts probes of `plans`, side by side where the host has the cores; for each, a
    call that waits for its figure and seconds. The budget pays for them as for one."""
    self.budget.check(budget_lib.Spend.PROBE)
    if self._low_effort is None:  # decided once, so that a fit's probes compare
      self._low_effort = bool(self._search is not None and self._search.probes_are_dear)
    self._pool = self._pool or _probe_pool()
    futures = probing.start_probes(self.backend, plans, self.key, self.args, self.kwargs,
                                       self._low_effort, self._pool)
    return [functools.partial(self._read_probe, p, f) for p, f in zip(plans, futures)]

  def _read_probe(self, plan: plan_lib.Plan, future) -> tuple[int | None, float]:
    need, seconds, why, broken = self.budget.wait(future, budget_lib.Spend.PROBE)
    self.budget.record(budget_lib.Spend.PROBE, seconds)
    self._refused(plan, why)
    if broken is not None:
      self.ledger.probed[plan.describe()] = broken
    self.progress.probed(plan.describe(), need, seconds,
                         broken.summary() if broken is not None else None)
    return need, seconds

  def _stop_for_time(self):
    attempts = self.ledger.attempts[self._first:]
    failed = [a for a in attempts if a.record is not None and a.record.required_bytes]
    closest = min(failed, key=lambda a: a.record.required_bytes).plan if failed else None
    e, b = self._out_of_time, self.budget
    self.progress.stopped(f"stopped: the time budget cannot pay for the next {e.kind} "
                          f"(about {e.estimate:.0f} s)")
    written = self.ledger.write(Status.EXHAUSTED, note=(
        f"stopped at the time budget max_fit_seconds={b.limit:g} after {b.elapsed:.0f} s"))
    raise errors.FitTimeBudgetError.spent(
        name=self.step.name, budget=b.limit, elapsed=b.elapsed,
        compiles=b.count(budget_lib.Spend.COMPILE), probes=b.count(budget_lib.Spend.PROBE),
        next_cost=e.estimate, closest=closest.describe() if closest else "none compiled",
        report_path=self.ledger.path if written else None, attempts=attempts)

  # -- planning ----------------------------------------------------------------------------

  def _plan_next(self, plan: plan_lib.Plan, trial: compile_lib.Trial,
                 facts: rungs_lib.StepFacts):
    """The planner's choice after `plan` failed (the ladder's, with no capacity known)."""
    rec, o = trial.record, self.options
    if self._search is None:
      capacity = hosts_lib.agree_capacity(self.backend.capacity(self.args) or rec.available_bytes)
      if not capacity:
        return ladder_lib.next_plan(o.ladder, plan, facts, rec, o.max_class) + (None,)
      stages = self.backend.stages
      self._search = planner_lib.Driver(
          self._probe,
          lambda p: self.step.flops(p, self.args, self.kwargs, len(self.backend.devices())),
          capacity,
          scale=self.backend.probe_scale, exact=self.backend.exact_probes,
          headroom=o.headroom, start_probes=self._start_probes,
          side_by_side=_probe_workers() > 1 and stages,
          start_compile=self._start_compile if stages else None, width=_probe_workers(),
          stage_ahead=(functools.partial(self.backend.stage_ahead, key=self.key,
                                         args=self.args, kwargs=self.kwargs)
                       if stages else None))
    self._last = (plan, facts)
    self._search.observe(plan, rec.required_bytes, fits=False, seconds=trial.seconds)
    try:
      return planner_lib.next_plan(self._search, o.ladder, plan, facts, rec, o.max_class)
    except budget_lib.OutOfTime as e:  # a probe the budget could not pay for: stop here
      self._out_of_time = e
      return None, [], planner_lib.Planning(
          None, f"stopped: the time budget cannot pay for the next {e.kind}",
          scale=self._search.scale)

  def _fail(self, result: climb_lib.Result):
    trial, attempts = result.last, result.attempts
    diag, rec, name = attempts[-1].diagnosis, trial.record, self.step.name
    if result.status is climb_lib.Status.DIAGNOSED:
      written = self.ledger.write(Status.DIAGNOSED)
      logging.error("hbm_guard: %s does not fit (%s); auto fallback is off. Report: %s",
                    name, diag.summary, self.ledger.path if written else None)
      if trial.error is not None:
        raise trial.error  # the compiler's own error, unchanged
      raise errors.CapacityExceededError.over(
          name=name, need=rec.required_bytes, capacity=rec.available_bytes,
          scenario=diag.scenario, summary=diag.summary,
          report_path=self.ledger.path if written else None, attempts=attempts)
    try:
      above = above_class(self._search, self._last, self.options)
    except budget_lib.OutOfTime:
      above = None  # no time left to price a higher class
    written = self.ledger.write(Status.EXHAUSTED, above=above)
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
        refused=list(self.ledger.refused.items()),
        report_path=self.ledger.path if written else None) from trial.error
