"""What a fit spends, in seconds, against its budget, and the progress a person sees.

Compile seconds, not compile counts, are what a user waits for. A fit starts no compile or
probe that its budget (`max_fit_seconds`) cannot pay for, judged by the dearest one of the
same kind so far (a first probe by the first compile: at real size they cost alike). Once a
step has not fit, each compile and probe is a line on stderr, without configuring absl.
That line is the one channel for progress: absl's log repeats it only at debug (`-v 1`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import sys
import time
from typing import Any, TextIO

from hbm_guard._src.record import diagnose as diagnose_lib


class Spend(enum.StrEnum):
  COMPILE = "compile"
  PROBE = "probe"


class OutOfTime(Exception):
  """Raised inside a fit when the next compile or probe would overrun the budget."""

  def __init__(self, kind: Spend, estimate: float):
    super().__init__(f"hbm_guard: no time left for a {kind}")
    self.kind, self.estimate = kind, estimate


@dataclasses.dataclass
class Budget:
  """The seconds one fit has spent, by kind, against an optional limit."""
  limit: float | None = None
  started: float = dataclasses.field(default_factory=time.perf_counter)
  spent: dict[Spend, list[float]] = dataclasses.field(
      default_factory=lambda: {Spend.COMPILE: [], Spend.PROBE: []})

  @property
  def elapsed(self) -> float:
    return time.perf_counter() - self.started

  def estimate(self, kind: Spend) -> float:
    """What the next of `kind` should cost: the dearest so far (a probe: like a compile)."""
    same = self.spent[kind] or (self.spent[Spend.COMPILE] if kind is Spend.PROBE else [])
    return max(same, default=0.0)

  @property
  def first(self) -> bool:
    """Nothing spent yet: the next compile is the one any job makes, never refused."""
    return not any(self.spent.values())

  def check(self, kind: Spend) -> None:
    """Raises OutOfTime if the next `kind` cannot finish within the limit."""
    if self.limit is None or self.first:
      return
    estimate = self.estimate(kind)
    if self.elapsed + estimate > self.limit:
      raise OutOfTime(kind, estimate)

  def wait(self, future: concurrent.futures.Future, kind: Spend) -> Any:
    """The result of a compile or probe running in another thread (beside the fit, or the
    climb's own after the first), waited for no longer than the budget has left: one
    estimated within it can still run past it (the 368M step's compile that fits took
    50-60 s after a failed one of 17), and libtpu cannot be stopped, so the fit stops
    waiting and leaves it to finish on its own."""
    if self.limit is None:
      return future.result()
    try:
      return future.result(timeout=max(0.0, self.limit - self.elapsed))
    except concurrent.futures.TimeoutError:
      raise OutOfTime(kind, self.estimate(kind)) from None

  def record(self, kind: Spend, seconds: float) -> None:
    self.spent[kind].append(seconds)

  def count(self, kind: Spend) -> int:
    return len(self.spent[kind])


class Progress:
  """One line per compile and probe on stderr, once the step has not fit (process 0)."""

  def __init__(self, name: str, budget: Budget, *, enabled: bool, stream: TextIO | None = None):
    self.name, self.budget, self.enabled = name, budget, enabled
    self._stream = stream
    self._active = False

  def _say(self, text: str) -> bool:
    """Whether the line was printed (progress on, and the step has not fit)."""
    if not (self.enabled and self._active):
      return False
    limit = f" of {self.budget.limit:.0f}" if self.budget.limit is not None else ""
    stream = self._stream or sys.stderr
    print(f"hbm_guard: {self.name}: {text} [{self.budget.elapsed:.0f}{limit} s; "
          f"{self.budget.count(Spend.COMPILE)} compile(s), "
          f"{self.budget.count(Spend.PROBE)} probe(s)]", file=stream, flush=True)
    return True

  def compiled(self, described: str, fits: bool, need: int | None, capacity: int | None,
               seconds: float, parts: str | None = None) -> None:
    if not fits:
      self._active = True
    fmt = diagnose_lib.format_bytes
    if fits and need and capacity and need > capacity:  # libtpu's verdict decides
      what = f"fits by the compiler's verdict (memory_analysis sums {fmt(need)})"
    else:
      of = f" of {fmt(capacity)}" if capacity else ""
      what = f"{'fits' if fits else 'does not fit'}, needs {fmt(need)}{of}"
    largest = f"; largest: {parts}" if parts and not fits else ""
    self._say(f"compile {described}: {what} ({seconds:.1f} s){largest}")

  def probed(self, described: str, need: int | None, seconds: float,
             parts: str | None = None) -> None:
    largest = f"; largest: {parts}" if parts else ""
    self._say(f"probe {described}: needs {diagnose_lib.format_bytes(need)} ({seconds:.1f} s)"
              f"{largest}")

  def stopped(self, why: str) -> bool:
    return self._say(why)
