"""Counting a step's flops from its jaxpr, as XLA's cost analysis counts the program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hbm_guard._src.backends import flop_count


def _loss(w, x):
  h = x
  for _ in range(3):
    h = jnp.tanh(h @ w)
  return jnp.mean(h ** 2)


def _xla(fun, *args):
  analysis = jax.jit(fun).lower(*args).cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  return analysis["flops"]


@pytest.mark.parametrize("fun", [_loss, jax.grad(_loss), jax.grad(jax.checkpoint(_loss)),
                                 jax.value_and_grad(jax.checkpoint(_loss))])
def test_the_count_is_xlas_within_a_percent(fun):
  w, x = jnp.ones((128, 128)), jnp.ones((32, 128))
  counted = flop_count.count(jax.jit(fun).trace(w, x).jaxpr)
  assert counted > 3 * 2 * 32 * 128 * 128  # the three matmuls at least
  np.testing.assert_allclose(counted, _xla(fun, w, x), rtol=0.01)


def test_remat_costs_its_recompute_and_a_scan_its_length():
  w, x = jnp.ones((128, 128)), jnp.ones((32, 128))
  count = lambda f: flop_count.count(jax.jit(f).trace(w, x).jaxpr)  # noqa: E731
  plain = count(jax.value_and_grad(_loss))
  assert count(jax.value_and_grad(jax.checkpoint(_loss))) > plain * 1.2  # the forward again
  plain = count(jax.grad(_loss))

  def split(w, x):  # the same gradient over 4 microbatches of 8
    def body(g, xs):
      return g + jax.grad(_loss)(w, xs), None
    return jax.lax.scan(body, jnp.zeros_like(w), x.reshape(4, 8, 128))[0]
  looped = flop_count.count(jax.jit(split).trace(w, x).jaxpr)
  np.testing.assert_allclose(looped, plain, rtol=0.05)  # XLA's analysis reads the body once
