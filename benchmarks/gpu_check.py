"""The GPU check of issue #11, as one short script for a machine with an NVIDIA GPU.

    python -m benchmarks.gpu_check [--batch 64] [--steps 10]

A GPT-style Flax step whose batch does not fit the GPU (sized for an H200, ~139 GiB):
1. plain `jax.jit` fails with the real out-of-memory, which hbm_guard parses;
2. `guarded_jit` (capacity from the device) fits it, and trains `--steps` steps;
3. the losses equal a reference that accumulates over the same microbatches.
Prints one JSON line of figures. Not run in CI: it needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

import hbm_guard
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard.integrations import flax as hg_flax


class Block(nn.Module):
  width: int
  heads: int = 16

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    h = nn.SelfAttention(num_heads=self.heads, deterministic=True)(h, mask=nn.make_causal_mask(
        jnp.ones(x.shape[:2])))
    x = x + h
    h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
    return x + nn.Dense(self.width)(nn.gelu(h))


class GPT(nn.Module):
  vocab: int
  width: int
  depth: int

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, self.width)(tokens)
    for _ in range(self.depth):
      x = hg_flax.remat(Block)(self.width)(x)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x))


def loss_fn(params, batch, apply_fn):
  logits = apply_fn({"params": params}, batch["inputs"])
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  return jnp.sum(losses * batch["weights"]), jnp.sum(batch["weights"])


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--seq", type=int, default=2048)
  parser.add_argument("--width", type=int, default=2048)
  parser.add_argument("--depth", type=int, default=8)
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--steps", type=int, default=10)
  args = parser.parse_args()
  assert jax.default_backend() == "gpu", "this check needs a GPU"
  model = GPT(args.vocab, args.width, args.depth)
  params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, args.seq), jnp.int32))["params"]
  tx = optax.sgd(1e-3)
  make = lambda: train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)  # noqa: E731

  def batch(i):
    k = jax.random.key(100 + i)
    tokens = jax.random.randint(k, (args.batch, args.seq + 1), 0, args.vocab)
    w = (jnp.arange(args.seq)[None] < args.seq - (jnp.arange(args.batch)[:, None] % 97))
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "weights": w.astype(jnp.float32)}

  def step(state, b):
    (value, _), grads = hbm_guard.value_and_grad(
        lambda p, b: (loss_fn(p, b, state.apply_fn), None), batch_argnums=1, has_aux=True,
        weighted=True)(state.params, b)
    return state.apply_gradients(grads=grads), value

  out = {"device": jax.devices()[0].device_kind,
         "bytes_limit": jax.devices()[0].memory_stats().get("bytes_limit")}
  try:  # 1. the plain step
    jax.jit(step, donate_argnums=0)(make(), batch(0))[1].block_until_ready()
    out["plain"] = "fits (raise --batch until it does not)"
  except jax.errors.JaxRuntimeError as e:
    rec = hbm_guard.parse(e)
    out["plain"] = {"error": str(e).splitlines()[0][:300], "record_kind": rec and rec.kind}
  t0 = time.perf_counter()  # 2. the guarded step
  guarded = hbm_guard.guarded_jit(step, state_argnums=0, max_class="numerics", plan_cache=False)
  state, losses = make(), []
  for i in range(args.steps):
    state, value = guarded(state, batch(i))
    losses.append(float(value))
  out.update(plan=guarded.plan.describe(), compiles=len(guarded.attempts),
             attempts=[[a.plan.describe(), a.outcome] for a in guarded.attempts],
             seconds=round(time.perf_counter() - t0, 1), losses=losses)
  with plan_lib.plan_scope(guarded.plan):  # 3. the reference: the same accumulation
    ref_step = jax.jit(lambda *a: step(*a), donate_argnums=0)
    state, ref = make(), []
    for i in range(args.steps):
      state, value = ref_step(state, batch(i))
      ref.append(float(value))
  out["reference_losses"] = ref
  out["max_rel_diff"] = float(np.max(np.abs(np.array(losses) - ref) / np.abs(ref)))
  print(json.dumps(out))


if __name__ == "__main__":
  main()
