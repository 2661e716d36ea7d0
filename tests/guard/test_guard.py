"""guarded_jit on the local CPU: a drop-in for jax.jit, and the ladder under capacity=."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import flagsaver

import hbm_guard
from hbm_guard._src.plans import rung_specs
from hbm_guard._src.record import diagnose as D
from hbm_guard._src.record import record as R
from tests import paths


def sgd_step(w, x):
  g = jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
  return w - 0.1 * g, g.sum()


W = jnp.full((1024, 1024), 0.01)
X = jnp.ones((64, 1024))


def test_same_results_as_jit_and_decorator_forms():
  ref = jax.jit(sgd_step)(W, X)
  for step in (hbm_guard.guarded_jit(sgd_step), hbm_guard.guarded_jit()(sgd_step)):
    out = step(W, X)
    np.testing.assert_array_equal(out[0], ref[0])
    assert step.plan == hbm_guard.Plan() and len(step.attempts) == 1

  @hbm_guard.guarded_jit(static_argnames="n")
  def power(x, n):
    return x ** n
  assert float(power(jnp.float32(2.0), n=3)) == 8.0
  assert float(power(jnp.float32(2.0), n=4)) == 16.0
  assert power.lower(jnp.float32(2.0), n=3).compile()(jnp.float32(3.0)) == 27.0
  assert power.__name__ == "power"


def test_later_calls_do_not_retrace_or_recompile():
  traces = []

  def step(x):
    traces.append(1)
    return x * 2

  g = hbm_guard.guarded_jit(step)
  for _ in range(5):
    g(jnp.ones(4))
  n = len(traces)
  for _ in range(20):
    g(jnp.ones(4))
  assert len(traces) == n and len(g.attempts) == 1
  g(jnp.ones(8))  # a new signature: one more fit
  assert len(g.attempts) == 2


def test_non_oom_errors_pass_through_unchanged():
  def bad(x):
    return x @ jnp.ones((3, 3))

  with pytest.raises(TypeError) as want:
    jax.jit(bad)(jnp.ones((4, 4)))
  with pytest.raises(TypeError) as got:
    hbm_guard.guarded_jit(bad)(jnp.ones((4, 4)))
  assert str(got.value) == str(want.value)

  def raises(x):
    raise KeyError("mine")
  with pytest.raises(KeyError, match="mine"):
    hbm_guard.guarded_jit(raises)(jnp.ones(2))


def test_donation_makes_it_fit_by_the_compilers_numbers(tmp_path):
  plain = hbm_guard._src.backends.compile.memory_of(jax.jit(sgd_step).lower(W, X).compile())
  capacity = plain["peak"] - W.nbytes // 2  # donating W saves W.nbytes
  step = hbm_guard.guarded_jit(sgd_step, state_argnums=0, capacity=capacity,
                               report_dir=str(tmp_path))
  w = jnp.array(W)
  out = step(w, X)
  first, last = step.attempts[0], step.attempts[-1]
  assert first.outcome == "oom" and first.record.kind == R.BUDGET
  assert first.memory["peak"] > capacity >= last.memory["peak"]
  assert last.memory["alias"] == W.nbytes  # the compiler aliases the donated state
  assert step.plan.donate_argnums == (0,) and len(step.attempts) == 2
  np.testing.assert_allclose(out[0], jax.jit(sgd_step)(W, X)[0])
  report = json.loads(open(step.report_path).read())
  assert report["status"] == "fits" and report["compiles"] == 2


def test_no_donation_without_state_argnums():
  plain = hbm_guard._src.backends.compile.memory_of(jax.jit(sgd_step).lower(W, X).compile())
  step = hbm_guard.guarded_jit(sgd_step, capacity=plain["peak"] - 1, report_dir="/tmp/hg")
  with pytest.raises(hbm_guard.LadderExhaustedError):
    step(W, X)
  skipped = {s.rung: s.reason for s in step.attempts[0].skipped}
  assert "state_argnums" in skipped["donate"]


def test_state_that_is_not_returned_is_never_donated():
  def reads_only(w, x):
    return (x @ w).sum()
  step = hbm_guard.guarded_jit(reads_only, state_argnums=0, capacity="1KiB",
                               report_dir="/tmp/hg")
  with pytest.raises(hbm_guard.LadderExhaustedError):
    step(W, X)
  assert all(a.plan.donate_argnums == () for a in step.attempts)


def test_exhausted_ladder_raises_with_every_attempt_and_a_report(tmp_path):
  step = hbm_guard.guarded_jit(sgd_step, state_argnums=0, capacity="1MiB",
                               report_dir=str(tmp_path))
  with pytest.raises(jax.errors.JaxRuntimeError) as info:
    step(W, X)
  err = info.value
  assert isinstance(err, hbm_guard.LadderExhaustedError)
  assert "\n" not in str(err) and err.report_path in str(err)
  assert [a.outcome for a in err.attempts] == ["oom"] * len(err.attempts)
  report = json.loads(open(err.report_path).read())
  assert report["schema"] == "hbm_guard.report/1" and report["status"] == "exhausted"
  # One compile: the planner probed the donated plan, saw it cannot fit, and stopped.
  assert len(report["attempts"]) == len(err.attempts) == 1
  probes = report["attempts"][0]["planning"]["probes"]
  assert probes and probes[0]["plan"] == "donate" and probes[0]["need_bytes"] > 1024
  assert report["next_steps"], "a person gets the diagnosis' advice"
  assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_behaviour_rung_is_withheld_unless_allowed(tmp_path):
  def step(w, x):
    dtype = hbm_guard.compute_dtype(jnp.float32)

    def loss(w):
      h = x.astype(dtype)
      for _ in range(3):
        h = jnp.tanh(h @ w.astype(dtype))
      return (h.astype(jnp.float32) ** 2).mean()
    return jax.grad(loss)(w)

  w, x = jnp.ones((256, 256)), jnp.ones((2048, 256))
  plain = hbm_guard._src.backends.compile.memory_of(jax.jit(step).lower(w, x).compile())
  only_bf16 = [{"name": "bf16", "kind": "dtype", "class": "behaviour", "section": "S3.A",
                "dtype": "bfloat16"}]
  cap = plain["peak"] - plain["temp"] // 4
  strict = hbm_guard.guarded_jit(step, capacity=cap, ladder=only_bf16, report_dir=str(tmp_path))
  with pytest.raises(hbm_guard.LadderExhaustedError):
    strict(w, x)
  assert strict.attempts[0].skipped[0].reason.startswith("withheld")
  report = json.loads(open(strict.report_path).read())
  assert report["withheld_rungs"] == ["bf16"]
  assert all(a.plan.compute_dtype is None for a in strict.attempts)  # never compiled


def test_default_ladder_is_data_and_shares_names_with_diagnose():
  names = [r.name for r in hbm_guard.load_ladder()]
  for rung in (D.DONATE, D.LAYER_REMAT, D.MICROBATCH, D.OFFLOAD_OPTIMIZER, D.RESHARD_FSDP,
               D.XLA_REMAT_PEAK_PRIORITY, D.XLA_REMAT_AGGRESSIVE, D.XLA_PRE_FUSION_REMAT,
               D.BF16):
    assert rung in names
  classes = {r.name: r.semantic_class for r in hbm_guard.load_ladder()}
  assert classes["bf16"] == "behaviour" and classes["donate"] == "exact"
  with pytest.raises(hbm_guard.InvalidLadderError):
    hbm_guard.load_ladder([{"name": "x", "kind": "teleport"}])
  with pytest.raises(hbm_guard.InvalidLadderError):
    hbm_guard.load_ladder([{"name": "x", "kind": "dtype", "class": "whatever"}])


def test_microbatch_count_comes_from_the_numbers():
  rec = R.E1000Record(kind=R.COMPILE_HBM, used_bytes=1100, capacity_bytes=1000)
  # 100 fixed + 1000 temporaries at k=1: room 850 -> k >= 1000/850 -> 2 (divides 64).
  assert rung_specs.microbatch_count(64, 1, rec, temp_bytes=1000)[0] == 2
  rec = R.E1000Record(kind=R.COMPILE_HBM, used_bytes=4100, capacity_bytes=1000)
  # 4000 temporaries: k >= 4000/850 = 4.7 -> 5, 6, 7 do not divide 64; 8 does.
  assert rung_specs.microbatch_count(64, 1, rec, temp_bytes=4000)[0] == 8
  # The rest of the step alone is over capacity: no split helps.
  rec = R.E1000Record(kind=R.COMPILE_HBM, used_bytes=3000, capacity_bytes=1000)
  assert rung_specs.microbatch_count(64, 1, rec, temp_bytes=100)[0] is None
  assert rung_specs.microbatch_count(7, 7, rec, temp_bytes=2900)[0] is None  # splits no further


@flagsaver.flagsaver(hbm_guard_auto_fallback=True, hbm_guard_max_class="numerics",
                     hbm_guard_capacity="16GiB", hbm_guard_target=None)
def test_flags_feed_guard_options():
  from hbm_guard import flags as hbm_flags
  opts = hbm_flags.guard_options()
  assert opts["max_class"] == "numerics" and opts["capacity"] == "16GiB"
  step = hbm_guard.guarded_jit(sgd_step, **opts)
  step(W, X)
  assert step.plan == hbm_guard.Plan()


def test_each_option_default_is_written_once_in_guard_options():
  """#58 item 4: guarded_jit's keywords and the absl flags take their defaults, help and
  bounds from GuardOptions' fields; a flag exists for each field that declares one."""
  import dataclasses
  import inspect
  from absl import flags
  from hbm_guard import flags as hbm_flags
  from hbm_guard._src.backends import options as options_lib
  fields = {f.name: f for f in dataclasses.fields(hbm_guard.GuardOptions)}
  keywords = {name: p.default for name, p in
              inspect.signature(hbm_guard.guarded_jit).parameters.items()
              if name in fields and p.kind is p.KEYWORD_ONLY}
  assert len(keywords) >= 13
  for name, default in keywords.items():
    assert default.value is fields[name].default, name
  flagged = {name for name, f in fields.items() if "flag" in f.metadata}
  assert set(hbm_flags._HOLDERS) == flagged and len(flagged) == 16
  for name in flagged:
    flag = flags.FLAGS[f"hbm_guard_{name}"]
    assert flag.default == options_lib.flag_default(fields[name]), name
    assert flag.help.endswith(fields[name].metadata["flag"].help)  # enum: "<a|b|c>: " first
  assert flags.FLAGS["hbm_guard_auto_fallback"].default is False  # a binary opts in by flag
  assert flags.FLAGS["hbm_guard_headroom"].default == hbm_guard.GuardOptions().headroom
  with pytest.raises(flags.IllegalFlagValueError):
    flags.FLAGS["hbm_guard_max_attempts"].parse("0")  # the bound travels with the field
  assert repr(keywords["max_class"]) == "'exact'"  # help() shows the value a user types


@pytest.fixture(autouse=True, scope="module")
def _parse_flags():
  from absl import flags
  from hbm_guard import flags as _  # noqa: F401  registers --hbm_guard_*
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def test_local_resharding_over_four_devices_by_the_compilers_numbers(tmp_path):
  """In a subprocess: the device count is fixed when jax starts."""
  import subprocess
  import sys
  env = dict(os.environ, HG_REPORT_DIR=str(tmp_path), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "tests.helpers.multidevice_reshard_main"],
                        capture_output=True, text=True, env=env, check=False,
                        cwd=str(paths.ROOT))
  assert proc.returncode == 0, proc.stderr[-3000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  assert got["devices"] == 4
  assert got["attempts"] == ["oom", "fits"]  # one compile to find it, none wasted
  assert got["plan"]["shard_state"] and got["plan"]["donate_argnums"] == [0]
  # Each device holds a quarter of the 4 MiB state, by the compiler's own figure.
  assert got["final_argument"] * 3 < got["plain_argument"]
  assert got["final_peak"] <= got["capacity"]
  assert got["w_spec"] == "P('fsdp', None)"
  assert got["same_1"] and got["same_2"]


def test_microbatch_count_fits_a_line_through_earlier_attempts():
  M = 2**20
  # Measured 100 MiB at k=1 and 97.7 at k=2: T = 4.6, F = 95.4 -- more than 0.95 * 96 MiB
  # on its own, so no microbatch count can fit (the guard moves on instead of trying).
  rec = R.E1000Record(kind=R.BUDGET, used_bytes=round(97.7 * M), capacity_bytes=96 * M)
  k, why = rung_specs.microbatch_count(64, 2, rec, temp_bytes=None, measured=[(1, 100 * M)])
  assert k is None and "cannot close the gap" in why
  # 100 at k=1, 60 at k=2: T = 80, F = 20; room 0.95 * 40 - 20 = 18 -> k >= 4.4 -> 8.
  rec2 = R.E1000Record(kind=R.BUDGET, used_bytes=60 * M, capacity_bytes=40 * M)
  k, why = rung_specs.microbatch_count(64, 2, rec2, temp_bytes=None, measured=[(1, 100 * M)])
  assert k == 8 and "fitted" in why


def test_user_errors_keep_their_traceback_free_of_guard_frames():
  import traceback

  def bad(x):
    return x @ jnp.ones((3, 3))

  def frames(f):
    try:
      f(jnp.ones((4, 4)))
    except TypeError as e:
      return [fr.filename for fr in traceback.extract_tb(e.__traceback__)]
    raise AssertionError("no error")

  guarded = frames(hbm_guard.guarded_jit(bad))
  assert not [f for f in guarded if "/hbm_guard/" in f]  # hidden like jax's own frames
  assert [f for f in guarded if f == __file__]  # the user's frames stay


def test_fit_climbs_without_running_and_the_next_call_reuses_it(tmp_path):
  plain = hbm_guard._src.backends.compile.memory_of(jax.jit(sgd_step).lower(W, X).compile())
  step = hbm_guard.guarded_jit(sgd_step, state_argnums=0,
                               capacity=plain["peak"] - W.nbytes // 2, report_dir=str(tmp_path))
  plan = step.fit(W, X)
  assert plan.donate_argnums == (0,) and len(step.attempts) == 2
  assert not W.is_deleted()  # nothing ran, nothing was donated
  out = step(jnp.array(W), X)
  assert len(step.attempts) == 2  # the call used the fitted executable
  assert step.eval_shape(W, X)[0].shape == W.shape
  np.testing.assert_allclose(out[0], jax.jit(sgd_step)(W, X)[0])


@flagsaver.flagsaver(hbm_guard_max_class="numerics", hbm_guard_capacity="16GiB",
                     hbm_guard_max_fit_seconds=90.0, hbm_guard_progress=False,
                     hbm_guard_plan_cache_retry_exhausted=True,
                     hbm_guard_auto_plan_aware=False)
def test_flags_make_one_checked_options_value():
  from hbm_guard import flags as hbm_flags
  opts = hbm_flags.options({"max_attempts": 3}, state_argnums=0)
  assert isinstance(opts, hbm_guard.GuardOptions)
  assert (opts.max_class, opts.capacity, opts.max_attempts) == ("numerics", 16 << 30, 3)
  assert opts.max_fit_seconds == 90.0 and not opts.progress and opts.plan_cache_retry_exhausted
  assert opts.auto_plan_aware is False
  assert opts.state_argnums == (0,)
  step = hbm_guard.guarded_jit(sgd_step, options=opts)
  assert step.options is opts
  step(jnp.array(W), X)
  with flagsaver.flagsaver(hbm_guard_max_class="exact"):
    assert hbm_flags.options().max_class == "exact"  # read when called, not at import


def mlp_step(params, x):
  def loss(p):
    h = x
    for w in p:
      h = jnp.tanh(h @ w)
    return (h ** 2).mean()
  value, g = jax.value_and_grad(loss)(params)
  return [w - 0.1 * gw for w, gw in zip(params, g)], value


@pytest.mark.parametrize("breakdown", [False, True])
def test_a_plan_probed_then_chosen_runs_the_executable_its_probe_compiled(tmp_path, breakdown,
                                                                          monkeypatch):
  """On this host a probe is a full compile: the plan the fit chooses runs that executable,
  not a second compile of it (the plan comes back with its rungs named in another order,
  and its jit object was keyed by that order: each fit compiled its plan twice). With the
  memory breakdown on, a plan that does not fit is compiled again with the dump's options
  (which key another executable); the plan kept never is: the first call compiles nothing."""
  from jax._src import dispatch, monitoring  # pylint: disable=import-outside-toplevel
  compiles = []

  def on_event(event, seconds, **kwargs):
    del seconds, kwargs
    if event == dispatch.BACKEND_COMPILE_EVENT:
      compiles.append(event)

  from hbm_guard._src.memory import memory_dump  # pylint: disable=import-outside-toplevel
  dumped = []
  again = memory_dump.compile_again
  monkeypatch.setattr(memory_dump, "compile_again", lambda *a: (dumped.append(1), again(*a))[1])
  params = [jnp.full((128, 128), 0.01) for _ in range(4)]
  x = jnp.ones((4096, 128))
  step = hbm_guard.guarded_jit(mlp_step, state_argnums=0, capacity="9MiB", max_class="numerics",
                               report_dir=str(tmp_path), plan_cache=False,
                               memory_breakdown=breakdown)
  monitoring.register_event_duration_secs_listener(on_event)
  try:
    plan = step.fit(params, x)
    fit_compiles = len(compiles)
    step(params, x)  # the first call runs it: no compile either
  finally:
    monitoring.unregister_event_duration_listener(on_event)
  probes = [p.plan for a in step.attempts if a.planning for p in a.planning.probes]
  program = lambda p: dataclasses.replace(p, rungs=())  # noqa: E731
  assert plan.microbatches > 1 and len(step.attempts) == 2
  assert program(plan) in {program(p) for p in probes}
  # one compile per program the fit tried (the plain step, each probe, prefetched or read)
  tried = len({program(key[0]) for key in step._step._jits})
  assert fit_compiles == tried + len(dumped)
  assert len(compiles) == fit_compiles
  if breakdown:  # the step as written once more, for its dump; the plan kept never
    assert len(dumped) == 1 and step.attempts[0].breakdown is not None
    assert step.attempts[-1].breakdown is None
  else:
    assert not dumped


@pytest.mark.parametrize("value", [
    jnp.ones((3, 4)), jnp.full((2,), 0.1), jnp.ones((2,), jnp.bfloat16), jnp.int32(3),
    jax.random.key(0), np.ones((3,), np.float32), 1.0, 2, True])
def test_a_signature_is_the_same_from_an_array_its_shape_struct_and_its_tracer(value):
  """Dispatch keys a concrete array from its own attributes (fast): the key must be the
  one `.fit` computes from abstract arguments and the traced step from its tracers."""
  from hbm_guard._src.backends import trace as T  # pylint: disable=import-outside-toplevel
  aval = jax.typeof(value)
  struct = jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)
  traced = []
  jax.jit(lambda t: traced.append(T.signature((t,), {})) or 0)(value)
  assert T.signature((value,), {}) == T.signature((struct,), {}) == traced[0]
  other = jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=not aval.weak_type)
  assert T.signature((value,), {}) != T.signature((other,), {})


@pytest.mark.parametrize("decorate", [False, True])
def test_a_keyword_given_beside_options_replaces_its_field_even_at_its_default(decorate):
  """Before, a keyword equal to guarded_jit's default was dropped beside `options=`: the
  user asked for the stricter class and 8 attempts, and ran with 'numerics' and 3."""
  opts = hbm_guard.GuardOptions(max_class="numerics", max_attempts=3, capacity="1MiB")
  kw = dict(options=opts, max_class="exact", max_attempts=8)
  step = (hbm_guard.guarded_jit(**kw)(sgd_step) if decorate
          else hbm_guard.guarded_jit(sgd_step, **kw))
  assert (step.options.max_class, step.options.max_attempts) == ("exact", 8)
  assert step.options.capacity == 1 << 20  # what was not given stays the options'
  plain = hbm_guard.guarded_jit(sgd_step, options=opts)
  assert (plain.options.max_class, plain.options.max_attempts) == ("numerics", 3)
