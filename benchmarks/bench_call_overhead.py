"""Per-call time of a guarded step divided by jax.jit's, interleaved in one process.

    python benchmarks/bench_call_overhead.py [--calls N] [--rounds R]

Prints the median per-call microseconds of each and their ratio, for a tiny step (where
any Python overhead shows most), a small MLP train step, and a train step whose state has
400 arrays after a trailing batch was fitted to another plan (its signatures then live on
two jit objects, and each call is dispatched on its own: every leaf's shape and dtype).
"""

import argparse
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

import hbm_guard


def tiny(x, y):
  return (x @ y).sum()


def mlp_step(w, x):
  g = jax.grad(lambda w: jnp.tanh(x @ w).mean())(w)
  return w - 0.1 * g


def wide_step(state, x):
  """4 layers and 396 small arrays besides: a state of 400 leaves."""
  def loss(state):
    h = x
    for w in state["layers"]:
      h = jnp.tanh(h @ w)
    return (h ** 2).mean() + 1e-3 * sum((b ** 2).sum() for b in state["small"])
  g = jax.grad(loss)(state)
  return jax.tree.map(lambda p, q: p - 0.1 * q, state, g)


def _two_plans():
  """wide_step guarded at a capacity its batch of 4096 fits with microbatch(4), after a
  trailing batch of 4095 was fitted (microbatch(5)): the args of a 4096 call."""
  state = {"layers": [jnp.full((128, 128), 0.01, jnp.float32) for _ in range(4)],
           "small": [jnp.zeros((8,)) for _ in range(396)]}
  guarded = hbm_guard.guarded_jit(wide_step, state_argnums=0, capacity="10MiB",
                                  ladder=[{"name": "microbatch", "kind": "microbatch",
                                           "class": "numerics"}],  # no donation: args reused
                                  max_class="numerics", plan_cache=False, progress=False,
                                  report_dir=tempfile.mkdtemp())
  x = jnp.ones((4096, 128))
  state = guarded(guarded(state, x), x[:-1])  # the state as the step returns it
  return guarded, (state, x)


def per_call_us(fn, args, calls):
  t0 = time.perf_counter()
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - t0) / calls * 1e6


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--calls", type=int, default=2000)
  p.add_argument("--rounds", type=int, default=15)
  a = p.parse_args()
  cases = {
      "tiny 64x64 matmul": (tiny, (jnp.ones((64, 64)), jnp.ones((64, 64)))),
      "mlp grad step 256": (mlp_step, (jnp.ones((256, 256)), jnp.ones((128, 256)))),
  }
  print(f"jax {jax.__version__}, backend {jax.default_backend()}, {a.rounds} rounds x "
        f"{a.calls} calls, interleaved")
  two_plans, wide_args = _two_plans()
  cases["400 leaves, 2 plans"] = (wide_step, wide_args)
  for name, (f, args) in cases.items():
    plain, guarded = jax.jit(f), hbm_guard.guarded_jit(f)
    if f is wide_step:  # against the very jit object the guard dispatches to (microbatch(4))
      guarded = two_plans
      key = guarded._step.key(args, {})  # pylint: disable=protected-access
      plain = guarded._by_signature[key].jitted  # pylint: disable=protected-access
    jax.block_until_ready(plain(*args))
    jax.block_until_ready(guarded(*args))
    pt, gt = [], []
    for _ in range(a.rounds):
      pt.append(per_call_us(plain, args, a.calls))
      gt.append(per_call_us(guarded, args, a.calls))
    p_med, g_med = statistics.median(pt), statistics.median(gt)
    print(f"{name:<20} jax.jit {p_med:8.2f} us  guarded_jit {g_med:8.2f} us  "
          f"ratio {g_med / p_med:.3f}  (+{g_med - p_med:.2f} us/call)")


if __name__ == "__main__":
  main()
