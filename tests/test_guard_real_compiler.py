"""guarded_jit against the real XLA:TPU compiler (libtpu), compiling for v5e targets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hbm_guard
from hbm_guard._src import record as R
from examples.recover_e1000 import train

pytestmark = pytest.mark.real_compiler
MiB = 2**20


def test_flax_step_trips_e1000_for_v5e_and_fits_after_the_ladder(tmp_path, v5e_devices):
  cfg = train.Config(steps=2)
  losses, step = train.train(cfg, target="v5e:1x1", capacity="96MiB", max_class="numerics",
                             report_dir=str(tmp_path))
  first, last = step.attempts[0], step.attempts[-1]
  assert first.outcome == "oom"
  assert first.record.error_code == ("E1000" if "E1000:" in first.record.raw else None)
  assert first.record.kind in (R.COMPILE_HBM, R.COMPILE_HBM_EARLY)
  assert first.record.capacity_bytes == 96 * MiB
  assert last.outcome == "fits" and last.memory["peak"] <= 96 * MiB
  # Each rung's saving in the compiler's own figures: what each failed attempt needed
  # falls, and the final plan is remat'd per layer.
  needs = [a.record.required_bytes for a in step.attempts if a.record]
  assert needs == sorted(needs, reverse=True) and needs[-1] < needs[0]
  assert step.plan.remat_policy is not None and 0 in step.plan.donate_argnums
  assert len(losses) == 2 and all(np.isfinite(losses))


def _state_step(w, x):
  g = jax.grad(lambda w: jnp.tanh(x @ w).mean())(w)
  return w - 0.1 * g, g.mean()


def test_resharding_makes_a_replicated_state_fit_a_4_chip_target(tmp_path, v5e_devices):
  w, x = jnp.zeros((2048, 2048)), jnp.ones((8, 2048))  # 16 MiB of state
  want = jax.jit(_state_step)(w, x)[0]  # before: the guard may donate w (state_argnums)
  step = hbm_guard.guarded_jit(_state_step, state_argnums=0, target="v5e:2x2",
                               capacity="12MiB", report_dir=str(tmp_path))
  out = step(w, x)
  assert step.attempts[0].outcome == "oom"
  assert step.attempts[0].record.kind in (R.COMPILE_HBM, R.COMPILE_HBM_EARLY)
  assert step.plan.shard_state and "reshard_fsdp" in step.plan.rungs
  final = step.attempts[-1].memory
  # The compiler's figure: each chip now holds a quarter of the state as argument.
  assert final["argument"] < w.nbytes // 2
  assert final["peak"] <= 12 * MiB
  np.testing.assert_allclose(out[0], want, rtol=1e-6)


def test_exhausted_on_the_real_compiler_chains_its_error(tmp_path, v5e_devices):
  step = hbm_guard.guarded_jit(_state_step, state_argnums=0, target="v5e:1x1",
                               capacity="1MiB", report_dir=str(tmp_path))
  with pytest.raises(hbm_guard.LadderExhaustedError) as info:
    step(jnp.zeros((512, 512)), jnp.ones((4096, 512)))
  assert isinstance(info.value.__cause__, jax.errors.JaxRuntimeError)
  assert "RESOURCE_EXHAUSTED" in str(info.value.__cause__)
  attempts = info.value.attempts
  assert len(attempts) >= 3 and all(a.outcome == "oom" for a in attempts)
  # Newer libtpu prefixes "E1000: CompileTimeHbmOom:"; older releases omit the code.
  assert all(a.record.error_code == ("E1000" if "E1000:" in a.record.raw else None)
             and a.record.is_compile_time for a in attempts)
