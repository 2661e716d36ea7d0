"""Run in a subprocess with 4 forced CPU devices: a step with the user's own FSDP shardings
over a local 2x2 mesh (#21). Prints one JSON line with what the test checks."""

import json
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import hbm_guard  # noqa: E402
from hbm_guard._src import compile as compile_lib  # noqa: E402
from tests import test_own_shardings as own  # noqa: E402


def main():
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "fsdp"))
  state_s, batch_s = own.fsdp_shardings(mesh)
  state, batch = own.arrays()
  report_dir = os.environ.get("HG_REPORT_DIR", "/tmp/hg")
  # 1. compiled for v5e:2x2 with the mesh over the 4 local devices, mapped by position
  target = hbm_guard.guarded_jit(own.step, state_argnums=0, target="v5e:2x2",
                                 capacity=own.CAPACITY, in_shardings=(state_s, batch_s),
                                 out_shardings=(state_s, None), report_dir=report_dir)
  target_plan = target.fit(*own.abstract(state_s, batch_s))
  # 2. run here, under capacity=, from the user's own placement
  placed = jax.device_put((state, batch), (state_s, batch_s))
  plain = compile_lib.memory_of(jax.jit(own.step, in_shardings=(state_s, batch_s),
                                        out_shardings=(state_s, None)).lower(*placed).compile())
  local = hbm_guard.guarded_jit(own.step, state_argnums=0, capacity=plain["peak"] * 2 // 3,
                                in_shardings=(state_s, batch_s), out_shardings=(state_s, None),
                                report_dir=report_dir)
  ref = jax.jit(own.step)(state, batch)
  got = local(jax.tree.map(jnp.copy, placed[0]), placed[1])
  print(json.dumps({
      "target_plan": target_plan.to_dict(), "target_compiles": len(target.attempts),
      "target_peak": target.attempts[-1].memory["peak"],
      "local_plan": local.plan.to_dict(), "local_compiles": len(local.attempts),
      "local_peak": local.attempts[-1].memory["peak"], "local_capacity": plain["peak"] * 2 // 3,
      "w1_spec": str(got[0]["w1"].sharding.spec),
      "same": bool(np.allclose(np.asarray(got[0]["w1"]), np.asarray(ref[0]["w1"]), rtol=1e-5,
                               atol=1e-6) and np.allclose(got[1], ref[1], rtol=1e-5)),
  }))


if __name__ == "__main__":
  main()
