"""One compile of the step under one plan, as a typed result with the compiler's figures.

The guard hands `try_compile` a thunk that lowers and compiles; this module times it,
keeps a heartbeat in the log while it runs, turns the compiler's out-of-memory (or a
`memory_analysis()` above the capacity) into a record, and lets every other error through.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import threading
import time
from typing import Any, Callable, Iterator

import jax
from absl import logging

from hbm_guard._src.backends import step_time
from hbm_guard._src.memory import breakdown as breakdown_lib
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.record import errors
from hbm_guard._src.record import record as record_lib

HEARTBEAT_SECONDS = 15.0


class Outcome(enum.StrEnum):
  FITS = "fits"
  OOM = "oom"
  UNEVEN = "uneven"  # the plan's microbatch count does not divide this batch: not compiled
  UNSPLIT = "unsplit"  # a probe whose trace could not split the batch at its count: not compiled


@dataclasses.dataclass(frozen=True)
class TraceFacts:
  """What tracing the step under a plan told the guard."""
  reads: frozenset[str] = frozenset()  # plan fields the step read ("*": all)
  replaced: tuple[tuple[int, Any], ...] = ()  # (argnum, output index) it returns anew
  n_outputs: int | None = None
  batch_size: int | None = None
  loss_form: str | None = None  # how value_and_grad reduced the loss
  optimizer_streaming: str | None = None  # how offload_aware brought the state in
  auto: str | None = None  # what the drop-in analysis did with the step's gradient
  auto_refused: str | None = None  # why it did not split the batch


class Unsplit(Exception):
  """Raised by a probe's thunk once its trace says the batch did not split at the plan's
  microbatch count: compiling it would measure the whole batch (at 368M, a failing compile)."""


def check_split(plan: plan_lib.Plan, facts: TraceFacts | None) -> None:
  """Raises `Unsplit` where `plan` splits the batch and its trace could not (a microbatch
  of one example, where `jnp.take_along_axis` traces otherwise: optax's integer-label
  cross-entropy). A probe calls it between lowering and compiling."""
  if plan.microbatches > 1 and facts is not None and facts.auto_refused:
    raise Unsplit(facts.auto_refused)


@dataclasses.dataclass(frozen=True)
class Trial:
  """The result of compiling under one plan."""
  plan: plan_lib.Plan
  outcome: Outcome
  seconds: float
  facts: TraceFacts | None = None
  record: record_lib.E1000Record | None = None
  memory: dict[str, int] | None = None
  error: BaseException | None = None  # the compiler's own error, to chain or re-raise
  uneven: errors.UnevenMicrobatchError | None = None
  layout: tuple[str, ...] = ()  # where the compile put the batch and the largest state
  estimate: step_time.Estimate | None = None  # a target's step time, from the program
  breakdown: breakdown_lib.Breakdown | None = None  # where the program's memory goes


def memory_of(compiled) -> dict[str, int] | None:
  """The compiler's own figures for a compiled step, with the peak they add up to."""
  try:
    ma = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  (not every backend implements it)
    return None
  if ma is None:
    return None
  m = {k: int(getattr(ma, k + "_size_in_bytes", 0) or 0)
       for k in ("argument", "output", "alias", "temp", "generated_code")}
  m["peak"] = m["argument"] + m["output"] - m["alias"] + m["temp"] + m["generated_code"]
  for k in ("argument", "output", "temp"):  # host memory (offloaded), not in the peak
    m["host_" + k] = int(getattr(ma, f"host_{k}_size_in_bytes", 0) or 0)
  return m


def budget_record(memory: dict[str, int], capacity: int, module: str) -> record_lib.E1000Record:
  """A memory_analysis() above the capacity, as a record the ladder reads like E1000's."""
  return record_lib.E1000Record(
      kind=record_lib.BUDGET, memory_space="hbm", used_bytes=memory["peak"],
      capacity_bytes=capacity, exceeded_bytes=memory["peak"] - capacity,
      temp_bytes=memory["temp"], hlo_module=module,
      breakdown={"arguments": memory["argument"], "output": memory["output"],
                 "output aliased": memory["alias"], "HLO temp": memory["temp"],
                 "code": memory["generated_code"]},
      raw=(f"hbm_guard: peak {memory['peak']} bytes (arguments + outputs - aliased + "
           f"temporaries + code) exceeds capacity {capacity} bytes"))


@contextlib.contextmanager
def heartbeat(name: str, plan: plan_lib.Plan) -> Iterator[None]:
  """Logs a line every HEARTBEAT_SECONDS while a compile runs: long compiles are not hangs."""
  done = threading.Event()
  t0 = time.perf_counter()

  def beat():
    while not done.wait(HEARTBEAT_SECONDS):
      logging.info("hbm_guard: %s still compiling under %s (%.0f s)", name, plan.describe(),
                   time.perf_counter() - t0)

  thread = threading.Thread(target=beat, name="hbm_guard-heartbeat", daemon=True)
  thread.start()
  try:
    yield
  finally:
    done.set()


def try_compile(plan: plan_lib.Plan, compile_fn: Callable[[], Any],
                facts_fn: Callable[[], TraceFacts | None], *,
                capacity: int | Callable[[], int | None] | None, name: str,
                speed: step_time.DeviceSpeed | None = None) -> Trial:
  """Runs `compile_fn` (lower + compile under `plan`) and classifies what happened.

  An out-of-memory at compile time, or a peak above `capacity` (a callable: asked once
  the compile is done), is an OOM trial; an error that is not an out-of-memory propagates
  unchanged. Given the chip's `speed` (a target's), a compile that fits carries its step
  time estimated from the program (`step_time`).
  """
  t0 = time.perf_counter()
  try:
    with heartbeat(name, plan):
      compiled = compile_fn()
  except errors.UnevenMicrobatchError as e:
    return Trial(plan, Outcome.UNEVEN, time.perf_counter() - t0, facts_fn(), uneven=e)
  except Unsplit:
    return Trial(plan, Outcome.UNSPLIT, time.perf_counter() - t0, facts_fn())
  except jax.errors.JaxRuntimeError as e:
    rec = record_lib.parse(e)
    if rec is None or not rec.is_compile_time:
      raise
    return Trial(plan, Outcome.OOM, time.perf_counter() - t0, facts_fn(), rec, error=e)
  seconds = time.perf_counter() - t0
  memory = memory_of(compiled)
  if callable(capacity):
    capacity = capacity()
  if memory is not None and capacity is not None and memory["peak"] > capacity:
    rec = budget_record(memory, capacity, f"jit_{name}")
    return Trial(plan, Outcome.OOM, seconds, facts_fn(), rec, memory)
  return Trial(plan, Outcome.FITS, seconds, facts_fn(), memory=memory,
               estimate=step_time.of_compiled(compiled, speed))
