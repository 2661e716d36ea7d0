"""Probes: what a plan needs, cheaply (libtpu's early figure, or a full compile's peak),
started side by side where the backend stages them."""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Sequence

from hbm_guard._src.backends import backend as backend_lib
from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.plans import plan as plan_lib

Backend = backend_lib.Backend


def refused(trial: compile_lib.Trial) -> str | None:
  """Why a microbatch plan's trace did not split a drop-in step's batch (None where it
  did, or where the plan does not split it)."""
  if trial.plan.microbatches > 1 and trial.facts is not None:
    return trial.facts.auto_refused
  return None


def figure(trial: compile_lib.Trial) -> int | None:
  """A probe's figure; None where it is not the plan's (a drop-in step whose batch this
  plan's trace could not split compiled the whole batch under a microbatch plan's name)."""
  if refused(trial):
    return None
  if trial.record is not None:
    return trial.record.required_bytes
  return (trial.memory or {}).get("peak")


def probe(backend: Backend, plan: plan_lib.Plan, key, args, kwargs, low_effort: bool = False
          ) -> tuple[int | None, str | None, Any]:
  """What `plan` needs, cheaply (libtpu's early figure, or a full compile's peak), why its
  trace did not split the batch where it did not, and where its memory goes."""
  trial = backend.compile(plan, key, args, kwargs, probe=True, low_effort=low_effort)
  return figure(trial), refused(trial), trial.breakdown


def start_probes(backend: Backend, plans: Sequence[plan_lib.Plan], key, args, kwargs,
                 low_effort: bool = False, pool: concurrent.futures.Executor | None = None
                 ) -> list[concurrent.futures.Future]:
  """Probes of `plans`, as futures of (figure, seconds, why not split, breakdown). Given a
  pool, and a backend that
  can stage them, each is lowered here and compiled in the pool: beside the others, and
  beside whatever this thread does next (two dear probes at 368M took the wall time of
  one, on 2 cores). Otherwise each runs here, now."""
  if pool is None or not backend.stages:
    out = []
    for plan in plans:
      done: concurrent.futures.Future = concurrent.futures.Future()
      t0 = time.perf_counter()
      need, why, broken = probe(backend, plan, key, args, kwargs, low_effort)
      done.set_result((need, time.perf_counter() - t0, why, broken))
      out.append(done)
    return out
  def run(ready):
    trial = ready()
    return figure(trial), trial.seconds, refused(trial), trial.breakdown
  return [pool.submit(run, backend.staged_probe(plan, key, args, kwargs, low_effort))
          for plan in plans]
