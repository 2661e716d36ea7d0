"""Training a guarded step next to the plain `jax.jit` one, for tests that compare them."""

import jax
import jax.numpy as jnp
import numpy as np


def train_side_by_side(step, guarded, state, batch, steps: int = 10, rtol: float = 1e-5):
  """Runs `steps` steps of each from the same state (the guarded one on a copy, as it may
  donate); every loss must agree within `rtol`. Returns (guarded state, plain state)."""
  plain = jax.jit(step)
  s_plain, s_guard = state, jax.tree.map(jnp.copy, state)
  for _ in range(steps):
    s_plain, m_plain = plain(s_plain, batch)
    s_guard, m_guard = guarded(s_guard, batch)
    np.testing.assert_allclose(m_guard["loss"], m_plain["loss"], rtol=rtol)
  return s_guard, s_plain
