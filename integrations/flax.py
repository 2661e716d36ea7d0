"""Flax (linen and nnx) and optax: per-layer remat and a fully plan-aware train step.

    from hbm_guard.integrations import flax as hg_flax

    class Model(nn.Module):
      @nn.compact
      def __call__(self, x):
        for _ in range(4):
          x = hg_flax.remat(Block)(dtype=hbm_guard.compute_dtype(jnp.float32))(x)
        ...

    step = hg_flax.guarded_train_step(loss_fn, target="v5e:2x2", max_class="numerics")
    state, metrics = step(state, batch)

Flax is imported lazily: importing hbm_guard never imports it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from hbm_guard._src.dropin import plan_aware
from hbm_guard._src.guard import api
from hbm_guard._src.guard import guard as guard_lib
from hbm_guard._src.plans import offload


def remat(target: Any, **kwargs) -> Any:
  """Per-layer remat following the plan, for a linen Module class or an nnx function.

  Before the ladder's remat rung the policy saves everything (no recompute, same memory
  as no remat); after it, the plan's `jax.checkpoint_policies` policy. The parameter tree
  is the same either way, so a plan change never breaks a checkpoint. Works inside
  `nn.scan` / `nnx.scan`: wrap the layer, then scan it.
  """
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  if isinstance(target, type) and issubclass(target, nn.Module):
    # Linen builds its checkpointed function afresh at every trace, so this policy, which
    # reads the plan when jax asks it, cannot be served an earlier trace's decisions.
    return nn.remat(target, policy=_plan_reading_policy, **kwargs)
  from flax import nnx  # pylint: disable=g-import-not-at-top

  @functools.wraps(target)
  def planned(*args, **kw):  # the plan's own policy object, resolved at each trace
    return nnx.remat(target, policy=plan_aware.current_remat_policy(), **kwargs)(*args, **kw)
  return planned


def _plan_reading_policy(prim, *args, **params):
  return plan_aware.current_remat_policy()(prim, *args, **params)


def train_step(loss_fn: Callable, *, has_aux: bool = False) -> Callable:
  """A plan-aware `step(state, batch) -> (state, metrics)` for a flax TrainState.

  `loss_fn(params, batch, apply_fn)` returns the mean loss over the batch (and aux when
  `has_aux`). Gradients come from `hbm_guard.value_and_grad`, so the microbatch rung
  applies; the update goes through `hbm_guard.offload_aware(state.tx)`, so the offload
  rung applies (the optimizer state streams through the device in parts);
  remat and dtype apply inside the model through `remat` and `compute_dtype`.
  """
  def step(state, batch):
    tx = state.tx

    def loss(params, batch):
      return loss_fn(params, batch, state.apply_fn)
    out, grads = plan_aware.value_and_grad(loss, batch_argnums=1, has_aux=has_aux)(
        state.params, batch)
    value, aux = out if has_aux else (out, None)
    # With the offload rung the optimizer state streams through the device in the update.
    state = state.replace(tx=offload.offload_aware(state.tx)).apply_gradients(grads=grads)
    state = state.replace(tx=tx)
    metrics = {"loss": value}
    if aux is not None:
      metrics["aux"] = aux
    return state, metrics

  return step


def guarded_train_step(loss_fn: Callable, *, has_aux: bool = False, **guard_options
                       ) -> guard_lib.GuardedFunction:
  """`train_step` under `guarded_jit`, with the state (argument 0) donatable and shardable."""
  guard_options.setdefault("state_argnums", 0)
  return api.guarded_jit(train_step(loss_fn, has_aux=has_aux), **guard_options)


def nnx_train_step(loss_fn: Callable, graphdef: Any, *, has_aux: bool = False,
                   weighted: bool = False) -> Callable:
  """A plan-aware step for an `nnx.Module` trained by an `nnx.Optimizer`.

      graphdef, state = nnx.split((model, optimizer))
      step = hbm_guard.guarded_jit(hg_flax.nnx_train_step(loss_fn, graphdef),
                                   state_argnums=0, max_class="numerics", ...)
      state, metrics = step(state, batch)
      nnx.update((model, optimizer), state)   # when you want the objects back

  `loss_fn(model, batch)` returns the mean loss (with `has_aux`: `(loss, aux)`), or with
  `weighted=True` `(sum_of_losses, sum_of_weights)` (see `hbm_guard.value_and_grad`).
  Gradients are taken of the model's `nnx.Param`s through `hbm_guard.value_and_grad`
  (microbatch rung); with the offload rung the optimizer's state lives on the host and
  streams through the device in parts in the update (`offload_aware`);
  `remat` and `compute_dtype` inside the model reach the rest. Returns the new state and
  `{"loss": ..., "aux": ...}`. Model state other than parameters (batch statistics, RNG
  counters) is read, not updated, by the step.
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top

  def step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    model_def, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, b):
      return loss_fn(nnx.merge(model_def, p, rest), b)
    out, grads = plan_aware.value_and_grad(loss, batch_argnums=1, has_aux=has_aux,
                                        weighted=weighted)(params, batch)
    value, aux = out if has_aux else (out, None)
    # With the offload rung the optimizer state streams through the device in the update.
    optimizer.tx = offload.offload_aware(optimizer.tx)
    optimizer.update(model, grads)
    metrics = {"loss": value}
    if aux is not None:
      metrics["aux"] = aux
    return nnx.state((model, optimizer)), metrics

  return step
