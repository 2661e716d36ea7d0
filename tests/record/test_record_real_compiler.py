"""Messages raised by the real XLA:TPU compiler (libtpu, compiling for v5e) parse right."""

import math

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import hbm_guard
from hbm_guard._src.record import record as R

pytestmark = pytest.mark.real_compiler
MiB = 2**20


def _mlp_grad(w, x):
  def loss(w):
    h = x
    for _ in range(4):
      h = jnp.tanh(h @ w)
    return (h**2).mean()
  return jax.grad(loss)(w)


@pytest.fixture(scope="module")
def lowered(v5e_mesh1):
  s = NamedSharding(v5e_mesh1, P())
  w = jax.ShapeDtypeStruct((512, 512), jnp.float32, sharding=s)
  x = jax.ShapeDtypeStruct((4096, 512), jnp.float32, sharding=s)
  return jax.jit(_mlp_grad).lower(w, x)


def _compile_error(lowered, budget_mib):
  with pytest.raises(jax.errors.JaxRuntimeError) as info:
    lowered.compile({"xla_tpu_max_hbm_size_mib": budget_mib})
  return info.value


def test_early_form_from_the_compiler(lowered):
  err = _compile_error(lowered, 1)
  assert "RESOURCE_EXHAUSTED" in str(err)
  rec = hbm_guard.parse(err)
  assert rec.kind == R.COMPILE_HBM_EARLY
  # Newer libtpu prefixes "E1000: CompileTimeHbmOom:" (and names the module); older omit.
  assert rec.error_code == ("E1000" if "E1000:" in str(err) else None)
  assert rec.capacity_bytes == 1 * MiB
  assert rec.temp_bytes > rec.capacity_bytes
  assert rec.hlo_module == ("jit__mlp_grad" if "HLO module" in str(err) else None)
  assert hbm_guard.diagnose(rec).scenario == "S3"


def test_long_form_from_the_compiler(lowered):
  early = hbm_guard.parse(_compile_error(lowered, 1))
  # A budget that passes the early check on temporaries but not buffer assignment.
  budget = math.ceil(early.temp_bytes / MiB)
  err = _compile_error(lowered, budget)
  rec = hbm_guard.parse(err)
  assert rec.kind == R.COMPILE_HBM
  assert rec.error_code == ("E1000" if "E1000:" in str(err) else None)
  assert rec.capacity_bytes == budget * MiB
  assert rec.used_bytes > rec.capacity_bytes
  # Arguments as the compiler listed them: w 1 MiB and x 8 MiB, f32.
  assert rec.breakdown["arguments"] == (512 * 512 + 4096 * 512) * 4
  listed = {a.xla_label: a.size_bytes for a in rec.arguments_and_outputs}
  assert listed["Argument 1 index {}"] == 4096 * 512 * 4
  assert listed["Argument 0 index {}"] == 512 * 512 * 4
  assert rec.allocations, "the long form lists the largest program allocations"
