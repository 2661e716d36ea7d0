"""Issue #7: every rung does what it says, nothing the caller holds is lost, bad input
gets a clear error. Each test failed on the code before the fix."""

import json
import logging as std_logging
import os
import pickle
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl import logging as absl_logging
from absl.testing import flagsaver

import hbm_guard
from hbm_guard._src.backends import compile as C
from hbm_guard._src.plans import rung_specs
from hbm_guard._src.plans import rungs as rungs_lib
from tests import paths

_REMAT_ONLY = [{"name": "layer_remat", "kind": "remat", "class": "exact", "section": "S3.E",
                "policies": ["nothing_saveable"]}]
_MICRO_ONLY = [{"name": "microbatch", "kind": "microbatch", "class": "numerics",
                "section": "S3.A"}]


@pytest.fixture(autouse=True, scope="module")
def _parse_flags():
  from absl import flags
  from hbm_guard import flags as _  # noqa: F401  registers --hbm_guard_*
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


# -- 1. remat follows the plan, in the compiler's figures, after a plain trace -------------

def _tanh_layer(w, x):
  for _ in range(4):
    x = jnp.tanh(x @ w)
  return x


_BLOCK = hbm_guard.checkpoint(_tanh_layer)  # wrapped once, at import, as users do


def _checkpoint_step(ws, x):
  def loss(ws):
    h = x
    for w in ws:
      h = _BLOCK(w, h)
    return (h ** 2).mean()
  return jax.grad(loss)(ws)


def _assert_remat_rung_cuts_peak(step, *args, tmp_path):
  plain = C.memory_of(jax.jit(step).lower(*args).compile())  # a plain trace first
  ref = jax.jit(step)(*args)
  g = hbm_guard.guarded_jit(step, capacity=plain["peak"] - 1, ladder=_REMAT_ONLY,
                            report_dir=str(tmp_path))
  out = g(*args)
  assert [a.outcome for a in g.attempts] == ["oom", "fits"], g.attempts
  assert g.plan.remat_policy == "nothing_saveable"
  assert g.attempts[-1].memory["peak"] < 0.8 * plain["peak"]  # the compiler's own figure
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), out, ref)


def test_checkpoint_wrapped_at_import_follows_the_plan_after_a_plain_trace(tmp_path):
  ws = [jnp.full((256, 256), 0.01) for _ in range(4)]
  _assert_remat_rung_cuts_peak(_checkpoint_step, ws, jnp.ones((2048, 256)), tmp_path=tmp_path)


def test_linen_remat_follows_the_plan_after_a_plain_trace(tmp_path):
  import flax.linen as nn
  from hbm_guard.integrations import flax as hg_flax

  class Layer(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(4):
        x = jnp.tanh(nn.Dense(256, use_bias=False)(x))
      return x

  Planned = hg_flax.remat(Layer)  # pylint: disable=invalid-name

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      for _ in range(4):
        x = Planned()(x)
      return x

  model, x = Model(), jnp.ones((2048, 256))
  params = model.init(jax.random.key(0), x[:1])

  def step(params, x):
    return jax.grad(lambda p: (model.apply(p, x) ** 2).mean())(params)
  _assert_remat_rung_cuts_peak(step, params, x, tmp_path=tmp_path)


def test_nnx_remat_follows_the_plan_after_a_plain_trace(tmp_path):
  from flax import nnx
  from hbm_guard.integrations import flax as hg_flax

  class Layer(nnx.Module):
    def __init__(self, rngs):
      self.dense = nnx.List([nnx.Linear(256, 256, use_bias=False, rngs=rngs) for _ in range(4)])

  @hg_flax.remat
  def apply_layer(layer, x):
    for d in layer.dense:
      x = jnp.tanh(d(x))
    return x

  layers = nnx.List([Layer(nnx.Rngs(i)) for i in range(4)])
  graphdef, params = nnx.split(layers)

  def step(params, x):
    def loss(p):
      model = nnx.merge(graphdef, p)
      h = x
      for layer in model:
        h = apply_layer(layer, h)
      return (h ** 2).mean()
    return jax.grad(loss)(params)
  _assert_remat_rung_cuts_peak(step, params, jnp.ones((2048, 256)), tmp_path=tmp_path)


# -- 2, 3. fallback off changes nothing; donate_argnums=0 is honoured ----------------------

def sgd_step(w, x):
  g = jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
  return w - 0.1 * g, g.sum()


W = jnp.full((512, 512), 0.01)
X = jnp.ones((64, 512))


@flagsaver.flagsaver(hbm_guard_capacity="1MiB")
def test_fallback_off_on_the_capacity_path_diagnoses_reports_and_changes_nothing(tmp_path):
  from hbm_guard import flags as hbm_flags
  opts = dict(hbm_flags.guard_options(), report_dir=str(tmp_path))
  assert opts["auto_fallback"] is False  # the flag's default
  step = hbm_guard.guarded_jit(sgd_step, state_argnums=0, **opts)
  w = jnp.array(W)
  with pytest.raises(hbm_guard.CapacityExceededError) as info:
    step(w, X)
  assert not w.is_deleted()  # not donated
  assert len(step.attempts) == 1 and step.attempts[0].plan == hbm_guard.Plan()
  assert isinstance(info.value, jax.errors.JaxRuntimeError)
  report = json.load(open(info.value.report_path))
  assert report["status"] == "diagnosed" and report["compiles"] == 1
  assert report["attempts"][0]["diagnosis"]["scenario"] == "S3"
  assert report["attempts"][0]["record"]["kind"] == "budget"


def test_donate_argnums_zero_is_donated_like_jax_jit():
  def double(x):
    return x * 2
  a, b = jnp.ones(1024), jnp.ones(1024)
  jax.jit(double, donate_argnums=0)(a)
  hbm_guard.guarded_jit(double, donate_argnums=0)(b)
  assert a.is_deleted() and b.is_deleted()


# -- 5, 6. threads, signatures, uneven batches ---------------------------------------------

def _mse_step(w, x, y):
  loss, g = hbm_guard.value_and_grad(lambda w, x, y: jnp.mean((jnp.tanh(x @ w) - y) ** 2),
                                     batch_argnums=(1, 2))(w, x, y)
  return w - 0.1 * g, loss


def _batch(n, seed=0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  return jax.random.normal(k1, (n, 256)), jax.random.normal(k2, (n, 256))


def _mse_drop_in(w, x, y):  # unmodified: jax's own gradient, activations that dominate
  def loss(w):
    h = x
    for _ in range(6):
      h = jnp.tanh(h @ w)
    return jnp.mean((h - y) ** 2)
  value, g = jax.value_and_grad(loss)(w)
  return w - 0.1 * g, value


def _capacity_needing_microbatches(n=512, k=4, step_fn=_mse_step):
  """A capacity between the plain step's peak and its peak with k microbatches."""
  w = jnp.full((256, 256), 0.01)
  x, y = _batch(n)

  def peak(plan):  # a guard of its own with the plan pinned: the drop-in's rewrite too
    pinned = hbm_guard.guarded_jit(step_fn, plan=plan, auto_fallback=False,
                                   max_class="numerics")
    pinned.fit(w, x, y)
    return pinned.attempts[-1].memory["peak"]
  plain, split = peak(hbm_guard.Plan()), peak(hbm_guard.Plan(microbatches=k))
  assert split < plain
  return w, (plain + split) // 2


def test_two_threads_fitting_at_once_each_end_on_a_plan_that_fits(tmp_path):
  w, capacity = _capacity_needing_microbatches()
  step = hbm_guard.guarded_jit(_mse_step, capacity=capacity, max_class="numerics",
                               ladder=_MICRO_ONLY, report_dir=str(tmp_path))
  sizes = {512: _batch(512, 1), 16: _batch(16, 2)}
  results, errors = {}, []
  barrier = threading.Barrier(2)

  def run(n):
    try:
      barrier.wait()
      results[n] = step(w, *sizes[n])
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=run, args=(n,)) for n in sizes]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert not errors, errors
  for n, (x, y) in sizes.items():
    want = jax.jit(_mse_step)(w, x, y)
    np.testing.assert_allclose(results[n][0], want[0], rtol=1e-5, atol=1e-7)
    last = [a for a in step.attempts if a.signature.startswith(f"float32[256, 256], float32[{n}, 256]")][-1]
    assert last.outcome == "fits" and last.memory["peak"] <= capacity
  big = [a for a in step.attempts if "[512, 256]" in a.signature and a.outcome == "fits"]
  assert big[-1].plan.microbatches >= 2


def test_alternating_signatures_do_not_recompile_like_jax_jit():
  traces = []

  def f(x):
    traces.append(x.shape)
    return x * 2
  g = hbm_guard.guarded_jit(f)
  a, b = jnp.ones(4), jnp.ones(8)
  g(a), g(b)
  n = len(traces)
  for _ in range(10):
    g(a), g(b)
  assert len(traces) == n and len(g.attempts) == 2


@pytest.mark.parametrize("step_fn", [_mse_step, _mse_drop_in])
def test_trailing_uneven_batch_refits_a_count_that_divides_it(tmp_path, step_fn):
  w, capacity = _capacity_needing_microbatches(step_fn=step_fn)
  step = hbm_guard.guarded_jit(step_fn, capacity=capacity, max_class="numerics",
                               ladder=_MICRO_ONLY, report_dir=str(tmp_path))
  step(w, *_batch(512))
  assert 512 % step.plan.microbatches == 0 and step.plan.microbatches >= 2
  x, y = _batch(510, 3)
  out = step(w, x, y)
  assert 510 % step.plan.microbatches == 0 and step.plan.microbatches >= 2
  # the count in force is not compiled (a whole batch under its name): one compile, of one
  # that divides the trailing batch
  assert [a.plan for a in step.attempts if "510" in a.signature] == [step.plan]
  np.testing.assert_allclose(out[0], jax.jit(step_fn)(w, x, y)[0], rtol=1e-5, atol=1e-7)
  step(w, *_batch(512))  # the first signature keeps its own plan and executable
  assert step.attempts[-1].signature.find("510") >= 0


# -- 7. the smaller ones -------------------------------------------------------------------

def test_exhausted_error_is_a_guard_error_and_pickles_with_its_report(tmp_path):
  step = hbm_guard.guarded_jit(sgd_step, state_argnums=0, capacity="1KiB",
                               report_dir=str(tmp_path))
  with pytest.raises(hbm_guard.LadderExhaustedError) as info:
    step(W, X)
  err = info.value
  assert isinstance(err, hbm_guard.HbmGuardError)
  again = pickle.loads(pickle.dumps(err))
  assert again.report_path == err.report_path and os.path.exists(again.report_path)
  assert len(again.attempts) == len(err.attempts) >= 1
  assert again.attempts[0].record == err.attempts[0].record


@pytest.mark.parametrize("ladder, words", [
    ([{"name": "layer_remat", "kind": "remat", "polices": ["nothing_saveable"]}], "polices"),
    ([{"kind": "donate"}], "name"),
    ([{"name": "r", "kind": "remat", "policies": "nothing_saveable"}], "policies"),
    ([{"name": "r", "kind": "remat", "policies": ["no_such_policy"]}], "no_such_policy"),
    ([{"name": "f", "kind": "compiler_options", "options": [1, 2]}], "options"),
    ([{"name": "d", "kind": "dtype"}], "dtype"),
    ([42], "object"),
    ({"name": "donate"}, "list"),
])
def test_malformed_ladders_are_invalid_ladder_errors(ladder, words):
  with pytest.raises(hbm_guard.InvalidLadderError, match=words):
    hbm_guard.load_ladder(ladder)


def test_malformed_ladder_files_are_invalid_ladder_errors(tmp_path):
  bad = tmp_path / "ladder.json"
  bad.write_text("{not json")
  with pytest.raises(hbm_guard.InvalidLadderError):
    hbm_guard.guarded_jit(sgd_step, ladder=str(bad))
  with pytest.raises(hbm_guard.InvalidLadderError):
    hbm_guard.guarded_jit(sgd_step, ladder=str(tmp_path / "missing.json"))


@pytest.mark.parametrize("kwargs", [dict(capacity=-1), dict(capacity=0), dict(capacity=True),
                                    dict(capacity=1.5), dict(max_attempts=0),
                                    dict(max_attempts=True), dict(max_class="all")])
def test_bad_options_are_refused_at_construction(kwargs):
  with pytest.raises(ValueError):
    hbm_guard.guarded_jit(sgd_step, **kwargs)


def test_out_of_range_state_argnums_is_a_clear_error():
  with pytest.raises(ValueError, match="state_argnums"):
    hbm_guard.guarded_jit(sgd_step, state_argnums=5)(W, X)


def test_a_report_that_could_not_be_written_is_never_named(tmp_path):
  blocker = tmp_path / "not_a_dir"
  blocker.write_text("")
  step = hbm_guard.guarded_jit(sgd_step, capacity="1KiB", report_dir=str(blocker))
  with pytest.raises(hbm_guard.LadderExhaustedError) as info:
    step(W, X)
  assert info.value.report_path is None and step.report_path is None
  assert "could not be written" in str(info.value) and str(blocker) not in str(info.value)


def test_each_attempt_is_in_the_report_before_it_is_logged(tmp_path):
  seen = []

  class Check(std_logging.Handler):
    def emit(self, rec):
      msg = rec.getMessage()
      if "attempt #" in msg and "oom" in msg:
        path = step.report_path
        seen.append(path is not None and len(json.load(open(path))["attempts"]) >= 1)

  handler = Check()
  absl_logging.get_absl_logger().addHandler(handler)
  old = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.DEBUG)  # attempt lines are detail: -v 1
  try:
    step = hbm_guard.guarded_jit(sgd_step, capacity="1KiB", report_dir=str(tmp_path))
    with pytest.raises(hbm_guard.LadderExhaustedError):
      step(W, X)
  finally:
    absl_logging.get_absl_logger().removeHandler(handler)
    absl_logging.set_verbosity(old)
  assert seen and all(seen)


def test_guarded_jit_decorates_methods():
  class Model:
    def __init__(self, scale):
      self.scale = scale

    def __hash__(self):
      return hash(self.scale)

    def __eq__(self, other):
      return isinstance(other, Model) and other.scale == self.scale

    @hbm_guard.guarded_jit(static_argnums=0)
    def apply(self, x):
      return x * self.scale

  m = Model(3.0)
  np.testing.assert_allclose(m.apply(jnp.ones(3)), 3.0 * np.ones(3))
  assert Model.apply.__name__ == "apply" and m.apply.lower(jnp.ones(3)).compile()
  assert m.apply.eval_shape(jnp.ones(3)).shape == (3,)  # bound: the instance goes first
  assert m.apply.trace(jnp.ones(3)).lower()
  assert m.apply.fit(jnp.ones(3)) == hbm_guard.Plan()


@pytest.mark.real_compiler
def test_a_method_whose_self_is_not_static_gets_jaxs_own_error():
  """As under jax.jit: the instance is not an array, and jax's message says so (it was
  numpy's 'dtype object' from inside the fit, for a target)."""
  class Trainer:
    @hbm_guard.guarded_jit(state_argnums=1, target="v5e:1x1", capacity="1MiB",
                           plan_cache=False, progress=False)
    def step(self, state, x):
      return state + x.sum(), x

  with pytest.raises(TypeError, match="static_argnums"):
    Trainer().step.fit(jnp.ones(()), jnp.ones(4))


def test_skip_reasons_are_typed():
  facts = rungs_lib.StepFacts(platform="cpu", num_devices=1, plan_reads=frozenset(),
                      state_argnums=(), state_bytes=0, batch_size=None)
  kinds = {r.name: rung_specs.applies(r, hbm_guard.Plan(), facts, "exact") for r in hbm_guard.load_ladder()}
  assert kinds["bf16"][0] is rungs_lib.SkipKind.WITHHELD
  assert kinds["layer_remat"][0] is rungs_lib.SkipKind.NOT_PLAN_AWARE
  assert kinds["donate"][0] is rungs_lib.SkipKind.NOT_APPLICABLE


def test_report_of_a_file_that_is_not_a_report_is_a_usage_error(tmp_path, capsys):
  from hbm_guard._src.cli import cli
  other = tmp_path / "other.json"
  other.write_text(json.dumps({"hello": 1}))
  assert cli.main(["report", str(other)]) == 2
  assert "not an hbm_guard report" in capsys.readouterr().err


# -- 9. libtpu held by another process -----------------------------------------------------

_HOLD = """
import sys, time
from hbm_guard._src.backends import targets
try:
  targets.Target.parse("v5e:1x1").devices()
  print("held", flush=True)
except Exception as e:
  print("busy", flush=True)
time.sleep(60)
"""
_TRY = """
from hbm_guard._src.backends import targets
try:
  targets.Target.parse("v5e:1x1").devices()
  print("OK")
except Exception as e:
  print(type(e).__name__, e)
"""


@pytest.mark.real_compiler
def test_libtpu_held_by_another_process_says_so():
  env = {k: v for k, v in os.environ.items() if k != "ALLOW_MULTIPLE_LIBTPU_LOAD"}
  root = str(paths.ROOT)
  holder = subprocess.Popen([sys.executable, "-c", _HOLD], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env, cwd=root)
  try:
    assert holder.stdout.readline().strip() in ("held", "busy")
    out = subprocess.run([sys.executable, "-c", _TRY], capture_output=True, text=True,
                         env=env, cwd=root, timeout=120).stdout
  finally:
    holder.kill()
    holder.wait()
  assert out.startswith("TpuCompilerBusyError"), out
  assert "ALLOW_MULTIPLE_LIBTPU_LOAD=1" in out and "Install the 'tpu' extra" not in out


def test_no_libtpu_start_up_noise_on_a_cpu_host():
  root = str(paths.ROOT)
  code = ("from hbm_guard._src.backends import targets; targets.quiet_libtpu_on_cpu_host(); "
          "import jax; jax.devices()")
  env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env=env, cwd=root, timeout=120)
  assert proc.returncode == 0, proc.stderr
  assert "TPU_ACCELERATOR_TYPE" not in proc.stderr and "hostname" not in proc.stderr
