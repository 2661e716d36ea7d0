"""Issue #8: the plan kept beside orbax checkpoints; a restored job compiles once."""

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import hbm_guard
from hbm_guard._src.backends import compile as C
from hbm_guard.integrations import orbax as hg_orbax


def sgd_step(w, x):
  g = jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
  return w - 0.1 * g, g.sum()


def test_a_restored_job_resumes_on_the_saved_plan(tmp_path):
  w, x = jnp.full((512, 512), 0.01, jnp.float32), jnp.ones((64, 512))  # not weakly typed,
  # as orbax restores it: a weak type is another signature
  plain = C.memory_of(jax.jit(sgd_step).lower(w, x).compile())
  opts = dict(state_argnums=0, capacity=plain["peak"] - w.nbytes // 2,
              report_dir=str(tmp_path / "r"))
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    step = hbm_guard.guarded_jit(sgd_step, plan_cache=hg_orbax.plan_cache_dir(manager), **opts)
    w1, _ = step(jnp.array(w), x)
    manager.save(1, args=ocp.args.StandardSave({"w": w1}))
    manager.wait_until_finished()
    assert [a.outcome for a in step.attempts] == ["oom", "fits"]
  # Another process, machine or day: only the checkpoint directory is shared.
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    restored = manager.restore(manager.latest_step(),
                               args=ocp.args.StandardRestore({"w": jnp.zeros_like(w)}))
    again = hbm_guard.guarded_jit(sgd_step, plan_cache=hg_orbax.plan_cache_dir(manager), **opts)
    w2, _ = again(restored["w"], x)
  assert [a.outcome for a in again.attempts] == ["fits"] and again.plan == step.plan
  np.testing.assert_allclose(w2, jax.jit(sgd_step)(w1, x)[0], rtol=1e-6)
  # A state of another dtype is another signature: fitted for itself, never served the plan.
  other = hbm_guard.guarded_jit(sgd_step, plan_cache=str(tmp_path / "ckpt" / "hbm_guard_plans"),
                                **opts)
  other(w1.astype(jnp.bfloat16), x.astype(jnp.bfloat16))
  assert other.attempts[0].plan == hbm_guard.Plan()
