"""Issue #17, in part: a fit is priced in seconds, never runs past `max_fit_seconds`, and
says what it is doing on stderr once a step does not fit."""

import jax
import jax.numpy as jnp
import pytest

import hbm_guard
from hbm_guard._src.backends import compile as C
from hbm_guard._src.guard import budget as budget_lib


def sgd_step(w, x):
  g = jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
  return w - 0.1 * g, g.sum()


W = jnp.full((512, 512), 0.01)
X = jnp.ones((64, 512))


def _donated_peak():
  return C.memory_of(jax.jit(sgd_step, donate_argnums=0).lower(W, X).compile())["peak"]


def test_the_budget_refuses_what_it_cannot_pay_for_but_never_the_first_compile():
  b = budget_lib.Budget(limit=10.0)
  b.check(budget_lib.Spend.COMPILE)  # nothing spent yet: the first compile is allowed
  b.record(budget_lib.Spend.COMPILE, 30.0)  # it took 30 s (the limit is already passed)
  with pytest.raises(budget_lib.OutOfTime) as e:
    b.check(budget_lib.Spend.PROBE)  # a first probe costs like a compile
  assert e.value.kind is budget_lib.Spend.PROBE and e.value.estimate == 30.0
  assert budget_lib.Budget(limit=None).estimate(budget_lib.Spend.PROBE) == 0.0


def test_a_fit_stops_at_its_time_budget_says_so_and_remembers_nothing(tmp_path):
  cache = tmp_path / "cache"
  g = hbm_guard.guarded_jit(sgd_step, state_argnums=0, capacity=_donated_peak(),
                            max_fit_seconds=1e-3, plan_cache=str(cache),
                            report_dir=str(tmp_path / "r"))
  with pytest.raises(hbm_guard.FitTimeBudgetError, match="max_fit_seconds") as e:
    g(jnp.array(W), X)
  assert isinstance(e.value, hbm_guard.LadderExhaustedError)
  assert len(g.attempts) == 1 and e.value.report_path  # the first compile, then no more
  assert not list(cache.glob("*.json"))  # a budget stop is not "nothing fits"
  again = hbm_guard.guarded_jit(sgd_step, state_argnums=0, capacity=_donated_peak(),
                                plan_cache=str(cache), report_dir=str(tmp_path / "r"))
  again(jnp.array(W), X)
  assert [a.outcome for a in again.attempts] == ["oom", "fits"]


def test_progress_is_on_stderr_once_a_step_does_not_fit(tmp_path, capsys):
  hbm_guard.guarded_jit(sgd_step, state_argnums=0, report_dir=str(tmp_path))(jnp.array(W), X)
  assert capsys.readouterr().err == ""  # a step that fits says nothing
  g = hbm_guard.guarded_jit(sgd_step, state_argnums=0, capacity=_donated_peak(),
                            max_fit_seconds=600, report_dir=str(tmp_path))
  g(jnp.array(W), X)
  err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("hbm_guard")]
  assert err[0].startswith("hbm_guard: sgd_step: compile plain jit: does not fit, needs")
  assert any(" probe donate" in line for line in err)
  assert "compile donate: fits" in err[-1] and "of 600 s" in err[-1]
  quiet = hbm_guard.guarded_jit(sgd_step, state_argnums=0, capacity=_donated_peak(),
                                progress=False, report_dir=str(tmp_path))
  quiet(jnp.array(W), X)
  assert "hbm_guard" not in capsys.readouterr().err


def test_waiting_for_a_compile_beside_the_fit_stops_at_the_budget():
  import concurrent.futures  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  never: concurrent.futures.Future = concurrent.futures.Future()
  b = budget_lib.Budget(limit=0.2)
  b.record(budget_lib.Spend.COMPILE, 0.05)
  t0 = time.perf_counter()
  with pytest.raises(budget_lib.OutOfTime) as e:
    b.wait(never, budget_lib.Spend.COMPILE)  # a compile that would run past the budget
  assert 0.1 < time.perf_counter() - t0 < 5 and e.value.kind is budget_lib.Spend.COMPILE
  done: concurrent.futures.Future = concurrent.futures.Future()
  done.set_result("figure")
  assert b.wait(done, budget_lib.Spend.PROBE) == "figure"  # finished: read even when late
  assert budget_lib.Budget(limit=None).wait(done, budget_lib.Spend.PROBE) == "figure"


def test_the_climbs_own_compile_is_waited_for_no_longer_than_the_budget(tmp_path, monkeypatch):
  # A compile estimated within the budget (by the first, quick one) that runs past it: the
  # fit stops at the budget and leaves it to finish on its own, as it does for a compile
  # beside it (libtpu cannot be stopped). The first compile is never cut short.
  import threading  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  from hbm_guard._src.backends import backend as backend_lib  # pylint: disable=g-import-not-at-top
  compile_ = backend_lib.LocalBackend.compile
  started, release = threading.Event(), threading.Event()
  def slow_after_the_first(self, plan, *args, **kwargs):
    if plan != hbm_guard.Plan():
      started.set()
      release.wait(60)  # a compile far slower than the first
    return compile_(self, plan, *args, **kwargs)
  monkeypatch.setattr(backend_lib.LocalBackend, "compile", slow_after_the_first)
  g = hbm_guard.guarded_jit(sgd_step, state_argnums=0, capacity=_donated_peak(),
                            search="ladder", max_fit_seconds=6.0, plan_cache=False,
                            report_dir=str(tmp_path))
  t0 = time.perf_counter()
  try:
    with pytest.raises(hbm_guard.FitTimeBudgetError, match="max_fit_seconds"):
      g(jnp.array(W), X)
    assert started.is_set() and time.perf_counter() - t0 < 30
  finally:
    release.set()


def test_each_progress_line_is_said_once_absl_repeats_it_only_at_debug(tmp_path, capsys):
  """#58 item 7: with absl logging at INFO (an absl binary's default), a fit's compiles and
  probes are on stderr once, from the progress line; absl's debug level (-v 1) has the detail."""
  from absl import logging as absl_logging
  g = hbm_guard.guarded_jit(sgd_step, state_argnums=0, capacity=_donated_peak(),
                            report_dir=str(tmp_path))
  old = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.DEBUG)
  try:
    with _records() as records:
      g(jnp.array(W), X)
  finally:
    absl_logging.set_verbosity(old)
  err = capsys.readouterr().err
  assert " probe donate" in err and "compile plain jit: does not fit" in err
  info = [r.getMessage() for r in records if r.levelname == "INFO"]
  debug = [r.getMessage() for r in records if r.levelname == "DEBUG"]
  assert not [m for m in info if " probe " in m or " attempt #" in m or "next plan" in m], info
  assert any(" attempt #1 " in m for m in debug) and any("probe donate" in m for m in debug)
  assert any("fits with donate" in m for m in info)  # the decision, once, at INFO


class _records:
  """absl's log records while a fit runs (absl's handler formats, this one keeps)."""

  def __enter__(self):
    import logging as std_logging
    from absl import logging as absl_logging
    self.kept: list = []
    self.handler = std_logging.Handler(level=std_logging.DEBUG)
    self.handler.emit = self.kept.append
    self.logger = absl_logging.get_absl_logger()
    self.logger.addHandler(self.handler)
    return self.kept

  def __exit__(self, *exc):
    self.logger.removeHandler(self.handler)


def test_no_plan_fits_says_the_closest_plan_the_search_measured(tmp_path):
  """An exhaustion after one compile says why no other plan was compiled: the closest
  figure the search read (the report has every probe)."""
  g = hbm_guard.guarded_jit(sgd_step, state_argnums=0, capacity=_donated_peak() // 3,
                            max_class="numerics", plan_cache=False, report_dir=str(tmp_path))
  with pytest.raises(hbm_guard.LadderExhaustedError) as e:
    g(jnp.array(W), X)
  assert "the closest plan the search measured, " in str(e.value), str(e.value)
  assert "microbatch(" in str(e.value).split("the closest plan the search measured, ")[1]
