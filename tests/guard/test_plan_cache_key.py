"""Issue #20: everything that decides a compile is in the plan cache's key; "nothing fits"
is advice with an age; `hbm-guard cache` lists, shows and clears entries."""

import io
import json
import time

import jax
import jax.numpy as jnp
import pytest

import hbm_guard
from hbm_guard._src.backends import compile as C
from hbm_guard._src.cli import cli
from hbm_guard._src.files import plan_cache as PC


def sgd_step(w, x):
  g = jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
  return w - 0.1 * g, g.sum()


W = jnp.full((512, 512), 0.01)
X = jnp.ones((64, 512))
_DONATE_ONLY = [{"name": "donate", "kind": "donate", "class": "exact", "section": "S3.A"}]


def _capacity():  # the plain step does not fit; donated, it does
  return C.memory_of(jax.jit(sgd_step, donate_argnums=0).lower(W, X).compile())["peak"]


def _entries(d):
  return sorted(p.name for p in d.iterdir() if p.suffix == ".json")


def _exhaust_on_v5e(cache, tmp_path, **extra):
  g = hbm_guard.guarded_jit(sgd_step, state_argnums=0, target="v5e:1x1", capacity="1MiB",
                            ladder=_DONATE_ONLY, plan_cache=str(cache),
                            report_dir=str(tmp_path / "r"), **extra)
  with pytest.raises(hbm_guard.LadderExhaustedError) as e:
    g.fit(W, X)
  return g, str(e.value)


@pytest.mark.real_compiler
@pytest.mark.parametrize("variable, value", [
    ("XLA_FLAGS", "--xla_cpu_enable_fast_math=false"),
    ("LIBTPU_INIT_ARGS", "--xla_tpu_enable_log_recorder=false"),
])
def test_an_exhausted_job_rerun_with_other_flags_climbs_again(v5e_devices, tmp_path,
                                                              monkeypatch, variable, value):
  cache = tmp_path / "cache"
  first, _ = _exhaust_on_v5e(cache, tmp_path)
  assert first.attempts and all(a.outcome == "oom" for a in first.attempts)
  again, message = _exhaust_on_v5e(cache, tmp_path)  # same flags: remembered, no compile
  assert "remembers" in message and "h ago" in message and not again.attempts
  assert "plan_cache_retry_exhausted" in message and "XLA_FLAGS" in message
  monkeypatch.setenv(variable, value)
  other, message = _exhaust_on_v5e(cache, tmp_path)
  assert "remembers" not in message and other.attempts  # compiled: a new key
  assert len(_entries(cache)) == 2


@pytest.mark.real_compiler
def test_retry_exhausted_climbs_again(v5e_devices, tmp_path):
  cache = tmp_path / "cache"
  _exhaust_on_v5e(cache, tmp_path)
  retried, message = _exhaust_on_v5e(cache, tmp_path, plan_cache_retry_exhausted=True)
  assert retried.attempts and "remembers" not in message


def test_a_fitted_plan_is_not_reused_under_other_flags(tmp_path, monkeypatch):
  cache = tmp_path / "cache"
  opts = dict(state_argnums=0, capacity=_capacity(), plan_cache=str(cache),
              report_dir=str(tmp_path / "r"))
  first = hbm_guard.guarded_jit(sgd_step, **opts)
  first(jnp.array(W), X)
  assert [a.outcome for a in first.attempts] == ["oom", "fits"]
  restarted = hbm_guard.guarded_jit(sgd_step, **opts)
  restarted(jnp.array(W), X)
  assert [a.outcome for a in restarted.attempts] == ["fits"]  # the cached plan
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
  other = hbm_guard.guarded_jit(sgd_step, **opts)
  other(jnp.array(W), X)
  assert [a.outcome for a in other.attempts] == ["oom", "fits"]  # checked anew
  assert len(_entries(cache)) == 2


def test_jax_config_and_the_users_compiler_options_are_in_the_key(tmp_path):
  cache = tmp_path / "cache"

  def run(**kw):
    hbm_guard.guarded_jit(sgd_step, plan_cache=str(cache), **kw)(W, X)
    return len(_entries(cache))

  assert run() == 1
  before = jax.config.jax_default_matmul_precision
  jax.config.update("jax_default_matmul_precision", "highest")
  try:
    assert run() == 2
  finally:
    jax.config.update("jax_default_matmul_precision", before)
  assert run(compiler_options={"xla_cpu_enable_fast_math": False}) == 3
  env = PC.compile_environment()
  assert set(env["env"]) == {"XLA_FLAGS", "LIBTPU_INIT_ARGS"}
  assert "jax_default_matmul_precision" in env["jax_config"]


def _cli(*argv):
  out = io.StringIO()
  return cli.main(list(argv), out=out), out.getvalue()


def test_the_cache_command_lists_shows_and_clears(tmp_path, capsys):
  cache = tmp_path / "cache"
  opts = dict(state_argnums=0, capacity=_capacity(), plan_cache=str(cache),
              report_dir=str(tmp_path / "r"))
  hbm_guard.guarded_jit(sgd_step, **opts)(jnp.array(W), X)
  with pytest.raises(hbm_guard.LadderExhaustedError):
    hbm_guard.guarded_jit(sgd_step, **{**opts, "capacity": 1024}, max_attempts=1)(
        jnp.array(W), X)
  (cache / ("f" * 64 + ".json")).write_text("{damaged")
  code, text = _cli("cache", "list", str(cache))
  assert code == 0 and "3 entries" in text
  assert "fits" in text and "exhausted" in text and "damaged" in text and "donate" in text
  key = next(p.stem for p in cache.iterdir()
             if p.suffix == ".json" and '"status": "fits"' in p.read_text())
  code, text = _cli("cache", "show", key[:10], str(cache))
  assert code == 0 and json.loads(text)["status"] == "fits" and json.loads(text)["key"] == key
  assert _cli("cache", "show", "0123", str(cache))[0] == 2
  code, text = _cli("cache", "clear", str(cache), "--exhausted")
  assert code == 0 and "removed 1 entry" in text and len(_entries(cache)) == 2
  code, text = _cli("cache", "clear", str(cache))
  assert code == 0 and _entries(cache) == []


def test_entries_record_when_they_were_written(tmp_path):
  cache = tmp_path / "cache"
  hbm_guard.guarded_jit(sgd_step, plan_cache=str(cache))(W, X)
  (name,) = _entries(cache)
  entry = PC.PlanCache(str(cache)).read(name[:-5])
  assert 0 <= entry.age_seconds() < 60 and abs(entry.written_at - time.time()) < 60


@pytest.mark.real_compiler
def test_on_a_target_the_keys_lowering_is_the_first_compiles(v5e_devices, tmp_path):
  # The key is the program as the target's first compile lowers it, and that lowering is
  # compiled, not made again: one trace for a step that fits (at 368M parameters a lowering
  # took 2.3-2.6 s, paid twice on every fit before). A new guard then hits the cache.
  import threading  # pylint: disable=g-import-not-at-top
  traces = []
  def step(w, x):
    if threading.current_thread() is threading.main_thread():  # not the probes prepared
      traces.append(1)
    return sgd_step(w, x)
  opts = dict(state_argnums=0, target="v5e:1x1", plan_cache=str(tmp_path / "cache"),
              report_dir=str(tmp_path / "r"))
  first = hbm_guard.guarded_jit(step, **opts)
  assert first.fit(W, X) == hbm_guard.Plan() and len(traces) == 1
  assert len(_entries(tmp_path / "cache")) == 1
  again = hbm_guard.guarded_jit(step, **opts)
  again.fit(W, X)
  assert len(_entries(tmp_path / "cache")) == 1 and len(again.attempts) == 1
