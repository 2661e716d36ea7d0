"""Of the plans that fit, the fastest: rivals near the search's choice, timed on the first
steps against it (tournament.py, search/rivals.py), driven here with fake plans and a fake
clock; and once with the real compiler on this host."""

import dataclasses
import html
import importlib.resources
import json
import time

import jax
import jax.numpy as jnp
import jsonschema
import optax
import pytest
from flax import linen as nn
from flax.training import train_state

import hbm_guard
from hbm_guard._src.cli import report_html
from hbm_guard._src.files import plan_cache as plan_cache_lib
from hbm_guard._src.files import report as report_lib
from hbm_guard._src.guard import tournament as tournament_lib
from hbm_guard._src.search import rivals as rivals_lib
from hbm_guard._src.search import state as state_lib

Plan = hbm_guard.Plan
DONATE = Plan(donate_argnums=(0,))
DOTS = dataclasses.replace(DONATE, remat_policy="dots_with_no_batch_dims_saveable")
NOTHING = dataclasses.replace(DONATE, remat_policy="nothing_saveable")
at = lambda p, k: dataclasses.replace(p, microbatches=k)  # noqa: E731


def _field(chosen, fitting=(), failing=(), counts=(1, 2, 4, 8, 16),
           families=(DONATE, DOTS, NOTHING)):
  return rivals_lib.Field(chosen, families, tuple(counts),
                          frozenset(fitting) | {chosen}, frozenset(failing))


def test_rivals_are_twice_the_microbatches_then_lighter_remat_then_heavier_at_fewer():
  f = _field(at(DOTS, 2), fitting=[at(DONATE, 4), at(DONATE, 8)], failing=[at(DONATE, 2)])
  tried = frozenset({at(DOTS, 2)})
  assert rivals_lib.next_rival(f, at(DOTS, 2), tried) == at(DOTS, 4)
  tried |= {at(DOTS, 4)}
  assert rivals_lib.next_rival(f, at(DOTS, 2), tried) == at(DONATE, 4)  # no remat: fewest that fit
  tried |= {at(DONATE, 4)}
  # more remat at fewer microbatches (on a GPU that won): the fewest from half the count
  assert rivals_lib.next_rival(f, at(DOTS, 2), tried) == at(NOTHING, 1)
  tried |= {at(NOTHING, 1)}
  # then its own family at fewer microbatches, unless a compile said it does not fit
  assert rivals_lib.next_rival(f, at(DOTS, 2), tried) == DOTS
  f = rivals_lib.learn(f, DOTS, fits=False)
  # last, four times its microbatches: past a plateau at twice (a CNN on a CPU: 8 and 16
  # alike, 32 1.10x faster)
  assert rivals_lib.next_rival(f, at(DOTS, 2), tried) == at(DOTS, 8)
  assert rivals_lib.next_rival(f, at(DOTS, 2), tried | {at(DOTS, 8)}) is None
  # from the heaviest family at the largest count: each lighter one at its fewest that fit
  assert rivals_lib.next_rival(f, at(NOTHING, 16), frozenset()) == at(DONATE, 4)
  assert rivals_lib.next_rival(f, at(NOTHING, 16), frozenset({at(DONATE, 4)})) == at(DOTS, 2)
  tried = frozenset({at(DONATE, 4), at(DOTS, 2)})
  assert rivals_lib.next_rival(f, at(NOTHING, 16), tried) == at(NOTHING, 8)  # about half
  assert rivals_lib.next_rival(f, at(NOTHING, 16), tried | {at(NOTHING, 8)}) is None


def test_after_more_microbatches_won_the_heavier_rival_is_still_the_fewest_that_may_fit():
  # The mixer at 50% of its peak (bench_plan_quality, CPU): the search chose remat(dots) at
  # 2, and 4 won; full remat unsplit ran 1.15x faster than it, but from 4 the heavier rival
  # was taken from 2 up and it was never timed.
  f = _field(at(DOTS, 2), failing=[DONATE, at(DONATE, 2)])
  tried = frozenset({at(DOTS, 2), at(DOTS, 4), at(DOTS, 8), at(DONATE, 4)})
  assert rivals_lib.next_rival(f, at(DOTS, 4), tried) == NOTHING
  # where a compile said it does not fit, the next count of the family
  assert rivals_lib.next_rival(rivals_lib.learn(f, NOTHING, fits=False), at(DOTS, 4),
                               tried) == at(NOTHING, 2)


def test_heavier_remat_at_fewer_microbatches_comes_before_heavier_remat_at_as_many():
  # v5e, the lm at 35% (bench_target_quality): no remat at 2 chosen, dots unsplit over the
  # capacity; full remat unsplit was estimated 1.06x faster, dots at 2 no faster, and three
  # rivals (4, dots unsplit, dots at 2) never reached it
  f = _field(at(DONATE, 2), failing=[DONATE, DOTS])
  tried = frozenset({at(DONATE, 2), at(DONATE, 4)})
  assert rivals_lib.next_rival(f, at(DONATE, 2), tried) == NOTHING
  assert rivals_lib.next_rival(f, at(DONATE, 2), tried | {NOTHING}) == at(DOTS, 2)


def test_a_lighter_rival_the_search_never_measured_is_the_fewest_count_not_ruled_out():
  # the search chose remat at one microbatch; without remat 1 and 2 failed, 4 was never compiled
  f = _field(DOTS, failing=[DONATE, at(DONATE, 2)], counts=(1, 2, 4, 8))
  tried = frozenset({DOTS, at(DOTS, 2)})
  assert rivals_lib.next_rival(f, DOTS, tried) == at(DONATE, 4)
  # its compile says it does not fit: the next rival is the next count, not it again
  f = rivals_lib.learn(f, at(DONATE, 4), fits=False)
  assert rivals_lib.next_rival(f, DOTS, tried) == at(DONATE, 8)
  assert rivals_lib.next_rival(f, DOTS, tried | {at(DONATE, 8)}) == NOTHING  # heavier, as many
  assert at(DONATE, 8) in rivals_lib.learn(f, at(DONATE, 8), fits=True).fitting


def test_no_field_where_the_figures_are_estimates_or_the_choice_was_not_searched():
  state = state_lib.SearchState(capacity=100, exact=False)
  assert rivals_lib.field(state, DONATE, [DONATE], [1, 2]) is None
  exact = state_lib.observe_probe(state_lib.SearchState(capacity=100, exact=True),
                                  at(DONATE, 2), 90, 1.0)
  f = rivals_lib.field(exact, DONATE, [DONATE], [1, 2])
  assert f is not None and at(DONATE, 2) in f.fitting
  flagged = dataclasses.replace(DONATE, compiler_options=(("xla_flag", True),))
  assert rivals_lib.field(exact, flagged, [DONATE], [1, 2]) is None


class _Clock:
  """A step of `plan` takes `speed[plan]` seconds; the clock is read around each step."""

  def __init__(self, speed):
    self.speed, self.now, self.running = speed, 0.0, None

  def __call__(self):
    if self.running is not None:
      self.now += self.speed[self.running]
    return self.now


def _one_family(chosen, counts=(1, 2, 4, 8, 16), **kw):
  """A field of one family (no remat): the tournament's rivals are its counts alone, above
  the chosen one (fewer failed, as the search found)."""
  failing = [at(DONATE, n) for n in counts if n < chosen.microbatches]
  return _field(chosen, failing=failing, counts=counts, families=(DONATE,), **kw)


def _tournament(speed, field, chosen, fits=lambda p: True, max_rivals=4):
  clock, ran, settled = _Clock(speed), [], []
  def entry(plan):
    def run(args, kwargs):
      clock.running = plan
      ran.append(plan)
      return args[0] + 1
    return run
  t = tournament_lib.Tournament(field, chosen, entry, fits, settled.append,
                                max_rivals=max_rivals, clock=clock)
  return t, ran, settled


def _run(t, settled, seconds=30.0):
  """Steps until the tournament settles (its rivals compile in a thread: let it run)."""
  x, end = 0, time.monotonic() + seconds
  while not settled and time.monotonic() < end:
    x = t((x,), {})
    time.sleep(0.001)
  return x


def test_the_faster_rival_wins_and_the_chain_goes_on_from_it():
  speed = {at(DONATE, 2): 1.0, at(DONATE, 4): 0.8, at(DONATE, 8): 0.9, at(DONATE, 16): 0.85}
  t, ran, settled = _tournament(speed, _one_family(at(DONATE, 2)), at(DONATE, 2))
  x = _run(t, settled)
  (outcome,) = settled
  assert outcome.winner == at(DONATE, 4)  # 8 was timed against it and lost, then 16
  assert [tm.plan for tm in outcome.timings] == [at(DONATE, 4), at(DONATE, 16), at(DONATE, 8),
                                                 at(DONATE, 2)]
  assert x == len(ran)  # every step ran once, each on one plan: none lost or repeated
  timed = {p: len(s) for p, s in ((tm.plan, tm.seconds) for tm in outcome.timings)}
  assert timed[at(DONATE, 8)] == tournament_lib.STEPS_EACH


class _Waited(int):
  """A step's output that notes when the tournament waits for it."""
  log: list

  def block_until_ready(self):
    self.log.append(int(self))
    return self


def test_the_step_before_each_timed_step_is_waited_for():
  # a step not waited for is still running when the next one's clock starts: its time fell
  # on the incumbent's first timed step (the rival's untimed first run, on a real device)
  waited, ran = [], []
  speed = {at(DONATE, 2): 1.0, at(DONATE, 4): 1.0}
  clock, settled = _Clock(speed), []
  def entry(plan):
    def run(args, kwargs):
      clock.running = plan
      ran.append(plan)
      out = _Waited(args[0] + 1)  # the step's number, from 1
      out.log = waited
      return out
    return run
  t = tournament_lib.Tournament(_one_family(at(DONATE, 2), counts=(1, 2, 4)), at(DONATE, 2),
                                entry, lambda p: True, settled.append, max_rivals=1,
                                clock=clock)
  _run(t, settled)
  assert settled and settled[0].timings[1].plan == at(DONATE, 4)
  warm = ran.index(at(DONATE, 4)) + 1  # the rival's first run: untimed
  timed = 2 * tournament_lib.STEPS_EACH  # then one round, each plan in turn
  assert waited == list(range(warm, warm + timed + 1))
  assert warm > tournament_lib.SETTLING_STEPS + 1  # the incumbent's steps before: not waited


def test_a_rival_within_the_noise_does_not_displace_the_incumbent():
  speed = {at(DONATE, 2): 1.0, at(DONATE, 4): 0.99}
  t, _, settled = _tournament(speed, _one_family(at(DONATE, 2), counts=(1, 2, 4)), at(DONATE, 2))
  _run(t, settled)
  assert settled[0].winner == at(DONATE, 2)


class _FastAtFirst(dict):
  """Step times where `plan`'s first `n` steps are fast by chance, and the rest slow."""

  def __init__(self, speed, plan, n):
    super().__init__(speed)
    self.plan, self.n = plan, n

  def __getitem__(self, plan):
    if plan == self.plan:
      self.n -= 1
      return 0.5 if self.n >= 0 else 1.2
    return super().__getitem__(plan)


def test_a_rival_faster_in_one_round_only_does_not_win():
  # its untimed first step and its first timed round are fast; the confirming round is not
  speed = _FastAtFirst({at(DONATE, 2): 1.0}, at(DONATE, 4), 1 + tournament_lib.STEPS_EACH)
  t, _, settled = _tournament(speed, _one_family(at(DONATE, 2), counts=(1, 2, 4)), at(DONATE, 2))
  _run(t, settled)
  (outcome,) = settled
  assert outcome.winner == at(DONATE, 2)
  timed = {tm.plan: len(tm.seconds) for tm in outcome.timings}
  assert timed[at(DONATE, 4)] == 2 * tournament_lib.STEPS_EACH  # two rounds, then let go


def test_a_rival_that_does_not_fit_is_never_run_and_the_count_of_rivals_is_bounded():
  speed = {at(DONATE, k): 1.0 / k for k in (1, 2, 4, 8, 16)}
  t, ran, settled = _tournament(speed, _one_family(DONATE, counts=(1, 2)), DONATE,
                                fits=lambda p: p != at(DONATE, 2))
  _run(t, settled)
  assert at(DONATE, 2) not in ran and settled[0].winner == DONATE  # 2 does not fit
  t, ran, settled = _tournament(speed, _one_family(DONATE), DONATE, max_rivals=2)
  _run(t, settled)
  assert settled[0].winner == at(DONATE, 4) and at(DONATE, 8) not in ran


def test_more_remat_at_fewer_microbatches_can_win_and_a_rival_that_does_not_fit_is_learnt():
  # a GPU's shape: the search chose two microbatches without remat; one microbatch with full
  # remat is faster. Remat of dots at one microbatch does not fit: the next rival is full
  # remat at one (fewer microbatches), before dots at two; from it, full remat at two
  speed = {at(DONATE, 2): 1.0, at(DONATE, 4): 1.1, at(DOTS, 2): 1.2, NOTHING: 0.8,
           at(NOTHING, 2): 0.9}
  t, ran, settled = _tournament(speed, _field(at(DONATE, 2), failing=[DONATE], counts=(1, 2, 4)),
                                at(DONATE, 2), fits=lambda p: p != DOTS)
  _run(t, settled)
  (outcome,) = settled
  assert outcome.winner == NOTHING and DOTS not in ran
  assert [tm.plan for tm in outcome.timings] == [NOTHING, at(NOTHING, 2), at(DONATE, 2),
                                                 at(DONATE, 4)]


# -- with the compiler ----------------------------------------------------------------------

class _MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(3):
      x = nn.relu(nn.Dense(512, name=f"block_{i}")(x))
    return nn.Dense(10)(x)


def _step(state, batch):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def _timed(path) -> bool:
  with open(path, encoding="utf-8") as f:
    return bool(json.load(f).get("timed"))


@pytest.mark.parametrize("rivals", [0, 2])
def test_the_first_steps_settle_on_a_timed_plan_reported_and_remembered(tmp_path, rivals):
  model, x = _MLP(), jnp.ones((64, 256))
  batch = {"x": x, "y": jnp.zeros((64,), jnp.int32)}
  def fresh():
    return train_state.TrainState.create(
        apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"],
        tx=optax.adam(1e-3))
  plain = jax.jit(_step).lower(fresh(), batch).compile().memory_analysis()
  peak = plain.temp_size_in_bytes + plain.argument_size_in_bytes + plain.output_size_in_bytes
  opts = dict(state_argnums=0, capacity=int(0.9 * peak), max_class="numerics",
              plan_cache=str(tmp_path / "cache"), report_dir=str(tmp_path), progress=False,
              timed_rivals=rivals)
  step, state = hbm_guard.guarded_jit(_step, **opts), fresh()
  searched, end = None, time.monotonic() + 120
  for i in range(2000):  # until the first steps settle (rivals compile beside them)
    state, loss = step(state, batch)
    searched = searched or step.plan
    if i % 10 == 9 and (not rivals or _timed(step.report_path) or time.monotonic() > end):
      break
  report = report_lib.render_path(step.report_path)
  if not rivals:
    assert "timed on the first steps" not in report and step.plan == searched
    return
  assert "timed on the first steps" in report, report
  with open(step.report_path, encoding="utf-8") as f:
    data = json.load(f)
  timed = data["timed"]["plans"]
  jsonschema.validate(data, json.loads(importlib.resources.files("hbm_guard.configs")
                                       .joinpath("report.schema.json").read_text()))
  page = report_html.render(data)
  assert "Timed on the first steps" in page and html.escape(step.plan.describe()) in page
  assert len(timed) >= 2 and timed[0]["plan"] == step.plan.describe()  # the winner first
  assert timed[1:] == sorted(timed[1:], key=lambda t: t["median_seconds"])
  # a restart starts from (and compiles only) the plan the steps settled on
  cache = plan_cache_lib.resolve(str(tmp_path / "cache"))
  again = hbm_guard.guarded_jit(_step, **opts)
  again(fresh(), batch)
  assert again.plan == step.plan and len(again.attempts) == 1
  assert cache is not None


def test_a_rival_that_fails_at_run_time_is_let_go_and_the_step_runs_on_the_incumbent():
  speed = {at(DONATE, 1): 1.0, at(DONATE, 2): 0.5, at(DONATE, 4): 0.9}
  clock, ran, settled = _Clock(speed), [], []
  def entry(plan):
    def run(args, kwargs):
      if plan == at(DONATE, 2):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                         "allocate 1024 bytes.")
      clock.running = plan
      ran.append(plan)
      return args[0] + 1
    return run
  one = _one_family(DONATE, counts=(1, 2))
  t = tournament_lib.Tournament(one, DONATE, entry, lambda p: True, settled.append,
                                max_rivals=4, clock=clock, recoverable=lambda e, a: True)
  x = _run(t, settled)
  assert x == len(ran)  # the failed step ran again on the incumbent: none lost
  assert settled[0].winner == DONATE and at(DONATE, 2) not in [tm.plan for tm in
                                                               settled[0].timings]
  strict = tournament_lib.Tournament(one, DONATE, entry, lambda p: True,
                                     settled.append, max_rivals=4, clock=clock)
  with pytest.raises(jax.errors.JaxRuntimeError):  # not known to be safe: raised
    _run(strict, [])
