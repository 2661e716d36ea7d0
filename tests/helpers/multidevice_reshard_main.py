"""Run in a subprocess with 4 forced CPU devices: local FSDP resharding under capacity=.

Prints one JSON line with what the test checks.
"""

import json
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import hbm_guard  # noqa: E402
from hbm_guard._src.backends import compile as guard  # noqa: E402


def step(w, x):
  g = jax.grad(lambda w: jnp.tanh(x @ w).mean())(w)
  return w - 0.1 * g, g.mean()


def main():
  w, x = jnp.full((1024, 1024), 0.01, jnp.float32), jnp.ones((8, 1024))
  plain = guard.memory_of(jax.jit(step).lower(w, x).compile())
  want_w, want_loss = jax.jit(step)(w, x)
  capacity = plain["peak"] // 2  # a replicated 4 MiB state (in and out) cannot fit
  g = hbm_guard.guarded_jit(step, state_argnums=0, capacity=capacity,
                            report_dir=os.environ.get("HG_REPORT_DIR", "/tmp/hg"))
  w1, _ = g(jnp.array(w), x)
  w1_host, w1_spec = np.asarray(w1), str(w1.sharding.spec)  # w1 is donated next
  w2, _ = g(w1, x)  # the returned state is already in the planned layout
  ref2, _ = jax.jit(step)(want_w, x)
  print(json.dumps({
      "devices": jax.device_count(),
      "plan": g.plan.to_dict(),
      "attempts": [a.outcome for a in g.attempts],
      "plain_argument": plain["argument"],
      "final_argument": g.attempts[-1].memory["argument"],
      "final_peak": g.attempts[-1].memory["peak"],
      "capacity": capacity,
      "w_spec": w1_spec,
      "same_1": bool(np.allclose(w1_host, want_w, rtol=1e-6)),
      "same_2": bool(np.allclose(w2, ref2, rtol=1e-6)),
  }))


if __name__ == "__main__":
  main()
