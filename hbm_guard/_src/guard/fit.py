"""One fit of one input signature: cache lookup, climb, cache write.

A `Fit` owns its planner for its whole life (so "would a higher class fit?" asks the
planner that priced this climb), pays for compiles and probes through its `Spending`, and
returns the climb's result, or raises the error a person can act on (`fit_ended`). Nothing
here calls back into the guard.
"""

from __future__ import annotations

import functools
import time
from typing import Callable

import jax
from absl import logging

from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.backends import hosts as hosts_lib
from hbm_guard._src.backends import options as options_lib
from hbm_guard._src.backends import prepare as prepare_lib
from hbm_guard._src.backends import steps as steps_lib
from hbm_guard._src.backends import trace as trace_lib
from hbm_guard._src.files import plan_cache as plan_cache_lib
from hbm_guard._src.files import report as report_lib
from hbm_guard._src.guard import budget as budget_lib
from hbm_guard._src.guard import cache_key as cache_key_lib
from hbm_guard._src.guard import climb as climb_lib
from hbm_guard._src.guard import fit_ended as ended
from hbm_guard._src.guard import ledger as ledger_lib
from hbm_guard._src.guard import spend as spend_lib
from hbm_guard._src.plans import ladder as ladder_lib
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.plans import rungs as rungs_lib
from hbm_guard._src.search import planner as planner_lib
from hbm_guard._src.search import rivals as rivals_lib
from hbm_guard._src.search import space

Status = report_lib.Status
AboveClass, Ledger = ledger_lib.AboveClass, ledger_lib.Ledger  # (where the fit writes)


class Fit:
  """One fit of the input signature `key` (the guard serialises fits)."""

  def __init__(self, step: steps_lib.StepBuilder, backend, options: options_lib.GuardOptions,
               cache: plan_cache_lib.PlanCache | None, ledger: Ledger, key, args, kwargs):
    self.step, self.backend, self.options, self.cache = step, backend, options, cache
    self.ledger, self.key, self.args, self.kwargs = ledger, key, args, kwargs
    self._search: planner_lib.Driver | None = None
    self._low_effort: bool | None = None  # probes at XLA's lowest effort (dear probes)
    self._last: tuple[plan_lib.Plan, rungs_lib.StepFacts] | None = None
    self.budget = budget_lib.Budget(options.max_fit_seconds)
    self.progress = budget_lib.Progress(step.name, self.budget, enabled=options.progress
                                        and jax.process_index() == 0)
    self._out_of_time: budget_lib.OutOfTime | None = None
    self._first = len(ledger.attempts)
    self.spend = spend_lib.Spending(step, backend, ledger, self.budget, self.progress, key,
                                    args, kwargs)

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
        return self.spend.compile(p)
      preparations.append(prepare_lib.Preparation(self.backend, self.step, o, self.key,
                                                  self.args, self.kwargs, p,
                                                  width=spend_lib.probe_workers()))
      return self.spend.compile(p, preparations[-1])

    try:
      result = self._climb(try_plan, start, preparations)
      if self._out_of_time is not None:
        ended.out_of_time(self.ledger, self.progress, self.budget, self._out_of_time,
                          self.ledger.attempts[self._first:], self.step.name)
        # (nothing fit in time: not remembered as exhausted)
      if cache_key is not None:
        self.cached_under = (cache_key, parts)
        self.cache.put(cache_key, plan_cache_lib.Entry(
            status=Status.FITS if result.status is climb_lib.Status.FITS else Status.EXHAUSTED,
            plan=result.plan, attempts=tuple(a.to_dict() for a in result.attempts),
            parts=parts, written_at=time.time()))
      if result.status is not climb_lib.Status.FITS:
        ended.nothing_fits(result, self.ledger, self.step.name, self.options,
                           self._search, self._last)
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
      self.spend.close()

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
        ended.remembered_exhausted(self.cache, cache_key, parts, cached, self.ledger,
                                   self.step.name)  # (many hosts never stop alone)
      return start
    logging.info("hbm_guard: %s starts from the cached plan %s (%s)", self.step.name,
                 cached.plan.describe(), self.cache.path(cache_key))
    return cached.plan

  # -- spending ----------------------------------------------------------------------------

  def _probe(self, plan: plan_lib.Plan) -> int | None:
    return self._start_probes([plan])[0]()[0]

  def _start_probes(self, plans) -> list:
    if self._low_effort is None:  # decided once, so that a fit's probes compare
      self._low_effort = bool(self._search is not None and self._search.probes_are_dear)
    return self.spend.start_probes(plans, self._low_effort)

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
          side_by_side=spend_lib.probe_workers() > 1 and stages,
          start_compile=self.spend.start_compile if stages else None,
          width=spend_lib.probe_workers(),
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
