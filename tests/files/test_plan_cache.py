"""Issue #8: a plan that fit is remembered; a restart compiles once and fails none."""

import json
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hbm_guard
from hbm_guard._src.backends import compile as C
from hbm_guard._src.files import plan_cache as PC
from tests import paths


def sgd_step(w, x):
  g = jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
  return w - 0.1 * g, g.sum()


W = jnp.full((512, 512), 0.01)
X = jnp.ones((64, 512))


def _capacity():  # the plain step does not fit; donated, it does
  plain = C.memory_of(jax.jit(sgd_step).lower(W, X).compile())
  return plain["peak"] - W.nbytes // 2


def test_a_new_guard_on_the_same_program_starts_from_the_cached_plan(tmp_path):
  opts = dict(state_argnums=0, capacity=_capacity(), report_dir=str(tmp_path / "r"),
              plan_cache=str(tmp_path / "cache"))
  first = hbm_guard.guarded_jit(sgd_step, **opts)
  first(jnp.array(W), X)
  assert [a.outcome for a in first.attempts] == ["oom", "fits"]
  again = hbm_guard.guarded_jit(sgd_step, **opts)  # as after a restart
  out = again(jnp.array(W), X)
  assert [a.outcome for a in again.attempts] == ["fits"] and again.plan == first.plan
  np.testing.assert_allclose(out[0], jax.jit(sgd_step)(W, X)[0])
  # Another shape is not served the plan of this one: it is fitted for itself.
  other = hbm_guard.guarded_jit(sgd_step, **opts)
  other(jnp.array(W), jnp.ones((8, 512)))
  assert other.attempts[0].plan == hbm_guard.Plan()


def test_exhaustion_is_remembered_and_not_climbed_again(tmp_path):
  opts = dict(state_argnums=0, capacity="1KiB", report_dir=str(tmp_path / "r"),
              plan_cache=str(tmp_path / "cache"))
  with pytest.raises(hbm_guard.LadderExhaustedError):
    hbm_guard.guarded_jit(sgd_step, **opts)(W, X)
  retry = hbm_guard.guarded_jit(sgd_step, **opts)
  with pytest.raises(hbm_guard.LadderExhaustedError, match="nothing was compiled") as info:
    retry(W, X)
  assert retry.attempts == []
  report = json.load(open(info.value.report_path))
  assert report["status"] == "exhausted" and report["attempts"] and "plan cache" in report["note"]


def test_what_decides_the_plan_is_in_the_key(tmp_path):
  cache = str(tmp_path / "cache")
  hbm_guard.guarded_jit(sgd_step, state_argnums=0, capacity=_capacity(), plan_cache=cache,
                        report_dir=str(tmp_path))(jnp.array(W), X)
  bigger = hbm_guard.guarded_jit(sgd_step, state_argnums=0, capacity=_capacity() * 2,
                                 plan_cache=cache, report_dir=str(tmp_path))
  bigger(jnp.array(W), X)
  assert bigger.plan == hbm_guard.Plan()  # a new capacity is a new question
  assert len(os.listdir(cache)) == 2


def test_off_writes_nothing(tmp_path, monkeypatch):
  monkeypatch.setenv("HBM_GUARD_PLAN_CACHE", str(tmp_path / "env"))
  assert PC.resolve(None).directory == str(tmp_path / "env")
  assert PC.resolve(False) is None and PC.resolve("off") is None
  step = hbm_guard.guarded_jit(sgd_step, state_argnums=0, capacity=_capacity(),
                               plan_cache=False, report_dir=str(tmp_path))
  step(jnp.array(W), X)
  assert not (tmp_path / "env").exists()


def test_concurrent_writers_leave_a_valid_entry(tmp_path):
  cache = PC.PlanCache(str(tmp_path))
  plans = [hbm_guard.Plan(microbatches=k) for k in (1, 2, 4, 8)]
  seen = []
  parts = {"program": "p"}
  key = PC.digest(parts)  # an entry's parts must hash to its key

  def work(i):
    for _ in range(50):
      cache.put(key, PC.Entry("fits", plans[i % 4], parts=parts))
      got = cache.get(key)
      seen.append(got is not None and got.plan in plans)

  threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert all(seen) and len(seen) == 400
  assert [p for p in os.listdir(tmp_path) if p.endswith(".tmp")] == []
  (tmp_path / f"{key}.json").write_text("{damaged")
  assert cache.get(key) is None  # a damaged entry is a miss


_RESTART = """
import json, sys
import jax, jax.numpy as jnp
import hbm_guard
from tests.files.test_plan_cache import sgd_step, W, X
step = hbm_guard.guarded_jit(sgd_step, state_argnums=0, capacity=int(sys.argv[1]),
                             plan_cache=sys.argv[2], report_dir=sys.argv[2] + "/r")
step(jnp.array(W), X)
print(json.dumps([a.outcome for a in step.attempts]))
"""


def test_a_restarted_process_compiles_once_and_fails_none(tmp_path):
  root = str(paths.ROOT)
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("HBM_GUARD_PLAN_CACHE", None)

  def run():
    proc = subprocess.run([sys.executable, "-c", _RESTART, str(_capacity()), str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
  assert run() == ["oom", "fits"]
  assert run() == ["fits"]


def test_a_plan_from_the_report_pins_the_step(tmp_path):
  opts = dict(state_argnums=0, capacity=_capacity(), report_dir=str(tmp_path), plan_cache=False)
  first = hbm_guard.guarded_jit(sgd_step, **opts)
  first(jnp.array(W), X)
  plan_file = tmp_path / "plan.json"
  plan_file.write_text(json.dumps(json.load(open(first.report_path))["final_plan"]))
  pinned = hbm_guard.guarded_jit(sgd_step, auto_fallback=False, plan=str(plan_file), **opts)
  pinned(jnp.array(W), X)
  assert [a.outcome for a in pinned.attempts] == ["fits"] and pinned.plan == first.plan
  too_small = hbm_guard.guarded_jit(sgd_step, auto_fallback=False, plan=hbm_guard.Plan(),
                                    **opts)
  with pytest.raises(hbm_guard.CapacityExceededError):
    too_small(W, X)


def test_search_ladder_compiles_each_rung(tmp_path):
  step = hbm_guard.guarded_jit(sgd_step, state_argnums=0, capacity="1KiB", search="ladder",
                               report_dir=str(tmp_path), plan_cache=False)
  with pytest.raises(hbm_guard.LadderExhaustedError):
    step(W, X)
  assert [a.plan.describe() for a in step.attempts] == ["plain jit", "donate"]
  with pytest.raises(ValueError):
    hbm_guard.guarded_jit(sgd_step, search="random")
