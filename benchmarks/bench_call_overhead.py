"""Per-call time of a guarded step divided by jax.jit's, interleaved in one process.

    python benchmarks/bench_call_overhead.py [--calls N] [--rounds R]

Prints the median per-call microseconds of each and their ratio, for a tiny step (where
any Python overhead shows most) and a small MLP train step.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import hbm_guard


def tiny(x, y):
  return (x @ y).sum()


def mlp_step(w, x):
  g = jax.grad(lambda w: jnp.tanh(x @ w).mean())(w)
  return w - 0.1 * g


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
  for name, (f, args) in cases.items():
    plain, guarded = jax.jit(f), hbm_guard.guarded_jit(f)
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
