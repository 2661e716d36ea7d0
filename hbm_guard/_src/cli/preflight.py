"""Preflight: will this step fit these targets, with which plan, before a queue slot is spent.

Like MaxText's train_compile.py, for any guarded step: for each target the step is fitted
ahead of time with libtpu on this machine (no TPU needed), without running anything.
"""

from __future__ import annotations

import importlib
import sys
import time
from typing import Any, Sequence

from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.files import report as report_lib
from hbm_guard._src.guard import guard as guard_lib
from hbm_guard._src.record import errors


def load_factory(spec: str):
  """'package.module:factory' -> the factory; a usage error if it is not there."""
  module_name, _, attr = spec.partition(":")
  if not module_name or not attr:
    raise ValueError(f"{spec!r} is not MODULE:FACTORY")
  if "" not in sys.path and "." not in sys.path:
    sys.path.insert(0, "")  # the working directory, as `python -m` has it
  module = importlib.import_module(module_name)
  factory = getattr(module, attr, None)
  if not callable(factory):
    raise ValueError(f"{module_name} has no callable {attr!r}")
  return factory


def check(step: guard_lib.GuardedFunction, args: Sequence[Any], target: str, *,
          capacity: str | int | None = None, max_class: str | None = None,
          estimated_rivals: int | None = None) -> dict[str, Any]:
  """Fits `step` for `target` without running it; a row of the preflight table."""
  options: dict[str, Any] = {"target": target, "capacity": capacity}
  if max_class:
    options["max_class"] = max_class
  if estimated_rivals is not None:
    options["estimated_rivals"] = estimated_rivals
  guarded = step.replace(**options)
  t0 = time.perf_counter()
  row = _fitted(guarded, args, target)
  row["seconds"] = round(time.perf_counter() - t0, 1)
  attempts = guarded.attempts
  last = attempts[-1] if attempts else None
  compared = guarded.estimated
  row["plan"] = guarded.plan.describe() if row["fits"] else None
  rivals = compared.estimates[1:] if compared is not None else ()
  row["compiles"] = len(attempts) + len(rivals)  # every compile the fit paid for
  row["failed_compiles"] = (sum(a.outcome is not compile_lib.Outcome.FITS for a in attempts)
                            + sum(not e.fits for e in rivals))
  row["probes"] = sum(len(a.planning.probes) for a in attempts if a.planning is not None)
  row["capacity_bytes"] = guarded.options.budget
  if compared is not None and row["fits"]:  # the plan kept may be a rival: its own peak
    row["peak_bytes"] = compared.kept.peak_bytes
  else:
    row["peak_bytes"] = ((last.memory or {}).get("peak")
                         if last and last.outcome is compile_lib.Outcome.FITS
                         else (last.record.required_bytes if last and last.record else None))
  failed = next((a for a in reversed(attempts) if a.record is not None), None)
  row["largest_allocations"] = (report_lib.largest_allocations(failed.record.to_dict(), 3)
                                if failed else [])
  broken = next((a.breakdown for a in reversed(attempts) if a.breakdown is not None), None)
  row["breakdown"] = broken.to_dict() if broken is not None else None
  row["estimated_step_ms"] = _estimated_ms(guarded) if row["fits"] else None
  row["compared"] = compared.to_dict()["plans"] if compared is not None else []
  row["report"] = guarded.report_path
  return row


def memory(step: guard_lib.GuardedFunction, args: Sequence[Any], target: str, *,
           capacity: str | int | None = None) -> dict[str, Any]:
  """Where `step`'s memory goes for `target`, as written (its own plan, compiled once and
  not fitted): the breakdown, and whether it fits."""
  guarded = step.replace(target=target, capacity=capacity, auto_fallback=False,
                         memory_breakdown=True, plan_cache=False)
  row = _fitted(guarded, args, target)
  attempt = guarded.attempts[-1] if guarded.attempts else None
  row["breakdown"] = (attempt.breakdown.to_dict() if attempt is not None
                      and attempt.breakdown is not None else None)
  row["report"] = guarded.report_path
  return row


def _fitted(guarded: guard_lib.GuardedFunction, args: Sequence[Any], target: str
            ) -> dict[str, Any]:
  """Fits `guarded`: {"target", "fits", "error" where it does not}."""
  row: dict[str, Any] = {"target": target}
  try:
    guarded.fit(*args)
    row["fits"] = True
  except errors.HbmGuardError as e:
    row["fits"] = False
    row["error"] = str(e).split(" (https://")[0]
  except Exception as e:  # pylint: disable=broad-except  (the compiler's own, not an OOM)
    row["fits"] = False
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500]
  return row


def _estimated_ms(guarded: guard_lib.GuardedFunction) -> float | None:
  """The plan kept's estimated step time on the target, from its compiled program (the
  rivals' comparison, else the compile that fitted it); None where it gave none."""
  compared = guarded.estimated
  if compared is not None:
    seconds = compared.kept.seconds
  else:
    fitted = next((a for a in reversed(guarded.attempts)
                   if a.outcome is compile_lib.Outcome.FITS and a.plan == guarded.plan), None)
    seconds = fitted.estimate.seconds if fitted and fitted.estimate else None
  return None if seconds is None else round(1000 * seconds, 3)
