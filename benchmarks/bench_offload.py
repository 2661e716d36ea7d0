"""Device peak of optimizer-state offload on v5e, by libtpu's own figures.

    python benchmarks/bench_offload.py

For each model and optimizer: the step with its optimizer state on the device, offloaded
and brought in whole (`load_offloaded`), and offloaded and streamed in parts
(`offload_aware`). Prints the compiler's peak, the host-resident state, how the state was
streamed and the seconds each compile took. Compiles only; needs libtpu, no TPU.
"""

import time

import jax
import jax.numpy as jnp
import optax

import hbm_guard

MiB = 2**20


def layers_step(tx, how):
  def loss(params, x):
    for w in params:
      x = jnp.tanh(x @ w)
    return (x ** 2).mean()

  def step(state, x):
    value, g = hbm_guard.value_and_grad(loss, batch_argnums=1)(state["params"], x)
    if how == "whole":
      updates, opt = tx.update(g, hbm_guard.load_offloaded(state["opt_state"]), state["params"])
      opt = hbm_guard.store_offloaded(opt)
    else:
      updates, opt = hbm_guard.offload_aware(tx).update(g, state["opt_state"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt}, value
  return step


CASES = {
    "8 x 512x512, adam": (lambda: [jnp.full((512, 512), 0.01) for _ in range(8)],
                          lambda: optax.adam(1e-3)),
    "4 x 1024x1024, adamw": (lambda: [jnp.full((1024, 1024), 0.01) for _ in range(4)],
                             lambda: optax.adamw(1e-3)),
    "64 x 256x256, sgd momentum": (lambda: [jnp.full((256, 256), 0.01) for _ in range(64)],
                                   lambda: optax.sgd(0.1, momentum=0.9)),
    "8 x 512x512, clip + adam": (lambda: [jnp.full((512, 512), 0.01) for _ in range(8)],
                                 lambda: optax.chain(optax.clip_by_global_norm(1.0),
                                                     optax.adam(1e-3))),
}


def measure(step, state, x, plan):
  g = hbm_guard.guarded_jit(step, state_argnums=0, target="v5e:1x1", capacity="1GiB",
                            plan=plan, auto_fallback=False, max_class="numerics")
  t0 = time.perf_counter()
  g.fit(state, x)
  last = g.attempts[-1]
  return last.memory, last.optimizer_streaming, time.perf_counter() - t0


def main():
  hbm_guard.quiet_libtpu_on_cpu_host()
  kept = hbm_guard.Plan(donate_argnums=(0,), microbatches=4)
  offloaded = kept.added("offload_optimizer", offload_optimizer=True)
  print(f"{'case':28} {'on device':>10} {'whole':>10} {'streamed':>10} {'host':>8}  how"
        "        compile s")
  for name, (make_params, make_tx) in CASES.items():
    params, tx = make_params(), make_tx()
    state = {"params": params, "opt_state": tx.init(params)}
    x = jnp.ones((1024, params[0].shape[0]))
    on_device, _, s0 = measure(layers_step(tx, "streamed"), state, x, kept)
    whole, _, s1 = measure(layers_step(tx, "whole"), state, x, offloaded)
    streamed, how, s2 = measure(layers_step(tx, "streamed"), state, x, offloaded)
    print(f"{name:28} {on_device['peak'] / MiB:8.1f}Mi {whole['peak'] / MiB:8.1f}Mi "
          f"{streamed['peak'] / MiB:8.1f}Mi {streamed['host_argument'] / MiB:6.1f}Mi  "
          f"{how:10} {s0:.1f}/{s1:.1f}/{s2:.1f}")


if __name__ == "__main__":
  main()
