"""A small Flax transformer whose train step does not fit a TPU v5e budget, and recovers.

The step is compiled for the target with libtpu on this machine (no TPU needed), so the
E1000 is the real compiler's; once a plan fits, the same step trains here on the CPU.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import hbm_guard
from hbm_guard.integrations import flax as hg_flax


@dataclasses.dataclass(frozen=True)
class Config:
  width: int = 256
  depth: int = 4
  seq: int = 128
  batch: int = 64
  steps: int = 5
  learning_rate: float = 1e-3
  seed: int = 0


class Block(nn.Module):
  """A pre-norm transformer block: self-attention, then an MLP, each residual."""
  width: int
  heads: int = 4
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=self.dtype)(h, h)
    x = x + h
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.Dense(4 * self.width, dtype=self.dtype)(h)
    h = nn.gelu(h)
    h = nn.Dense(self.width, dtype=self.dtype)(h)
    return x + h


class Model(nn.Module):
  width: int
  depth: int

  @nn.compact
  def __call__(self, x):
    dtype = hbm_guard.compute_dtype(jnp.float32)  # the bf16 rung, if ever allowed
    for _ in range(self.depth):
      x = hg_flax.remat(Block)(self.width, dtype=dtype)(x)  # per-layer remat by plan
    return nn.Dense(self.width, dtype=dtype)(x).astype(jnp.float32)


def loss_fn(params, batch, apply_fn):
  pred = apply_fn({"params": params}, batch["x"])
  return jnp.mean((pred - batch["y"]) ** 2)


def make_state(cfg: Config, tx: optax.GradientTransformation | None = None
               ) -> train_state.TrainState:
  model = Model(cfg.width, cfg.depth)
  x = jnp.zeros((1, cfg.seq, cfg.width))
  params = model.init(jax.random.key(cfg.seed), x)["params"]
  return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                       tx=tx or optax.adam(cfg.learning_rate))


def make_batch(cfg: Config, step: int):
  kx, ky = jax.random.split(jax.random.key(1000 + step))
  return {"x": jax.random.normal(kx, (cfg.batch, cfg.seq, cfg.width)),
          "y": jax.random.normal(ky, (cfg.batch, cfg.seq, cfg.width))}


def train_and_evaluate(config, **guard_options):
  """Trains `config.steps` steps with a guarded step; returns (losses, the guarded step).

  `config` is the ml_collections config of `configs/default.py` (or a `Config`).
  """
  cfg = Config(**{f.name: config[f.name] for f in dataclasses.fields(Config)
                  if f.name in config}) if not isinstance(config, Config) else config
  return train(cfg, **guard_options)


def train(cfg: Config, **guard_options):
  """Trains `cfg.steps` steps with a guarded step; returns (losses, the guarded step)."""
  state = make_state(cfg)
  step = hg_flax.guarded_train_step(loss_fn, **guard_options)
  losses = []
  for i in range(cfg.steps):
    state, metrics = step(state, make_batch(cfg, i))
    losses.append(float(metrics["loss"]))
  return losses, step
