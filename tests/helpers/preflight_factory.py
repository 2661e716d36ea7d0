"""A factory for `hbm-guard preflight` tests: a guarded step and abstract arguments."""

import jax
import jax.numpy as jnp

import hbm_guard


def _step(w, x):
  g = jax.grad(lambda w: jnp.tanh(x @ w).mean())(w)
  return w - 0.1 * g, g.mean()


def make():
  step = hbm_guard.guarded_jit(_step, state_argnums=0, plan_cache=False,
                               report_dir="/tmp/hbm_guard_preflight_reports")
  return step, (jax.ShapeDtypeStruct((1024, 1024), jnp.float32),  # 4 MiB of state
                jax.ShapeDtypeStruct((8, 1024), jnp.float32))


def _layers(w, x):
  loss, g = jax.value_and_grad(
      lambda w, x: jnp.mean(jnp.tanh(jnp.tanh(x @ w[0]) @ w[1]) ** 2))(w, x)
  return w - 0.1 * g, loss


def make_layers():
  """Two bf16 layers of 1024 whose batch must be split to fit 12 MiB: rivals to compare."""
  step = hbm_guard.guarded_jit(_layers, state_argnums=0, plan_cache=False, progress=False,
                               report_dir="/tmp/hbm_guard_preflight_reports")
  return step, (jax.ShapeDtypeStruct((2, 1024, 1024), jnp.bfloat16),
                jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16))
