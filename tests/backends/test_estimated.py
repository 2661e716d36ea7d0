"""For a target: rivals near the search's choice compiled and compared by their programs'
estimated step times (estimated.py, `estimated_rivals`): driven here with fake compiles,
and once with the real compiler for v5e."""

import dataclasses
import importlib.resources
import json

import jax
import jax.numpy as jnp
import jsonschema
import pytest

import hbm_guard
from hbm_guard._src.backends import estimated as estimated_lib
from hbm_guard._src.cli import report_html
from hbm_guard._src.files import report as report_lib
from hbm_guard._src.search import rivals as rivals_lib
from hbm_guard._src.search import state as state_lib
from tests.backends.test_step_time import _step  # two bf16 layers of 1024

Plan = hbm_guard.Plan
DONATE = Plan(donate_argnums=(0,))
DOTS = dataclasses.replace(DONATE, remat_policy="dots_with_no_batch_dims_saveable")
NOTHING = dataclasses.replace(DONATE, remat_policy="nothing_saveable")
at = lambda p, k: dataclasses.replace(p, microbatches=k)  # noqa: E731


def _field(chosen, failing=()):
  return rivals_lib.Field(chosen, (DONATE, DOTS, NOTHING), (1, 2, 4, 8, 16),
                          frozenset({chosen}), frozenset(failing))


def _chosen(plan, seconds):
  return estimated_lib.Estimated(plan, True, seconds)


def _compiles(table, rounds=None):
  """Fake compiles: (fits, seconds) from `table`, each plan compiled once; each call's
  plans (a round) appended to `rounds` if given."""
  made = []
  def compile_plans(plans):
    if rounds is not None:
      rounds.append(list(plans))
    for plan in plans:
      assert plan not in made, f"{plan.describe()} compiled twice"
      made.append(plan)
    return [estimated_lib.Estimated(plan, *table.get(plan, (False, None))) for plan in plans]
  return compile_plans, made


def test_a_rival_estimated_faster_is_kept_and_every_one_compiled_is_reported():
  chosen = at(DONATE, 4)
  compile_plan, made = _compiles({at(DONATE, 8): (True, 0.080), at(DOTS, 1): (True, 0.050),
                                  at(NOTHING, 1): (True, 0.040)})
  failed = [DONATE, at(DONATE, 2)]  # the search's own failures: never compiled again
  out = estimated_lib.compare(_field(chosen, failed), _chosen(chosen, 0.070), compile_plan,
                              max_rivals=4)
  assert made[0] == at(DONATE, 8)  # twice the microbatches first, as the tournament's
  assert out.winner == at(NOTHING, 1)
  assert out.estimates[0] == _chosen(chosen, 0.070) and out.kept.plan == at(NOTHING, 1)
  # then heavier remat at the fewest count, and on from the best so far
  assert made[1:] == [at(DOTS, 1), at(DOTS, 2), at(NOTHING, 1)]
  assert [e.plan for e in out.estimates[1:]] == made
  assert "faster than the search's choice" in out.why
  listed = out.to_dict()["plans"]
  assert listed[0]["plan"] == chosen.describe() and listed[0]["estimated_seconds"] == 0.07


def test_no_rival_within_the_margin_or_failing_displaces_the_choice():
  chosen = at(DONATE, 2)
  slower = 0.1 * (1 - estimated_lib.MARGIN / 2)  # faster, but by less than the margin
  compile_plan, made = _compiles({at(DONATE, 4): (True, slower)})
  out = estimated_lib.compare(_field(chosen), _chosen(chosen, 0.1), compile_plan, max_rivals=4)
  assert out.winner == chosen and "no rival" in out.why
  assert all(not e.fits for e in out.estimates[2:])  # the rest did not fit: no estimate
  assert all(e.seconds is None for e in out.estimates if not e.fits)


def test_no_estimate_of_the_choice_compiles_nothing():
  compile_plan, made = _compiles({})
  out = estimated_lib.compare(_field(DONATE), _chosen(DONATE, None), compile_plan,
                              max_rivals=5)
  assert out.winner == DONATE and not made


def test_rivals_stop_at_the_time_budget_and_say_so():
  made = []
  def compile_plans(plans):
    made.extend(plans)
    return [estimated_lib.Estimated(plans[0], True, 0.2) if len(made) == 1
            else None]  # the budget pays for one
  out = estimated_lib.compare(_field(at(DOTS, 4)), _chosen(at(DOTS, 4), 0.1), compile_plans, 5)
  assert len(made) == 2 and len(out.estimates) == 2  # the one refused is not reported
  assert out.winner == at(DOTS, 4) and "time budget" in out.why
  # side by side, a round the budget stopped in the middle of: what finished is reported
  def in_a_round(plans):
    made = [estimated_lib.Estimated(plans[0], True, 0.05), None,
            estimated_lib.Estimated(plans[-1], True, 0.01)]
    return made[:len(plans)]
  out = estimated_lib.compare(_field(at(DOTS, 4)), _chosen(at(DOTS, 4), 0.1), in_a_round, 5,
                              width=3)
  assert len(out.estimates) == 2 and out.winner == out.estimates[1].plan
  assert "time budget" in out.why


def test_side_by_side_each_round_is_the_best_so_fars_nearest_neighbours():
  chosen = at(DONATE, 4)
  rounds = []
  compile_plans, made = _compiles({at(DONATE, 8): (True, 0.080), at(DOTS, 1): (True, 0.050),
                                   at(NOTHING, 1): (True, 0.040)}, rounds)
  out = estimated_lib.compare(_field(chosen, [DONATE, at(DONATE, 2)]), _chosen(chosen, 0.070),
                              compile_plans, max_rivals=4, width=2)
  # twice the microbatches and heavier remat at once; then around the faster of the two
  assert rounds == [[at(DONATE, 8), at(DOTS, 1)], [at(DOTS, 2), at(NOTHING, 1)]]
  assert out.winner == at(NOTHING, 1) and len(out.estimates) == 5
  rounds.clear()
  compile_plans, _ = _compiles({}, rounds)
  estimated_lib.compare(_field(chosen), _chosen(chosen, 0.070), compile_plans, max_rivals=3,
                        width=2)
  assert [len(r) for r in rounds] == [2, 1]  # never past max_rivals


def test_rivals_stop_at_max_rivals():
  compile_plan, made = _compiles({})
  estimated_lib.compare(_field(at(DOTS, 4)), _chosen(at(DOTS, 4), 0.1), compile_plan,
                        max_rivals=2)
  assert len(made) == 2


def test_a_targets_field_counts_only_compiles_as_fits_and_probes_over_the_capacity_as_fails():
  state = state_lib.SearchState(capacity=1000, exact=False, headroom=1.0, scale=1.0)
  state = dataclasses.replace(state, needs={at(DONATE, 2): 1500, at(DONATE, 8): 600})
  fams = (DONATE, DOTS)
  assert rivals_lib.field(state, at(DONATE, 4), fams, (1, 2, 4, 8)) is None  # a tournament's
  f = rivals_lib.field(state, at(DONATE, 4), fams, (1, 2, 4, 8), estimated=True)
  assert f.fitting == {at(DONATE, 4)}  # a probe's 600 is not a compile's
  assert at(DONATE, 2) in f.failing
  # a probe's own figure under the capacity may fit, whatever the search's scale predicts:
  # the figure reads below the real need, so only a figure over the capacity rules a plan out
  state = dataclasses.replace(state, scale=1.3, needs={at(DONATE, 2): 900, at(DONATE, 1): 1100})
  f = rivals_lib.field(state, at(DONATE, 4), fams, (1, 2, 4, 8), estimated=True)
  assert not state.fits(900) and at(DONATE, 2) not in f.failing
  assert at(DONATE, 1) in f.failing
  # a failed compile bounds its family's counts: 368M's unsplit 81 GiB rules out 2 and 4
  gib = 1 << 30
  state = state_lib.SearchState(capacity=int(15.75 * gib), exact=False, state_bytes=5 * gib,
                                real={DONATE: 81 * gib}, failed=frozenset({DONATE}))
  f = rivals_lib.field(state, at(DOTS, 2), fams, (1, 2, 4, 8), estimated=True)
  assert {at(DONATE, 2), at(DONATE, 4)} <= f.failing and at(DONATE, 8) not in f.failing


@pytest.fixture()
def _flags_parsed():
  from absl import flags
  from hbm_guard import flags as _  # noqa: F401  registers --hbm_guard_*
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()


def test_the_flag_feeds_the_option(_flags_parsed):
  from absl.testing import flagsaver
  from hbm_guard import flags as hbm_flags
  with flagsaver.flagsaver(hbm_guard_estimated_rivals=3):
    opts = hbm_flags.guard_options()
  assert opts["estimated_rivals"] == 3
  assert hbm_guard.guarded_jit(lambda x: x, **opts).options.estimated_rivals == 3


def test_the_option_is_a_count():
  with pytest.raises(hbm_guard.InvalidOptionError):
    hbm_guard.guarded_jit(lambda x: x, estimated_rivals=-1)
  with pytest.raises(hbm_guard.InvalidOptionError):
    hbm_guard.guarded_jit(lambda x: x, estimated_rivals=True)
  assert hbm_guard.guarded_jit(lambda x: x, estimated_rivals=2).options.estimated_rivals == 2
  assert hbm_guard.guarded_jit(lambda x: x).options.estimated_rivals == 0


# -- the real compiler, for v5e ----------------------------------------------------------------

@pytest.mark.real_compiler
def test_a_target_compares_its_rivals_by_their_compiled_programs(tmp_path):
  w = jax.ShapeDtypeStruct((2, 1024, 1024), jnp.bfloat16)
  x = jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16)
  g = hbm_guard.guarded_jit(_step, state_argnums=0, target="v5e:1x1", capacity="12MiB",
                            max_class="numerics", plan_cache=False, progress=False,
                            report_dir=str(tmp_path), estimated_rivals=2)
  plan = g.fit(w, x)
  with open(g.report_path, encoding="utf-8") as f:
    data = json.load(f)
  jsonschema.validate(data, json.loads(importlib.resources.files("hbm_guard.configs")
                                       .joinpath("report.schema.json").read_text()))
  compared = data["estimated"]["plans"]
  assert 2 <= len(compared) <= 3  # the search's choice, then up to two rivals
  chosen = compared[0]
  assert chosen["fits"] and chosen["estimated_seconds"] > 0
  assert all(0 < c["peak_bytes"] <= 12 << 20 for c in compared if c["fits"])
  kept = min((c for c in compared if c["estimated_seconds"]),
             key=lambda c: c["estimated_seconds"])
  margin = 1 - estimated_lib.MARGIN
  expect = (kept["plan"] if kept["estimated_seconds"] < margin * chosen["estimated_seconds"]
            else chosen["plan"])
  assert plan.describe() == expect
  assert hbm_guard.Plan.from_dict(data["final_plan"]).describe() == expect
  text = report_lib.render(data)
  assert "compiled for the target and compared" in text and chosen["plan"] in text
  assert "Compared on the target" in report_html.render(data)
  assert g.estimated is not None and g.estimated.winner == plan
  # a later fit that raises leaves no comparison standing for it
  with pytest.raises(TypeError):
    g.fit(w, jax.ShapeDtypeStruct((2048, 1000), jnp.bfloat16))
  assert g.estimated is None
  # without the option a fit compiles no rival, and its report compares nothing
  plain = hbm_guard.guarded_jit(_step, state_argnums=0, target="v5e:1x1", capacity="12MiB",
                                max_class="numerics", plan_cache=False, progress=False,
                                report_dir=str(tmp_path / "plain"))
  assert plain.fit(w, x).describe() == chosen["plan"]
  with open(plain.report_path, encoding="utf-8") as f:
    assert json.load(f)["estimated"] is None


@pytest.mark.real_compiler
def test_a_restart_compiles_only_the_plan_kept(tmp_path, monkeypatch):
  # any rival that fits is kept (a margin far below zero): the plan kept is not the
  # search's choice, and the plan cache must hold the one kept
  monkeypatch.setattr(estimated_lib, "MARGIN", -10.0)
  w = jax.ShapeDtypeStruct((2, 1024, 1024), jnp.bfloat16)
  x = jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16)
  make = lambda: hbm_guard.guarded_jit(  # noqa: E731
      _step, state_argnums=0, target="v5e:1x1", capacity="12MiB", max_class="numerics",
      plan_cache=str(tmp_path / "cache"), progress=False, report_dir=str(tmp_path),
      estimated_rivals=2)
  first = make()
  kept = first.fit(w, x)
  searched = first.attempts[-1].plan
  assert len(first.attempts) > 1 and kept != searched
  again = make()
  assert again.fit(w, x) == kept and len(again.attempts) == 1
