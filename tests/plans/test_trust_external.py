"""Issue #16 (Trust II): plans from others are data, hostile inputs stay harmless, exact
figures are trusted. Each test failed on the code before the fix."""

import json
import os
import random
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hbm_guard
from hbm_guard._src.backends import compile as C
from hbm_guard._src.cli import cli
from hbm_guard._src.cli import report_html
from hbm_guard._src.files import plan_cache as PC
from hbm_guard._src.files import report as report_lib
from hbm_guard._src.plans import rungs as rungs_lib
from hbm_guard._src.record import record as R


def sgd_step(w, x):
  g = jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
  return w - 0.1 * g, g.sum()


def dtype_step(w, x):  # follows the plan's compute dtype, as a bf16-capable model does
  dt = hbm_guard.compute_dtype(jnp.float32)
  g = jax.grad(lambda w: jnp.tanh(x.astype(dt) @ w.astype(dt)).astype(jnp.float32).sum())(w)
  return w - 0.1 * g, g.sum()


W = jnp.full((512, 512), 0.01)
X = jnp.ones((64, 512))


def _peaks(step=sgd_step):
  plain = C.memory_of(jax.jit(step).lower(W, X).compile())["peak"]
  donated = C.memory_of(jax.jit(step, donate_argnums=0).lower(W, X).compile())["peak"]
  return plain, donated


def _cached_entry(tmp_path, step=sgd_step, **opts):
  """Runs a guard once so its cache entry exists; returns (cache dir, entry path)."""
  cache = tmp_path / "cache"
  g = hbm_guard.guarded_jit(step, state_argnums=0, plan_cache=str(cache),
                            report_dir=str(tmp_path / "r"), **opts)
  g(jnp.array(W), X)
  (entry,) = [p for p in cache.iterdir() if p.suffix == ".json"]
  return cache, entry


def _edit(entry, **plan_changes):
  data = json.loads(entry.read_text())
  data["plan"].update(plan_changes)
  entry.write_text(json.dumps(data))


# -- 1. a crafted entry or plan= can do nothing the options do not allow ------------------

@pytest.mark.parametrize("changes", [
    dict(compute_dtype="bfloat16"), dict(compute_dtype="int8"), dict(microbatches=4),
    dict(compiler_options={"xla_tpu_max_hbm_size_mib": -7}),
    dict(compiler_options={"xla_no_such_option": 1}), dict(donate_argnums=[1]),
])
def test_a_crafted_cache_entry_is_a_miss(tmp_path, changes):
  cache, entry = _cached_entry(tmp_path, dtype_step)
  _edit(entry, **changes)
  g = hbm_guard.guarded_jit(dtype_step, state_argnums=0, plan_cache=str(cache),
                            report_dir=str(tmp_path / "r"))
  x = jnp.ones((64, 512))
  out = g(jnp.array(W), x)
  assert g.plan == hbm_guard.Plan() and not x.is_deleted()
  np.testing.assert_array_equal(out[0], jax.jit(dtype_step)(W, X)[0])  # f32, unchanged


def test_a_cache_entry_cannot_make_the_compiler_write_files(tmp_path):
  dump = tmp_path / "dump"
  cache, entry = _cached_entry(tmp_path)
  _edit(entry, compiler_options={"xla_dump_to": str(dump)})
  hbm_guard.guarded_jit(sgd_step, state_argnums=0, plan_cache=str(cache))(jnp.array(W), X)
  assert not dump.exists()


def test_an_entry_copied_under_another_key_is_a_miss(tmp_path):
  cache, entry = _cached_entry(tmp_path)
  data = json.loads(entry.read_text())
  data["parts"]["capacity"] = 12345  # the key no longer covers what the entry says
  data["status"] = "exhausted"
  entry.write_text(json.dumps(data))
  g = hbm_guard.guarded_jit(sgd_step, state_argnums=0, plan_cache=str(cache))
  g(jnp.array(W), X)  # no LadderExhaustedError: the entry is not believed
  assert [a.outcome for a in g.attempts] == ["fits"]


def test_an_exhaustion_of_unknown_or_great_age_is_not_believed(tmp_path):
  plain, donated = _peaks()
  cache, entry = _cached_entry(tmp_path, capacity=donated)  # fits donated
  for written_at in (None, time.time() - 30 * 86400, time.time() + 86400):
    data = json.loads(entry.read_text())
    data.update(status="exhausted", written_at=written_at)
    data["attempts"] = [{"plan": hbm_guard.Plan().to_dict(), "outcome": "oom"}]
    entry.write_text(json.dumps(data))
    g = hbm_guard.guarded_jit(sgd_step, state_argnums=0, capacity=donated,
                              plan_cache=str(cache), report_dir=str(tmp_path / "r"))
    g(jnp.array(W), X)
    assert g.plan.donate_argnums == (0,)


@pytest.mark.parametrize("plan, error", [
    (dict(compute_dtype="bfloat16"), hbm_guard.UntrustedPlanError),
    (dict(microbatches=4), hbm_guard.UntrustedPlanError),
    (dict(donate_argnums=[1]), hbm_guard.UntrustedPlanError),
    (dict(compiler_options={"xla_dump_to": "/tmp/x"}), hbm_guard.UntrustedPlanError),
    (dict(microbatch=4), hbm_guard.InvalidPlanError),  # a typo is not plain jit
    (dict(microbatches=0), hbm_guard.InvalidPlanError),
    (dict(microbatches="4"), hbm_guard.InvalidPlanError),
    (dict(shard_state="yes"), hbm_guard.InvalidPlanError),
    (dict(donate_argnums="0"), hbm_guard.InvalidPlanError),
])
def test_a_bad_plan_is_a_clear_error_at_construction(plan, error, tmp_path):
  f = tmp_path / "plan.json"
  f.write_text(json.dumps(plan))
  for given in (plan, str(f)):
    with pytest.raises(error):
      hbm_guard.guarded_jit(sgd_step, state_argnums=0, auto_fallback=False, plan=given)


def test_plan_within_the_options_is_accepted_and_a_report_gives_its_final_plan(tmp_path):
  ok = hbm_guard.guarded_jit(sgd_step, state_argnums=0, max_class="numerics",
                             plan={"donate_argnums": [0], "microbatches": 1})
  assert ok.plan.donate_argnums == (0,)
  report = tmp_path / "report.json"
  report.write_text(json.dumps({"schema": report_lib.SCHEMA, "attempts": [],
                                "final_plan": {"donate_argnums": [0]}}))
  assert hbm_guard.guarded_jit(sgd_step, state_argnums=0, plan=str(report)).plan == \
      hbm_guard.Plan(donate_argnums=(0,))


# -- 2. a damaged entry never raises or hangs ----------------------------------------------

def _damaged_entries(valid: dict):
  deep = "[" * 200_000 + "]" * 200_000
  plan_edits = [[], "x", None, {"microbatches": "4"}, {"microbatches": 0},
                {"microbatches": 10**30}, {"microbatches": 2.5}, {"donate_argnums": "0"},
                {"donate_argnums": [True]}, {"compiler_options": []},
                {"compiler_options": {"a": [1]}}, {"rungs": "abc"}, {"rungs": [1]},
                {"remat_policy": 5}, {"compute_dtype": {"x": 1}}, {"shard_state": "no"},
                {"unknown": 1}, {"offload_optimizer": 1}]
  for edit in plan_edits:
    d = json.loads(json.dumps(valid))
    d["plan"] = edit if not isinstance(edit, dict) else {**d["plan"], **edit}
    yield json.dumps(d)
  for key, value in [("status", "maybe"), ("attempts", "x"), ("attempts", [1]),
                     ("parts", []), ("written_at", "yesterday"), ("schema", None)]:
    yield json.dumps({**valid, key: value})
  yield deep
  yield '{"schema": "hbm_guard.plan_cache/1", "plan": ' + deep + "}"
  yield "\x00\xff garbage"
  yield ""


def test_damaged_cache_entries_are_misses_never_errors(tmp_path):
  cache, entry = _cached_entry(tmp_path)
  valid = json.loads(entry.read_text())
  g_ref = jax.jit(sgd_step)(W, X)
  for text in _damaged_entries(valid):
    entry.write_text(text, encoding="utf-8", errors="surrogateescape")
    t0 = time.perf_counter()
    g = hbm_guard.guarded_jit(sgd_step, state_argnums=0, plan_cache=str(cache))
    out = g(jnp.array(W), X)
    assert time.perf_counter() - t0 < 20, text[:80]
    np.testing.assert_array_equal(out[0], g_ref[0])


def test_links_fifos_devices_and_huge_files_are_not_read(tmp_path):
  cache = PC.PlanCache(str(tmp_path))
  key = PC.digest({"program": "p"})
  path = tmp_path / f"{key}.json"
  os.symlink("/dev/zero", path)
  assert cache.get(key) is None  # not followed: no read to MemoryError
  path.unlink()
  os.mkfifo(path)
  done = []
  t = threading.Thread(target=lambda: done.append(cache.get(key)), daemon=True)
  t.start()
  t.join(10)
  assert not t.is_alive() and done == [None]  # a FIFO nobody writes does not hang
  path.unlink()
  with open(path, "wb") as f:
    f.truncate(PC.MAX_ENTRY_BYTES + 1)
  assert cache.get(key) is None


def test_damaged_plan_files_are_clear_errors_never_crashes(tmp_path):
  valid = {"schema": PC.SCHEMA, "status": "fits", "plan": hbm_guard.Plan().to_dict()}
  path = tmp_path / "plan.json"
  for text in _damaged_entries(valid):
    data = None
    try:
      data = json.loads(text)
    except (ValueError, RecursionError):
      pass
    for content in ([text] + ([json.dumps(data["plan"])] if isinstance(data, dict)
                              and "plan" in data and len(text) < 10_000 else [])):
      path.write_text(content, encoding="utf-8", errors="surrogateescape")
      t0 = time.perf_counter()
      try:
        hbm_guard.guarded_jit(sgd_step, state_argnums=0, plan=str(path))
      except ValueError:  # InvalidPlanError, UntrustedPlanError, InvalidOptionError
        pass
      assert time.perf_counter() - t0 < 5, content[:80]
  os.remove(path)
  os.symlink("/dev/zero", path)
  with pytest.raises(hbm_guard.InvalidPlanError, match="cannot open|not a regular"):
    hbm_guard.guarded_jit(sgd_step, plan=str(path))


# -- 3. the report page escapes what it shows --------------------------------------------

_EVIL = "<script>alert(1)</script><img src=x onerror=alert(2)>"


def _evil_report():
  attempt = {"number": _EVIL, "seconds": _EVIL, "described": _EVIL, "outcome": "oom",
             "plan": {"donate_argnums": [0]}, "signature": _EVIL, "skipped": [],
             "diagnosis": {"scenario": _EVIL, "sections": [_EVIL], "summary": _EVIL,
                           "docs": "javascript:alert(3)", "advice": []},
             "record": {"used_bytes": 10, "breakdown": {}}}
  return {"schema": report_lib.SCHEMA, "function": _EVIL, "status": "fits",
          "attempts": [attempt], "capacity_bytes": 100, "compiles": 1,
          "final_plan": {"donate_argnums": [0], "__import__('os').system('x')": 1}}


def test_the_page_escapes_every_value_and_links_only_http(tmp_path):
  page = report_html.render(_evil_report())
  assert "<script>" not in page and "<img" not in page and "javascript:" not in page
  data = _evil_report()
  data["final_plan"] = {"donate_argnums": [0]}
  page = report_html.render(data)
  assert "plan=hbm_guard.Plan(donate_argnums=(0,))" in page
  assert "__import__" not in report_html.render(_evil_report())


def _slots(node):
  """Every (container, key) in a JSON value."""
  items = node.items() if isinstance(node, dict) else enumerate(node)
  for key, value in list(items):
    yield node, key
    if isinstance(value, (dict, list)):
      yield from _slots(value)


def test_damaged_reports_exit_2_with_one_line(tmp_path, capsys):
  rng = random.Random(0)
  good = _evil_report()
  good["final_plan"] = {"donate_argnums": [0]}
  junk = [None, 1, "x", [], {}, [1], {"a": 1}, -1, 1e308, True]
  path = tmp_path / "r.json"
  for i in range(300):
    data = json.loads(json.dumps(good))
    for _ in range(rng.randint(1, 4)):  # replace a random value somewhere with junk
      slots = list(_slots(data))
      node, key = rng.choice(slots)
      node[key] = rng.choice(junk)
    path.write_text(json.dumps(data))
    for argv in (["report", str(path)], ["report", str(path), "--html",
                                         str(tmp_path / "p.html")]):
      t0 = time.perf_counter()
      code = cli.main(argv)  # never an exception
      assert code in (0, 2) and time.perf_counter() - t0 < 5
  err = capsys.readouterr().err
  assert all(line.startswith("hbm-guard report:") for line in err.splitlines())


# -- 4. parsing: linear on every whitespace, absurd fields dropped, not the record --------

_HEAD = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
         "space hbm. Used 20.00G of 15.75G hbm. Exceeded hbm capacity by 4.25G.\n\n"
         "Total hbm usage >= 20.25G:\n")


def test_the_whitespace_table_is_every_character_isspace_accepts():
  assert set(R.UNICODE_WHITESPACE) == {chr(c) for c in range(0x110000) if chr(c).isspace()}


@pytest.mark.parametrize("ch", ["\u00a0", "\u3000", "\u2028", "\x1f", "\u2003", "\x85"])
def test_a_mib_of_unicode_whitespace_parses_in_well_under_a_second(ch):
  text = _HEAD + ("reserved" + ch * 4000 + "x\n") * 250  # ~1 MiB
  t0 = time.perf_counter()
  rec = hbm_guard.parse(text)
  assert time.perf_counter() - t0 < 1.0
  assert rec.used_bytes == 20 * 2**30


def test_absurd_and_negative_sizes_drop_the_field_not_the_record():
  rec = hbm_guard.parse(_HEAD.replace("Used 20.00G", "Used " + "9" * 400 + "G"))
  assert rec is not None and rec.used_bytes is None and rec.capacity_bytes == int(15.75 * 2**30)
  rec = hbm_guard.parse(_HEAD.replace("Used 20.00G", "Used -20.00G"))
  assert rec is not None and rec.used_bytes is None
  assert R.parse_size("9" * 400 + "G") is None and R.parse_size("1e999G") is None


# -- 5. options say what they do -----------------------------------------------------------

def _width_step(x, width):  # the output, so its peak, grows with the static width
  return jnp.tile(jnp.tanh(x), (1, width // 64))


def test_static_values_are_keyed_by_value_and_each_is_fitted():
  x = jnp.ones((64, 256))
  small = C.memory_of(jax.jit(_width_step, static_argnums=1).lower(x, 64).compile())["peak"]
  g = hbm_guard.guarded_jit(_width_step, static_argnums=1, capacity=small + 1024,
                            auto_fallback=False)
  g(x, 64)
  with pytest.raises(hbm_guard.CapacityExceededError):
    g(x, 4096)  # a second static value is a new signature, fitted against the capacity
  gn = hbm_guard.guarded_jit(_width_step, static_argnames="width", capacity=small + 1024,
                             auto_fallback=False)
  gn(x, width=64)
  with pytest.raises(hbm_guard.CapacityExceededError):
    gn(x, width=4096)


@pytest.mark.parametrize("kwargs, words", [
    (dict(auto_fallback="False"), "auto_fallback"), (dict(auto_fallback=0), "auto_fallback"),
    (dict(auto_plan_aware="no"), "auto_plan_aware"),
    (dict(state_argnums="0"), "state_argnums"), (dict(plan=5), "plan"),
    (dict(plan=[1]), "plan"), (dict(offload_filter="opt_state"), "offload_filter"),
    (dict(capacity="9" * 400 + "G"), "capacity"), (dict(target=5), "target"),
    (dict(max_class="all"), "max_class"), (dict(search="fast"), "search"),
    (dict(headroom=2.0), "headroom"), (dict(static_argnums="1"), "static_argnums"),
    (dict(plan_cache=3), "plan_cache"), (dict(plan_cache_retry_exhausted="yes"), "retry"),
])
def test_every_option_is_checked_once_with_a_message_naming_it(kwargs, words):
  with pytest.raises(ValueError, match=words):
    hbm_guard.guarded_jit(sgd_step, **kwargs)


def test_numpy_integers_are_capacities():
  g = hbm_guard.guarded_jit(sgd_step, capacity=np.int64(10**9))
  assert g.options.capacity == 10**9


def test_options_are_one_frozen_value_and_flags_produce_one():
  opts = hbm_guard.GuardOptions(capacity="1GiB", state_argnums=0)
  assert opts.capacity == 2**30 and opts.state_argnums == (0,)
  with pytest.raises(AttributeError):
    opts.capacity = 1  # frozen
  import dataclasses
  assert dataclasses.replace(opts, max_class="numerics").max_class == "numerics"
  with pytest.raises(ValueError, match="max_class"):
    dataclasses.replace(opts, max_class="nope")
  g = hbm_guard.guarded_jit(sgd_step, options=opts, max_attempts=3)
  assert g.options.capacity == 2**30 and g.options.max_attempts == 3


def test_a_step_name_is_not_a_path(tmp_path):
  def step(w, x):
    return sgd_step(w, x)
  step.__name__ = "../../escaped/step"
  g = hbm_guard.guarded_jit(step, capacity="1KiB", max_attempts=1,
                            report_dir=str(tmp_path / "reports"))
  with pytest.raises(hbm_guard.LadderExhaustedError):
    g(W, X)
  assert os.path.dirname(g.report_path) == str(tmp_path / "reports")
  assert not (tmp_path / "escaped").exists()


def test_temporaries_of_killed_writes_are_swept(tmp_path):
  stale = tmp_path / ".hbm_guard-abc.tmp"
  stale.write_text("{")
  os.utime(stale, (time.time() - 3600, time.time() - 3600))
  fresh = tmp_path / ".hbm_guard-def.tmp"
  fresh.write_text("{")  # another writer's, in flight
  report_lib.write_atomic(str(tmp_path / "r.json"), {"a": 1})
  assert not stale.exists() and fresh.exists()


# -- 6. an exact figure is held against the capacity itself -------------------------------

def test_an_exact_figure_within_the_headroom_still_fits(tmp_path):
  plain, donated = _peaks()
  capacity = donated + 1024  # donation fits, by less than the 5% headroom
  assert donated > rungs_lib.HEADROOM * capacity
  g = hbm_guard.guarded_jit(sgd_step, state_argnums=0, capacity=capacity,
                            report_dir=str(tmp_path))
  g(jnp.array(W), X)
  assert [a.outcome for a in g.attempts] == ["oom", "fits"]
  assert g.plan.donate_argnums == (0,)


# -- 7. what the README promises for each Python, CI runs -----------------------------------

def _mlp_block(w, x):
  return jnp.tanh(jnp.tanh(x @ w) @ w.T)


_MLP_BLOCK = hbm_guard.checkpoint(_mlp_block)  # wrapped once, at import


def _eight_blocks(ws, x):
  def loss(ws):
    h = x
    for w in ws:
      h = _MLP_BLOCK(w, h)
    return (h ** 2).mean()
  return jax.grad(loss)(ws)


@pytest.mark.real_compiler
def test_remat_after_a_plain_trace_fits_on_a_tpu_target_on_every_python(v5e_devices, tmp_path):
  ws = [jax.ShapeDtypeStruct((256, 1024), jnp.float32) for _ in range(8)]
  x = jax.ShapeDtypeStruct((16384, 256), jnp.float32)  # activations dominate the need
  jax.jit(_eight_blocks).trace(ws, x)  # a plain trace first
  plain = hbm_guard.guarded_jit(_eight_blocks, target="v5e:1x1", capacity="1GiB",
                                report_dir=str(tmp_path))
  plain.fit(ws, x)
  need = plain.attempts[-1].memory["peak"]
  g = hbm_guard.guarded_jit(_eight_blocks, target="v5e:1x1", capacity=int(0.6 * need),
                            report_dir=str(tmp_path))
  plan = g.fit(ws, x)
  assert plan.remat_policy is not None and g.attempts[-1].outcome == "fits"
  assert g.attempts[-1].memory["peak"] < 0.6 * need  # the compiler's own figure
