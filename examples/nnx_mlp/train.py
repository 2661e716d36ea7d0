"""An nnx model and optimizer under guarded_jit: the ordinary nnx way, made plan-aware.

`hg_flax.remat` wraps each layer (the remat rung), `hg_flax.nnx_train_step` takes the
gradients through `hbm_guard.value_and_grad` (microbatching) and, under the offload rung,
streams the optimizer state from the host through the device in parts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import hbm_guard
from hbm_guard.integrations import flax as hg_flax


class MLP(nnx.Module):
  """Residual blocks that widen to `hidden` and back: activations dominate the step."""

  def __init__(self, width: int, hidden: int, depth: int, rngs: nnx.Rngs):
    self.up = nnx.List([nnx.Linear(width, hidden, rngs=rngs) for _ in range(depth)])
    self.down = nnx.List([nnx.Linear(hidden, width, rngs=rngs) for _ in range(depth)])

  def __call__(self, x):
    block = hg_flax.remat(lambda up, down, h: h + down(jnp.tanh(up(h))))  # remat by plan
    for up, down in zip(self.up, self.down):
      x = block(up, down, x)
    return x


def loss_fn(model, batch):
  return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def make_batch(config, step: int):
  kx, ky = jax.random.split(jax.random.key(1000 + step))
  return {"x": jax.random.normal(kx, (config.batch, config.width)),
          "y": jax.random.normal(ky, (config.batch, config.width))}


def train_and_evaluate(config, **guard_options):
  """Trains `config.steps` steps; returns (losses, the guarded step)."""
  model = MLP(config.width, config.hidden, config.depth, nnx.Rngs(config.seed))
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
