"""Issue #11, what a CPU can check: capacity from a device's allocator stats, the check that
donated arguments are alive before a retry, and the GPU runtime record's advice. A real
runtime out-of-memory needs a GPU (benchmarks/gpu_check.py); none is faked here."""

import jax
import jax.numpy as jnp

import hbm_guard
from hbm_guard._src.backends import targets

GiB = 1 << 30


def test_capacity_from_stats_leaves_out_other_live_arrays_not_the_steps_own():
  stats = {"bytes_limit": 100 * GiB, "bytes_in_use": 30 * GiB}
  # 10 GiB of the 30 in use are the step's own arguments, which memory_analysis counts.
  assert targets.capacity_from_stats(stats, 10 * GiB) == 80 * GiB
  assert targets.capacity_from_stats(stats, 40 * GiB) == 100 * GiB
  assert targets.capacity_from_stats(None, 0) is None  # the CPU has no allocator stats
  assert targets.capacity_from_stats({"bytes_in_use": 1}, 0) is None


def test_no_device_capacity_on_the_cpu():
  assert jax.local_devices()[0].memory_stats() is None or jax.default_backend() != "gpu"
  from hbm_guard._src.backends import backend, options, steps
  opts = options.GuardOptions()
  local = backend.make(steps.StepBuilder(lambda x: x * 2, opts), opts)
  assert isinstance(local, backend.LocalBackend) and local.capacity((jnp.ones(4),)) is None


def test_a_retry_needs_every_donated_argument_alive():
  from hbm_guard._src.guard import keep  # pylint: disable=import-outside-toplevel
  def double(x, y):
    return x * 2, y
  step = hbm_guard.guarded_jit(double, donate_argnums=0)
  a, b = jnp.ones(8), jnp.ones(8)
  step(a, b)
  entry = step._hot  # pylint: disable=protected-access
  assert a.is_deleted()
  assert not keep.donated_alive(entry, (a, b), step.options)
  assert keep.donated_alive(entry, (jnp.ones(8), b), step.options)
