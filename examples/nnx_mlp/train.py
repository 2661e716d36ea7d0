"""An nnx model and optimizer under guarded_jit: the ordinary nnx way, made plan-aware.

`hg_flax.remat` wraps each layer (the remat rung), `hg_flax.nnx_train_step` takes the
gradients through `hbm_guard.value_and_grad` (microbatching) and brings the optimizer state
to the device only for the update (offload).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import hbm_guard
from hbm_guard.integrations import flax as hg_flax


class MLP(nnx.Module):
  def __init__(self, width: int, depth: int, rngs: nnx.Rngs):
    self.layers = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])

  def __call__(self, x):
    block = hg_flax.remat(lambda layer, h: h + jnp.tanh(layer(h)))  # per layer, by plan
    for layer in self.layers:
      x = block(layer, x)
    return x


def loss_fn(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def make_batch(config, step: int):
  kx, ky = jax.random.split(jax.random.key(1000 + step))
  return {"x": jax.random.normal(kx, (config.batch, config.width)),
          "y": jax.random.normal(ky, (config.batch, config.width))}


def train_and_evaluate(config, **guard_options):
  """Trains `config.steps` steps; returns (losses, the guarded step)."""
  model = MLP(config.width, config.depth, nnx.Rngs(config.seed))
  optimizer = nnx.Optimizer(model, optax.sgd(config.learning_rate, momentum=0.9),
                            wrt=nnx.Param)
  graphdef, state = nnx.split((model, optimizer))
  step = hbm_guard.guarded_jit(hg_flax.nnx_train_step(loss_fn, graphdef), state_argnums=0,
                               **guard_options)
  losses = []
  for i in range(config.steps):
    state, metrics = step(state, make_batch(config, i))
    losses.append(float(metrics["loss"]))
  nnx.update((model, optimizer), state)  # the objects hold the trained state again
  return losses, step
