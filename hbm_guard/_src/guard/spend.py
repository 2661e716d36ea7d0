"""What one fit pays for: compiles and probes, counted against its time budget, each with
its line of progress, and the refusals met tracing them noted in the report once."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
from typing import Callable, Sequence

from absl import logging

from hbm_guard._src.backends import backend as backend_lib
from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.backends import probing
from hbm_guard._src.backends import steps as steps_lib
from hbm_guard._src.guard import budget as budget_lib
from hbm_guard._src.guard import ledger as ledger_lib
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.plans import thread_context
from hbm_guard._src.search import planner as planner_lib

MAX_PROBE_WORKERS = 4  # probes side by side, at most (and no more than the host's cores)


def probe_workers() -> int:
  return min(MAX_PROBE_WORKERS, os.cpu_count() or 1)


def _probe_pool() -> concurrent.futures.ThreadPoolExecutor | None:
  """Threads for probes' compiles (each is one core's work in libtpu), if the host has
  more than one core."""
  workers = probe_workers()
  return concurrent.futures.ThreadPoolExecutor(
      workers, thread_name_prefix="hbm_guard-probe") if workers > 1 else None


class Spending:
  """The compiles and probes of one fit of signature `key` (`args`, `kwargs`)."""

  def __init__(self, step: steps_lib.StepBuilder, backend, ledger: ledger_lib.Ledger,
               budget: budget_lib.Budget, progress: budget_lib.Progress, key, args, kwargs):
    self.step, self.backend, self.ledger = step, backend, ledger
    self.budget, self.progress = budget, progress
    self.key, self.args, self.kwargs = key, args, kwargs
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # probes' compiles
    # program -> its compile started beside the probes (the planner's decisive plans),
    # waited for and paid for once
    self._beside: dict[plan_lib.Plan, Callable[[], compile_lib.Trial]] = {}

  def close(self) -> None:
    """Lets go of the probes' threads; a probe still running is not waited for."""
    if self._pool is not None:
      self._pool.shutdown(wait=False, cancel_futures=True)
      self._pool = None

  def compile(self, plan: plan_lib.Plan, meanwhile: backend_lib.Meanwhile | None = None
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
    return self.paid(plan, trial)

  rival_width = property(lambda self: probe_workers(), doc="Rivals a round: as probes.")

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
          out.append(self.paid(plan, self.budget.wait(future, budget_lib.Spend.COMPILE)))
        except budget_lib.OutOfTime:
          out.append(None)
      return out
    finally:
      pool.shutdown(wait=False, cancel_futures=True)

  def refused(self, plan: plan_lib.Plan, why: str | None) -> None:
    """A refusal met tracing `plan`, in the report and the progress line (once each)."""
    if why and self.ledger.refuse(plan, why):
      said = self.progress.stopped(f"{plan.describe()}: the batch was not split: {why}")
      log = logging.debug if said else logging.info  # said once, where a person looks
      log("hbm_guard: %s: the batch was not split under %s: %s", self.step.name,
          plan.describe(), why)

  def paid(self, plan: plan_lib.Plan, trial: compile_lib.Trial) -> compile_lib.Trial:
    """A compile's seconds counted against the budget, and its line of progress."""
    self.refused(plan, probing.refused(trial))
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

  def start_compile(self, plan: plan_lib.Plan):
    """Starts a real compile of `plan` in the probes' pool (lowered here); a call that
    waits for (figure, seconds, fits). The compile is the one the climb then uses."""
    self.budget.check(budget_lib.Spend.COMPILE)
    self._pool = self._pool or _probe_pool()
    run = self.backend.staged_compile(plan, self.key, self.args, self.kwargs)
    future = self._pool.submit(run)
    trial = self._beside[planner_lib.program(plan)] = functools.cache(
        lambda: self.paid(plan, self.budget.wait(future, budget_lib.Spend.COMPILE)))
    def read():
      t = trial()
      return probing.figure(t), t.seconds, t.outcome is compile_lib.Outcome.FITS
    read.done = future.done  # a compile a race no longer waits for still holds its core
    return read

  def start_probes(self, plans, low_effort: bool) -> list:
    """Starts probes of `plans`, side by side where the host has the cores; for each, a
    call that waits for its figure and seconds. The budget pays for them as for one."""
    self.budget.check(budget_lib.Spend.PROBE)
    self._pool = self._pool or _probe_pool()
    futures = probing.start_probes(self.backend, plans, self.key, self.args, self.kwargs,
                                       low_effort, self._pool)
    return [functools.partial(self._read_probe, p, f) for p, f in zip(plans, futures)]

  def _read_probe(self, plan: plan_lib.Plan, future) -> tuple[int | None, float]:
    need, seconds, why, broken = self.budget.wait(future, budget_lib.Spend.PROBE)
    self.budget.record(budget_lib.Spend.PROBE, seconds)
    self.refused(plan, why)
    if broken is not None:
      self.ledger.probed[plan.describe()] = broken
    self.progress.probed(plan.describe(), need, seconds,
                         broken.summary() if broken is not None else None)
    return need, seconds
