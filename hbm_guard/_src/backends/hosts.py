"""Many hosts, one plan: every process of a `jax.distributed` job climbs in step.

If processes chose plans apart, their programs would differ and the first collective
would hang. So agreement is by construction: process 0 chooses every plan (and when to
stop) and broadcasts it; after each compile the outcomes are gathered and the worst one
is every process's outcome. A plan is kept only when it fits on every process.
With one process each function is the identity.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.record import record as record_lib

_PLAN_BYTES = 8192


def _count() -> int:
  import jax  # pylint: disable=g-import-not-at-top
  return jax.process_count()


def agree_plan(plan: plan_lib.Plan | None) -> plan_lib.Plan | None:
  """Process 0's plan (or None: stop), on every process."""
  if _count() == 1:
    return plan
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  text = b"" if plan is None else json.dumps(plan.to_dict(), sort_keys=True).encode()
  if len(text) > _PLAN_BYTES - 4:
    raise ValueError("hbm_guard: plan too large to broadcast")
  buf = np.zeros(_PLAN_BYTES, np.uint8)
  buf[:4] = np.frombuffer(np.uint32(len(text)).tobytes(), np.uint8)
  buf[4:4 + len(text)] = np.frombuffer(text, np.uint8)
  got = np.asarray(multihost_utils.broadcast_one_to_all(buf))
  n = int(np.frombuffer(got[:4].tobytes(), np.uint32)[0])
  if n == 0:
    return None
  return plan_lib.Plan.from_dict(json.loads(got[4:4 + n].tobytes().decode()))


def agree_capacity(capacity: int | None) -> int | None:
  """The smallest capacity of any process: a plan must fit them all."""
  if _count() == 1 or capacity is None:
    return capacity
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  caps = np.asarray(multihost_utils.process_allgather(np.array([capacity], np.int64)))
  return int(caps.min())


def any_process(flag: bool) -> bool:
  """Whether `flag` holds on any process (each process asks at the same point)."""
  if _count() == 1:
    return flag
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  flags = np.asarray(multihost_utils.process_allgather(np.array([int(flag)], np.int32)))
  return bool(flags.any())


def agree_trial(trial: compile_lib.Trial) -> compile_lib.Trial:
  """The worst outcome over processes: fits only if it fits everywhere."""
  if _count() == 1 or trial.outcome is compile_lib.Outcome.UNEVEN:
    return trial
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  oom = trial.outcome is compile_lib.Outcome.OOM
  need = (trial.record.required_bytes if oom and trial.record else None) or 0
  have = (trial.record.available_bytes if oom and trial.record else None) or 0
  rows = np.asarray(multihost_utils.process_allgather(
      np.array([int(oom), need, have], np.int64))).reshape(-1, 3)
  if not rows[:, 0].any():
    return trial
  worst = int(np.argmax(np.where(rows[:, 0] == 1, rows[:, 1], -1)))
  if oom:
    return trial
  need, have = int(rows[worst, 1]), int(rows[worst, 2])
  rec = record_lib.E1000Record(
      kind=record_lib.BUDGET, memory_space="hbm", used_bytes=need or None,
      capacity_bytes=have or None, exceeded_bytes=(need - have) if need and have else None,
      raw=f"hbm_guard: fits here, but not on process {worst} (needs {need} of {have} bytes)")
  return dataclasses.replace(trial, outcome=compile_lib.Outcome.OOM, record=rec)
