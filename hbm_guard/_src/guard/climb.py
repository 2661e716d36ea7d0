"""The climb: compile under a plan, read what failed, choose the next plan, until one fits.

A plain function of a compile function and a ladder, so it can be tested and reused (the
guard, preflight) without a jit in sight. Side effects are the callbacks' business.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from absl import logging

from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.backends import hosts as hosts_lib
from hbm_guard._src.backends import step_time
from hbm_guard._src.files import report as report_lib
from hbm_guard._src.plans import ladder as ladder_lib
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.plans import rungs as rungs_lib
from hbm_guard._src.record import diagnose as diagnose_lib
from hbm_guard._src.record import record as record_lib

_MAX_REFITS = 4  # microbatch counts re-chosen for an uneven batch before giving up


Status = report_lib.Status  # a climb ends FITS, EXHAUSTED or DIAGNOSED


@dataclasses.dataclass(frozen=True)
class Attempt:
  """One compile of the step under one plan, and what the compiler said."""
  number: int
  plan: plan_lib.Plan
  outcome: compile_lib.Outcome  # FITS or OOM
  seconds: float
  record: record_lib.E1000Record | None = None
  diagnosis: diagnose_lib.Diagnosis | None = None
  memory: dict[str, int] | None = None  # from compiled.memory_analysis()
  skipped: tuple[rungs_lib.Skip, ...] = ()  # rungs passed over to choose the next plan
  signature: str = ""  # the input shapes this attempt was for
  loss_form: str | None = None  # how the step's value_and_grad reduced its loss
  planning: Any = None  # planner.Planning: the probes that chose the next plan, and why
  optimizer_streaming: str | None = None  # offloaded state: per parameter, or whole
  auto: str | None = None  # what the drop-in analysis did with the step's gradient
  layout: tuple[str, ...] = ()  # where the batch and the largest state leaves were put
  estimate: step_time.Estimate | None = None  # a target's step time, from its program
  # why the drop-in did not split the batch, met tracing the plans priced or compiled
  # while choosing the next plan (a probe's, a compile's beside): "plan: why"
  refused: tuple[str, ...] = ()
  breakdown: Any = None  # breakdown.Breakdown: where the program's memory goes

  def to_dict(self) -> dict[str, Any]:
    return {
        "number": self.number, "plan": self.plan.to_dict(), "described": self.plan.describe(),
        "outcome": compile_lib.Outcome(self.outcome).value, "seconds": round(self.seconds, 3),
        "signature": self.signature, "loss_form": self.loss_form,
        "optimizer_streaming": self.optimizer_streaming, "auto": self.auto,
        "layout": list(self.layout),
        "record": self.record.to_dict() if self.record else None,
        "diagnosis": self.diagnosis.to_dict() if self.diagnosis else None,
        "memory": self.memory,
        "skipped": [s.to_dict() for s in self.skipped],
        "planning": self.planning.to_dict() if self.planning is not None else None,
        "estimated_step": self.estimate.to_dict() if self.estimate is not None else None,
        "refused": list(self.refused),
        "breakdown": self.breakdown.to_dict() if self.breakdown is not None else None,
    }


@dataclasses.dataclass(frozen=True)
class Result:
  status: Status
  plan: plan_lib.Plan  # the plan that fits, or the last one tried
  attempts: tuple[Attempt, ...]
  last: compile_lib.Trial


def divisor_at_least(n: int, k: int) -> int:
  """The smallest divisor of n that is >= k (n itself when k > n)."""
  return next(iter(plan_lib.microbatch_counts(n, above=max(1, k) - 1)), n)


def climb(try_plan: Callable[[plan_lib.Plan], compile_lib.Trial], start: plan_lib.Plan, *,
          rungs: Sequence[rungs_lib.Rung], max_class: rungs_lib.RungClass, max_attempts: int,
          auto_fallback: bool, step_facts: Callable[[compile_lib.Trial], rungs_lib.StepFacts],
          first_number: int = 1, signature: str = "",
          on_attempt: Callable[[Attempt], None] = lambda a: None,
          plan_next: Callable[..., tuple[plan_lib.Plan | None, list, Any]] | None = None
          ) -> Result:
  """Compiles from `start` until a plan fits, nothing allowed can, or `max_attempts`
  compiles were spent. With `auto_fallback` off, stops after the first. `plan_next(plan,
  trial, facts)` (a planner) chooses the next plan; without it, the ladder's next rung."""
  attempts: list[Attempt] = []
  plan = hosts_lib.agree_plan(start)
  refits = 0
  while True:
    trial = hosts_lib.agree_trial(try_plan(plan))
    if trial.outcome is compile_lib.Outcome.UNEVEN:  # not compiled: choose a count that divides
      batch = trial.uneven.batch_size
      refits += 1
      if refits > _MAX_REFITS or not batch:
        raise trial.uneven
      plan = dataclasses.replace(plan, microbatches=divisor_at_least(batch, plan.microbatches))
      continue
    number = first_number + len(attempts)
    loss_form = trial.facts.loss_form if trial.facts else None
    streaming = trial.facts.optimizer_streaming if trial.facts else None
    auto = trial.facts.auto if trial.facts else None
    if trial.outcome is compile_lib.Outcome.FITS:
      attempt = Attempt(number, plan, compile_lib.Outcome.FITS, trial.seconds, memory=trial.memory,
                        signature=signature, loss_form=loss_form,
                        optimizer_streaming=streaming, auto=auto, layout=trial.layout,
                        estimate=trial.estimate, breakdown=trial.breakdown)
      attempts.append(attempt)
      on_attempt(attempt)
      return Result(Status.FITS, plan, tuple(attempts), trial)
    rec = trial.record
    diag = diagnose_lib.diagnose(rec)
    nxt, skips, planning = None, [], None
    if auto_fallback and plan_next is not None:
      nxt, skips, planning = plan_next(plan, trial, step_facts(trial))
    elif auto_fallback:
      history = [(a.plan, a.record.required_bytes) for a in attempts if a.record is not None]
      nxt, skips = ladder_lib.next_plan(
          rungs, plan, step_facts(trial), rec, max_class,
          temp_bytes=(trial.memory or {}).get("temp") or rec.temp_bytes, history=history)
    if nxt is not None and any(a.plan == nxt for a in attempts):
      nxt = None  # never compile a plan twice
    if auto_fallback:
      nxt = hosts_lib.agree_plan(nxt)  # process 0 decides, for every process
    attempt = Attempt(number, plan, compile_lib.Outcome.OOM, trial.seconds, rec, diag, trial.memory,
                      tuple(skips), signature, loss_form, planning, streaming, auto,
                      trial.layout, breakdown=trial.breakdown)
    attempts.append(attempt)
    on_attempt(attempt)
    if not auto_fallback:
      return Result(Status.DIAGNOSED, plan, tuple(attempts), trial)
    if nxt is None or len(attempts) >= max_attempts:
      return Result(Status.EXHAUSTED, plan, tuple(attempts), trial)
    logging.debug("hbm_guard: next plan %s", nxt.describe())
    plan = nxt
