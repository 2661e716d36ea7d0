"""Run in a subprocess with 4 forced CPU devices: resharding shards the batch too (#22).

An unmodified lm1b-shaped step (a loss closing over the batch, token-weighted) under a
capacity that a replicated state cannot meet. Prints one JSON line with what the test checks.
"""

import json
import os
import re

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import hbm_guard  # noqa: E402
from hbm_guard._src.backends import compile as compile_lib  # noqa: E402
from hbm_guard._src.backends import options as options_lib  # noqa: E402
from hbm_guard._src.backends import steps as steps_lib  # noqa: E402
from tests.dropin import test_drop_in as drop_in  # noqa: E402


def _dot_rows(hlo: str) -> int:
  """The most rows any matmul of a compiled program has (XLA:CPU counts flops of the whole
  program, not per device: the per-device program's shapes say what each device does)."""
  rows = [int(m.group(1)) for m in re.finditer(r"= f32\[(\d+),\d+\]\{[^}]*\} dot\(", hlo)]
  return max(rows)


def main():
  tokens = drop_in._tokens(batch=32, seq=64)  # pylint: disable=protected-access
  state = drop_in._linen_state(tokens, width=64, tx=optax.sgd(0.5))  # pylint: disable=protected-access
  batch = {"inputs": tokens}
  step = drop_in.lm1b_train_step
  replicated = compile_lib.memory_of(jax.jit(step, donate_argnums=0).lower(state, batch).compile())
  capacity = int(replicated["peak"] * 0.6)
  g = hbm_guard.guarded_jit(step, state_argnums=0, capacity=capacity, max_class="numerics",
                            plan_cache=False,
                            report_dir=os.environ.get("HG_REPORT_DIR", "/tmp/hg"))
  ref = jax.tree.map(jnp.copy, state)
  got, losses = state, []
  for _ in range(3):
    got, m = g(got, batch)
    ref, r = jax.jit(step)(ref, batch)
    losses.append((float(m["loss"]), float(r["loss"])))
  plan = g.plan
  # The chosen plan's program against the same plan with the batch left replicated.
  builder = steps_lib.StepBuilder(step, options_lib.make(state_argnums=0))
  builder.learn_state((state, batch), {})
  layout = builder.layout(plan, (state, batch), jax.devices())
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("fsdp",))
  kept = {**layout, 1: jax.tree.map(lambda _: NamedSharding(mesh, P()), batch)}
  sharded = builder.jit(plan, layout, 2).lower(state, batch).compile().as_text()
  whole = builder.jit(plan, kept, 2).lower(state, batch).compile().as_text()
  rel = max(float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))
            for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(ref.params)))
  print(json.dumps({
      "devices": jax.device_count(), "plan": plan.to_dict(),
      "compiles": len(g.attempts), "batch_spec": str(layout[1]["inputs"].spec),
      "dot_rows_sharded": _dot_rows(sharded), "dot_rows_replicated": _dot_rows(whole),
      "losses": losses, "param_rel": rel,
      "final_peak": g.attempts[-1].memory["peak"], "capacity": capacity,
  }))


if __name__ == "__main__":
  main()
