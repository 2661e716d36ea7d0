"""One process of a two-process jax.distributed job on CPU (loopback), for test_multihost.

    python -m tests.helpers.multihost_main PROCESS_ID PORT CAPACITY_SCALE [SLOW_SECONDS]

Prints one JSON line: the plan this process ended on, its attempts, and the step's loss.
With SLOW_SECONDS, process 1's second compile is that many seconds slower, the fit has a time
budget of a third of it, and the line says how the fit ended instead.
"""

import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import hbm_guard  # noqa: E402
from hbm_guard._src.backends import compile as C  # noqa: E402
from hbm_guard._src.plans import plan as plan_lib  # noqa: E402


def step(w, x, y):
  loss, g = hbm_guard.value_and_grad(lambda w, x, y: jnp.mean((jnp.tanh(x @ w) - y) ** 2),
                                     batch_argnums=(1, 2))(w, x, y)
  return w - 0.1 * g, loss


def main():
  pid, port, which = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                             process_id=pid, initialization_timeout=60)
  w = jnp.full((256, 256), 0.01)
  x, y = jnp.ones((512, 256)), jnp.zeros((512, 256))
  peaks = {}
  for k in (1, 8):
    with plan_lib.plan_scope(hbm_guard.Plan(microbatches=k)):
      peaks[k] = C.memory_of(jax.jit(lambda *a: step(*a)).lower(w, x, y).compile())["peak"]
  # "roomy": the plain step fits; "tight": only a split step does.
  capacity = 2 * peaks[1] if which == "roomy" else (peaks[1] + peaks[8]) // 2
  if len(sys.argv) > 4:
    _budget_ends_the_fit_on_every_process(pid, capacity, float(sys.argv[4]), w, x, y)
    return
  guarded = hbm_guard.guarded_jit(step, capacity=capacity, max_class="numerics",
                                  plan_cache=False, report_dir=f"/tmp/hbm_guard_mh_{pid}")
  _, loss = guarded(w, x, y)
  print(json.dumps({"pid": pid, "plan": guarded.plan.to_dict(), "capacity": capacity,
                    "attempts": [[a.plan.describe(), a.outcome] for a in guarded.attempts],
                    "peak": guarded.attempts[-1].memory["peak"], "loss": float(loss)}),
        flush=True)
  jax.distributed.shutdown()


def _budget_ends_the_fit_on_every_process(pid, capacity, slow, w, x, y):
  from hbm_guard._src.backends import backend as backend_lib  # pylint: disable=g-import-not-at-top
  real, compiles, finished = backend_lib.LocalBackend.compile, [], []
  def compile_slowly_on_process_1(self, plan, *args, probe=False, **kwargs):
    if not probe:
      compiles.append(plan)
    if pid == 1 and not probe and len(compiles) == 2:
      time.sleep(slow)
      finished.append(plan.describe())
    return real(self, plan, *args, probe=probe, **kwargs)
  backend_lib.LocalBackend.compile = compile_slowly_on_process_1
  guarded = hbm_guard.guarded_jit(step, capacity=capacity, max_class="numerics",
                                  plan_cache=False, max_fit_seconds=slow / 3,
                                  report_dir=f"/tmp/hbm_guard_mh_{pid}")
  t0 = time.perf_counter()
  try:
    guarded(w, x, y)
    ended = "fit"
  except hbm_guard.FitTimeBudgetError:
    ended = "FitTimeBudgetError"
  print(json.dumps({"pid": pid, "ended": ended, "compiles": len(compiles),
                    "slow_compile_finished": bool(finished),
                    "seconds": time.perf_counter() - t0}), flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
