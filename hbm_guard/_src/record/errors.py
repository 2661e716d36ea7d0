"""hbm_guard's errors: one class per error, each with a message and a docs link.

Follows flax.errors: the class docstring explains, the message says what to do.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax

_DOCS = "https://github.com/hbm-guard/hbm_guard/blob/main/docs/errors.md"


class HbmGuardError(Exception):
  """Base class: appends the link to the class's explanation."""

  def __init__(self, message: str):
    anchor = f"{_DOCS}#{type(self).__name__.lower()}"
    if anchor not in message:
      message = f"{message} ({anchor})"
    super().__init__(message)


class _OutOfMemory(HbmGuardError, jax.errors.JaxRuntimeError):
  """The step does not fit. A jax runtime error, so `except JaxRuntimeError` still works."""

  def __init__(self, message: str, *, report_path: str | None = None,
               attempts: Sequence[Any] = ()):
    super().__init__(message)
    self.report_path = report_path
    self.attempts = tuple(attempts)

  def __reduce__(self):  # keep the report and attempts across processes (pickle)
    return (_rebuild, (type(self), str(self), self.report_path, self.attempts))


def _rebuild(cls, message, report_path, attempts):
  return cls(message, report_path=report_path, attempts=attempts)


def _fmt(n: int | None) -> str:
  from hbm_guard._src.record import diagnose  # pylint: disable=g-import-not-at-top
  return diagnose.format_bytes(n)


def _where(report_path: str | None) -> str:
  return f"Report: {report_path}" if report_path else "The report could not be written."


class LadderExhaustedError(_OutOfMemory):
  """No plan on the fallback ladder fits the step in memory.

  Raised from the compiler's last out-of-memory error when there was one. `report_path`
  names the post-mortem JSON (None if it could not be written), `attempts` holds every
  attempt.
  """

  @classmethod
  def nothing_fits(cls, *, name: str, capacity: int | None, attempts: Sequence[Any],
                   need: int | None, scenario: str | None, summary: str,
                   above: Any = None, passed_over: Sequence[str] = (),
                   refused: Sequence[tuple[str, str]] = (),
                   report_path: str | None) -> "LadderExhaustedError":
    tried = "; ".join(a.plan.describe() for a in attempts)
    unsplit = "".join(f"The batch was not split ({plan}): {why} " for why, plan in refused[:2])
    hint = (f"Allowing max_class='{above.klass}' would fit: {above.plan} (predicted "
            f"{_fmt(above.predicted_bytes)}). " if above is not None else "")
    over = "".join(f"Passed over, {why}. " for why in passed_over[:3])
    return cls(f"hbm_guard: no plan fits {name} in {_fmt(capacity)} after {len(attempts)} "
               f"compile(s) (tried: {tried}); the last needed {_fmt(need)} ({scenario}: "
               f"{summary}) {over}{unsplit}{hint}{_where(report_path)}",
               report_path=report_path, attempts=attempts)

  @classmethod
  def remembered(cls, *, name: str, age_seconds: float, compiles: int, where: str,
                 last: str, cache_dir: str, report_path: str | None
                 ) -> "LadderExhaustedError":
    return cls(
        f"hbm_guard: no plan fits {name}: the plan cache remembers, from "
        f"{age_seconds / 3600:.1f} h ago, {compiles} compile(s) of this program for {where} "
        f"that all failed (last: {last}), under the same capacity, ladder, max_class, "
        "compiler flags (XLA_FLAGS, LIBTPU_INIT_ARGS, jax config) and versions; nothing was "
        "compiled. To climb again: plan_cache_retry_exhausted=True "
        f"(--hbm_guard_plan_cache_retry_exhausted), or `hbm-guard cache clear {cache_dir}`. "
        + _where(report_path), report_path=report_path)


class FitTimeBudgetError(LadderExhaustedError):
  """The fit stopped at its time budget (`max_fit_seconds`) before a plan was found.

  No compile or probe is started that the budget cannot pay for, judged by what the fit's
  earlier compiles and probes cost. Nothing is remembered as exhausted: raise the budget,
  or start from the closest plan (`plan=`), and the next fit goes on from there.
  """

  @classmethod
  def spent(cls, *, name: str, budget: float, elapsed: float, compiles: int, probes: int,
            next_cost: float, closest: str, report_path: str | None,
            attempts: Sequence[Any]) -> "FitTimeBudgetError":
    return cls(f"hbm_guard: the fit of {name} stopped at its time budget: {elapsed:.0f} s of "
               f"max_fit_seconds={budget:g} spent on {compiles} compile(s) and {probes} "
               f"probe(s); the next would take about {next_cost:.0f} s. Closest plan: "
               f"{closest}. Raise max_fit_seconds (--hbm_guard_max_fit_seconds) to go on. "
               + _where(report_path), report_path=report_path, attempts=attempts)


class CapacityExceededError(_OutOfMemory):
  """The step exceeds `capacity=` and automatic fallback is off.

  With `auto_fallback=False` the guard diagnoses and reports, but changes nothing: pass
  `auto_fallback=True` (or `--hbm_guard_auto_fallback`) to let it climb the ladder.
  """

  @classmethod
  def over(cls, *, name: str, need: int | None, capacity: int | None, scenario: str | None,
           summary: str, report_path: str | None, attempts: Sequence[Any]
           ) -> "CapacityExceededError":
    return cls(f"hbm_guard: {name} needs {_fmt(need)} of {_fmt(capacity)} ({scenario}: "
               f"{summary}); auto fallback is off, so nothing was changed. "
               f"{_where(report_path)}", report_path=report_path, attempts=attempts)


class StateConsumedError(_OutOfMemory):
  """The step ran out of memory at run time after its donated arguments were consumed.

  The guard never retries with arguments that are gone. Restore the state (from a
  checkpoint) and call again; the next fit starts from the plan that failed.
  """

  @classmethod
  def at_first_call(cls, *, name: str, plan: str) -> "StateConsumedError":
    return cls(f"hbm_guard: {name} ran out of memory at its first call under {plan}, after "
               "donated arguments were consumed: the guard cannot retry without them. "
               "Restore the state (e.g. from a checkpoint) and call again; the guard will "
               "refit from this plan.")


class UnevenMicrobatchError(HbmGuardError, ValueError):
  """The batch does not split into the plan's number of microbatches.

  hbm_guard never drops examples to make a split even: pick a batch divisible by the
  microbatch count, or let the guard choose a count that divides it (it does so for a new
  input signature, such as a trailing smaller batch).
  """

  def __init__(self, message: str, *, batch_size: int | None = None,
               microbatches: int | None = None):
    super().__init__(message)
    self.batch_size = batch_size
    self.microbatches = microbatches

  @classmethod
  def of(cls, batch_size: int, microbatches: int) -> "UnevenMicrobatchError":
    return cls(f"Batch of {batch_size} examples does not split into {microbatches} "
               f"microbatches; use a batch divisible by {microbatches} (hbm_guard never "
               f"drops examples).", batch_size=batch_size, microbatches=microbatches)


class InvalidLadderError(HbmGuardError, ValueError):
  """A ladder definition is malformed: unknown kind, class or key, or a missing field."""


class InvalidPlanError(HbmGuardError, ValueError):
  """A plan (a `Plan`, its dict, a JSON file) is malformed: an unknown field, a wrong type,
  a value out of range. Plans come from files other people wrote; nothing in one is
  applied until every field has been checked."""


class UntrustedPlanError(InvalidPlanError):
  """A plan asks for more than this guard's own options allow.

  A plan from outside (`plan=`, a report's `final_plan`, a plan cache entry) may only do
  what the guard could have chosen itself: rungs of its ladder within `max_class`,
  donation of `state_argnums` (or the user's own `donate_argnums`), compiler options that
  the ladder's rungs define. Raise `max_class`, extend the ladder, or fix the plan.
  """


class InvalidOptionError(HbmGuardError, ValueError):
  """An option given to `guarded_jit` (or its flags) has the wrong type or value.

  Every option is checked once, when the guarded step is built; the message names the
  option and what it accepts.
  """


class UnknownTargetError(HbmGuardError, ValueError):
  """`target=` or `capacity=` names no known device or topology."""


class TpuCompilerBusyError(UnknownTargetError):
  """libtpu is held by another process, so this one cannot compile for a TPU target.

  Set ALLOW_MULTIPLE_LIBTPU_LOAD=1 in every process that loads libtpu (compiling for a
  topology needs no TPU chip, so sharing is safe), or wait for the other process to exit.
  """
