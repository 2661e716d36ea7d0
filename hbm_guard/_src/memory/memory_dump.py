"""The side of a breakdown that touches disk: a compile (or probe) dumps its program to a
directory of its own (`xla_dump_to`), the dump is read and turned into a `Breakdown`, and
the directory is removed, whatever happened.

libtpu writes the dump even where its early check fails the compile, so a failure that
lists no allocation still gets a breakdown, from the compiler's own buffer assignment.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import shutil
import tempfile
import time
from typing import Any, Callable, Iterator

from absl import logging

from hbm_guard._src.memory import breakdown as breakdown_lib
from hbm_guard._src.memory import buffer_dump
from hbm_guard._src.record import record as record_lib

_EARLY = "libtpu's early check"


@dataclasses.dataclass
class Scope:
  """One compile's dump directory; `options` go to the compile."""
  directory: str | None

  def options(self) -> dict[str, Any]:
    if self.directory is None:
      return {}
    return {"xla_dump_to": self.directory, "xla_dump_hlo_as_text": True}

  def breakdown(self, args: breakdown_lib.Arguments, trial: Any) -> breakdown_lib.Breakdown | None:
    """The breakdown of the program the compile dumped, checked against the trial's own
    figure (the error's, or memory_analysis()'s); None where nothing was dumped. Never
    raises: a dump it cannot read gives a partial breakdown with a note, or None."""
    if self.directory is None:
      return None
    t0 = time.perf_counter()
    try:
      dump = buffer_dump.read(self.directory)
      if dump is None:
        return None
      figure, name = figure_of(trial)
      memory = getattr(trial, "memory", None) or {}
      rec = getattr(trial, "record", None)
      scoped = (rec.breakdown or {}).get("scoped") if rec is not None else None
      out = breakdown_lib.compute(dump, args, figure=figure, figure_name=name,
                                  code_bytes=memory.get("generated_code"), scoped_bytes=scoped)
      return dataclasses.replace(out, seconds=time.perf_counter() - t0)
    except Exception as e:  # pylint: disable=broad-except  (a breakdown never fails a fit)
      logging.warning("hbm_guard: the memory breakdown could not be read (%s: %s)",
                      type(e).__name__, e)
      return None


def compile_again(compile_fn: Callable[[dict], Any], options: dict[str, Any]) -> bool:
  """Compiles once more with a dump's options, for the breakdown only: True, whatever
  happened (an out-of-memory has dumped its program before it failed)."""
  try:
    compile_fn(options)
  except Exception:  # pylint: disable=broad-except
    pass
  return True


def figure_of(trial: Any) -> tuple[int | None, str | None]:
  """The compiler's own figure for a trial's program, and what it is."""
  rec = getattr(trial, "record", None)
  if rec is not None and rec.required_bytes:
    if rec.kind == record_lib.COMPILE_HBM_EARLY:
      return rec.required_bytes, _EARLY
    if rec.kind == record_lib.BUDGET:
      return rec.required_bytes, "memory_analysis()"
    return rec.required_bytes, "the compiler's out-of-memory error"
  memory = getattr(trial, "memory", None) or {}
  if memory.get("peak"):
    return memory["peak"], "memory_analysis()"
  return None, None


@contextlib.contextmanager
def scope(enabled: bool) -> Iterator[Scope]:
  """A dump directory for one compile (none where not `enabled`), removed on the way out."""
  directory = tempfile.mkdtemp(prefix="hbm_guard-dump-") if enabled else None
  try:
    yield Scope(directory)
  finally:
    if directory is not None:
      shutil.rmtree(directory, ignore_errors=True)


def arguments(fun: Callable, state_argnums, microbatches: int, devices: int
              ) -> breakdown_lib.Arguments:
  """How a step's entry parameters are named: its state arguments' names (from its
  signature), the plan's count and the chips."""
  try:
    names = list(inspect.signature(fun).parameters)
  except (TypeError, ValueError):
    names = []
  state = tuple(names[i] for i in state_argnums if isinstance(i, int) and 0 <= i < len(names))
  return breakdown_lib.Arguments(state, tuple(state_argnums), max(1, microbatches),
                                 max(1, devices))
