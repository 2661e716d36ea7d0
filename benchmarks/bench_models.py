"""Steps the project was not written against, fitted as a user would (issue #17, stop 33).

    .venv/bin/python -m benchmarks.bench_models [--model lstm|t5|vit|cnn|scan|all]

Each is an ordinary Flax step, unmodified, guarded with `target="v5e:1x1"` at a capacity
its plain step does not fit, and fitted with abstract arguments (`.fit`). Prints the plan,
compiles, probes, the fit's seconds and one compile of the plan found (the fit's last).
Before stop 33 each of these said "no plan fits" or went to every XLA flag; before stop 34
`scan` (layers under `nn.scan`, a final LayerNorm) read its layers as the LayerNorm's two
reads and needed offload. A benchmark, not a test: minutes each on 2 cores.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax.training import train_state

import hbm_guard


def _ce_step(state, batch):
  """Integer-label cross-entropy: `jnp.take_along_axis` traces otherwise at one example."""
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


class _LSTM(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(1000, 256)(tokens)
    x = nn.RNN(nn.OptimizedLSTMCell(512))(x)
    return nn.Dense(1000)(nn.RNN(nn.OptimizedLSTMCell(512))(x))


class _Enc(nn.Module):
  @nn.compact
  def __call__(self, x, mask):
    y = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(8)(y, y, mask=mask)
    return x + nn.Dense(512)(nn.relu(nn.Dense(2048)(nn.LayerNorm()(x))))


class _Dec(nn.Module):
  @nn.compact
  def __call__(self, y, enc, self_mask, cross_mask):
    z = nn.LayerNorm()(y)
    y = y + nn.MultiHeadDotProductAttention(8)(z, z, mask=self_mask)
    z = nn.LayerNorm()(y)
    y = y + nn.MultiHeadDotProductAttention(8)(z, enc, mask=cross_mask)
    return y + nn.Dense(512)(nn.relu(nn.Dense(2048)(nn.LayerNorm()(y))))


class _T5(nn.Module):
  @nn.compact
  def __call__(self, src, tgt):
    embed = nn.Embed(8000, 512)
    x = embed(src)
    for _ in range(4):
      x = _Enc()(x, nn.make_attention_mask(src > 0, src > 0))
    self_mask = nn.combine_masks(nn.make_attention_mask(tgt > 0, tgt > 0),
                                 nn.make_causal_mask(tgt))
    y = embed(tgt)
    for _ in range(4):
      y = _Dec()(y, x, self_mask, nn.make_attention_mask(tgt > 0, src > 0))
    return embed.attend(nn.LayerNorm()(y))


def _t5_step(state, batch):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["src"], batch["tgt_in"])
    labels = optax.smooth_labels(jax.nn.one_hot(batch["tgt_out"], 8000), 0.1)
    w = (batch["tgt_out"] > 0).astype(jnp.float32)
    return (optax.softmax_cross_entropy(logits, labels) * w).sum() / w.sum()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


class _ViTBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(8, dtype=jnp.bfloat16)(y, y)
    y = nn.Dense(2048, dtype=jnp.bfloat16)(nn.LayerNorm()(x))
    return x + nn.Dense(512, dtype=jnp.bfloat16)(nn.gelu(y))


class _ViT(nn.Module):
  @nn.compact
  def __call__(self, img):
    x = nn.Conv(512, (16, 16), strides=(16, 16))(img)
    x = x.reshape(x.shape[0], -1, 512)
    for _ in range(8):
      x = _ViTBlock()(x)
    return nn.Dense(1000)(nn.LayerNorm()(x.mean(1)))


class _CNNBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    y = nn.relu(nn.GroupNorm(num_groups=8)(nn.Conv(128, (3, 3))(x)))
    return x + nn.Conv(128, (3, 3))(y)


class _CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Conv(128, (3, 3))(x)
    for _ in range(8):
      x = _CNNBlock()(x)
    return nn.Dense(10)(x.mean((1, 2)))


class _ScanBlock(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    y = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(8)(y, y)
    return x + nn.Dense(512)(nn.gelu(nn.Dense(2048)(nn.LayerNorm()(x)))), None


class _ScanLM(nn.Module):
  """MaxText-style: the layers stacked under `nn.scan`."""
  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(16000, 512)
    x, _ = nn.scan(_ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                   length=8)()(embed(tokens), None)
    return embed.attend(nn.LayerNorm()(x))


def _spec(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def _state(model, *example):
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), *example))["params"]
  return jax.eval_shape(lambda: train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adamw(1e-3)))


def models():
  """name -> (step, state, batch, capacity): abstract, sized to overflow one v5e chip's
  budget given here."""
  tokens = _spec((64, 256), jnp.int32)
  return {
      "lstm": lambda: (_ce_step, _state(_LSTM(), jnp.zeros((1, 256), jnp.int32)),
                       {"x": tokens, "y": tokens}, "700MiB"),
      "t5": lambda: (_t5_step, _state(_T5(), *[jnp.ones((1, 8), jnp.int32)] * 2),
                     {"src": tokens, "tgt_in": tokens, "tgt_out": tokens}, "2GiB"),
      "vit": lambda: (_ce_step, _state(_ViT(), jnp.zeros((1, 224, 224, 3))),
                      {"x": _spec((64, 224, 224, 3)), "y": _spec((64,), jnp.int32)}, "1GiB"),
      "cnn": lambda: (_ce_step, _state(_CNN(), jnp.zeros((1, 64, 64, 3))),
                      {"x": _spec((64, 64, 64, 3)), "y": _spec((64,), jnp.int32)}, "1GiB"),
      "scan": lambda: (_ce_step, _state(_ScanLM(), jnp.zeros((1, 8), jnp.int32)),
                       {"x": _spec((32, 512), jnp.int32), "y": _spec((32, 512), jnp.int32)},
                       "1GiB"),
  }


def run(name: str) -> dict:
  step_fn, state, batch, capacity = models()[name]()
  step = hbm_guard.guarded_jit(step_fn, state_argnums=0, target="v5e:1x1", capacity=capacity,
                               max_class="numerics", plan_cache=False, progress=False)
  t0 = time.perf_counter()
  try:
    plan = step.fit(state, batch).describe()
  except hbm_guard.LadderExhaustedError:
    plan = "no plan fits"
  fit_s = time.perf_counter() - t0
  probes = [p for a in step.attempts if a.planning for p in a.planning.probes]
  last = step.attempts[-1]
  return {"model": name, "capacity": capacity, "plan": plan, "compiles": len(step.attempts),
          "probes": sum(not p.compiled for p in probes), "fit_s": fit_s,
          "last_s": last.seconds, "split": "not split" not in (last.auto or "not split"),
          "layers": (last.auto or "").partition("layers: ")[2] or "none"}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--model", default="all", choices=["all", *models()])
  args = parser.parse_args()
  hbm_guard.quiet_libtpu_on_cpu_host()
  print("| model | capacity | plan | compiles | probes | fit s | its compile s | split | "
        "layers |")
  print("|---|---|---|---|---|---|---|---|---|")
  for name in models() if args.model == "all" else [args.model]:
    r = run(name)
    print(f"| {r['model']} | {r['capacity']} | {r['plan']} | {r['compiles']} | {r['probes']} | "
          f"{r['fit_s']:.0f} | {r['last_s']:.0f} | {r['split']} | {r['layers']} |", flush=True)


if __name__ == "__main__":
  main()
