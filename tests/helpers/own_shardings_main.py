"""Run in a subprocess with 4 forced CPU devices: a step with the user's own FSDP shardings
over a local 2x2 mesh (#21). Prints one JSON line with what the test checks."""

import json
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import hbm_guard  # noqa: E402
from hbm_guard._src.backends import compile as compile_lib  # noqa: E402
from tests.plans import test_own_shardings as own  # noqa: E402


def explicit_step(state, batch):
  """The same step in jax's explicit-sharding style: FSDP gathers each weight itself."""
  def loss(p):
    w1, w2 = jax.sharding.reshard(p["w1"], P()), jax.sharding.reshard(p["w2"], P())
    return ((jnp.tanh(batch @ w1) @ w2) ** 2).mean()
  value, grads = jax.value_and_grad(loss)(state)
  return jax.tree.map(lambda a, g: a - 0.1 * g, state, grads), value


def explicit(report_dir):
  """Under `jax.set_mesh` with Explicit axes: shardings carried by the arguments only."""
  mesh = jax.make_mesh((2, 2), ("data", "fsdp"), axis_types=(AxisType.Explicit,) * 2)
  state_s, batch_s = own.fsdp_shardings(mesh)
  with jax.set_mesh(mesh):
    target = hbm_guard.guarded_jit(explicit_step, state_argnums=0, target="v5e:2x2",
                                   capacity=own.CAPACITY, report_dir=report_dir)
    target.fit(*own.abstract(state_s, batch_s))
    state, batch = jax.device_put(own.arrays(), (state_s, batch_s))
    plain = compile_lib.memory_of(jax.jit(explicit_step).lower(state, batch).compile())
    # the step's own reshard gathers each weight whole on every device: donation is what
    # is left to take (96.5 -> 72.5 MiB here)
    capacity = plain["peak"] * 4 // 5
    local = hbm_guard.guarded_jit(explicit_step, state_argnums=0, capacity=capacity,
                                  report_dir=report_dir)
    ref = jax.jit(explicit_step)(state, batch)
    got = local(jax.tree.map(jnp.copy, state), batch)
    typed = hbm_guard.guarded_jit(own.step, state_argnums=0, target="v5e:2x2",
                                  capacity=own.CAPACITY, report_dir=report_dir)
    whole = jax.tree.map(lambda _: NamedSharding(mesh, P()), state_s)
    try:
      typed.fit(*own.abstract(whole, batch_s))
    except hbm_guard.LadderExhaustedError:
      pass
    refused = [s.reason for s in typed.attempts[0].skipped if s.rung == "reshard_fsdp"]
  return {"explicit_refused": refused[0] if refused else "",
          "explicit_target": [a.outcome for a in target.attempts],
          "explicit_target_peak": target.attempts[-1].memory["peak"],
          "explicit_local": [a.outcome for a in local.attempts],
          "explicit_local_peak": local.attempts[-1].memory["peak"],
          "explicit_local_capacity": capacity,
          "explicit_same": bool(np.allclose(np.asarray(got[0]["w1"]), np.asarray(ref[0]["w1"]),
                                            rtol=1e-5, atol=1e-6)
                                and np.allclose(got[1], ref[1], rtol=1e-5))}


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
      **explicit(report_dir),
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
