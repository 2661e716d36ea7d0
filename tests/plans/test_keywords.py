"""Keyword arguments under a plan's layout: jax.jit refuses them once in_shardings are given."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from hbm_guard._src.plans import keywords


def _step(x, *, y, mode="add"):
  return x + y if mode == "add" else x * y


def test_keywords_travel_as_trailing_positions_static_and_donated_too():
  s = NamedSharding(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)), P())
  kw = {"in_shardings": (s,), "static_argnames": ("mode",), "donate_argnames": ("y",)}
  with pytest.raises(ValueError, match="kwargs"):
    jax.jit(_step, **kw)(jnp.ones(3), y=jnp.ones(3), mode="mul")
  jitted = keywords.KeywordsAsPositional(_step, kw, nargs=1)
  assert float(jitted(jnp.ones(3), y=jnp.full(3, 2.0), mode="mul")[0]) == 2.0
  assert float(jitted(jnp.ones(3), mode="add", y=jnp.full(3, 2.0))[0]) == 3.0
  lowered = jitted.lower(jnp.ones(3), y=jnp.ones(3), mode="mul")
  assert "multiply" in lowered.as_text()
  assert lowered.args_info[0][1].donated  # y, donated by name
