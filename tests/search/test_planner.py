"""The planner's probe calibration: a prior until real compiles measure how low probes run."""

import dataclasses
import functools

import pytest

import hbm_guard
from hbm_guard._src.plans import ladder as ladder_lib
from hbm_guard._src.plans import rungs as rungs_lib
from hbm_guard._src.search import bisection
from hbm_guard._src.search import cheapest
from hbm_guard._src.search import driver as driver_lib
from hbm_guard._src.search import hint
from hbm_guard._src.search import model
from hbm_guard._src.search import planner as planner_lib
from hbm_guard._src.search import race
from hbm_guard._src.search import space
from hbm_guard._src.search import state as state_lib
from hbm_guard._src.search import tuning

MiB = 2**20


def _planner(figures):
  return driver_lib.Driver(lambda plan: figures[plan.microbatches], lambda plan: 1e9,
                             capacity=100 * MiB, scale=tuning.PROBE_SCALE)


def test_measured_ratios_replace_the_prior_and_only_ever_grow():
  figures = {1: 90 * MiB, 2: 80 * MiB, 4: 75 * MiB}
  planner = _planner(figures)
  plan = lambda k: hbm_guard.Plan(microbatches=k)  # pylint: disable=unnecessary-lambda-assignment
  assert planner.scale == tuning.PROBE_SCALE
  for k in figures:
    planner.need(plan(k))  # as the planner does before it compiles a plan
  assert not planner.state.fits(planner.need(plan(4)))  # 75 x 1.3 > 95
  planner.observe(plan(2), real_bytes=88 * MiB, fits=False)  # probes run 1.1 low here
  assert abs(planner.scale - 1.1) < 1e-9
  assert planner.state.fits(planner.need(plan(4)))  # 75 x 1.1 = 82.5 <= 95: worth a compile now
  planner.observe(plan(1), real_bytes=108 * MiB, fits=False)  # 1.2: the larger stands
  assert abs(planner.scale - 1.2) < 1e-9
  planner.observe(plan(4), real_bytes=63 * MiB, fits=True)  # a fit below its probe: ignored
  assert abs(planner.scale - 1.2) < 1e-9


def test_an_unprobed_plan_does_not_calibrate():
  planner = _planner({1: 90 * MiB})
  planner.observe(hbm_guard.Plan(microbatches=1), real_bytes=300 * MiB, fits=False)
  assert planner.scale == tuning.PROBE_SCALE


class _Clock:
  """A fake clock: each probe takes `per_probe` seconds."""

  def __init__(self, per_probe):
    self.now, self.per_probe = 0.0, per_probe

  def __call__(self):
    self.now += self.per_probe / 2  # read twice per probe
    return self.now


def _lm_like(plan):  # need(k) = 6 GiB + 58 GiB / k, as measured at 368M parameters (#17)
  return int((6 + 58 / plan.microbatches) * 2**30)


def _dear_planner(per_probe, probes):
  def probe(plan):
    probes.append(plan.microbatches)
    return _lm_like(plan)
  p = driver_lib.Driver(probe, lambda plan: 1e12, capacity=int(15.75 * 2**30), scale=1.0,
                          clock=_Clock(per_probe))
  p.observe(hbm_guard.Plan(), real_bytes=_lm_like(hbm_guard.Plan()), fits=False,
            seconds=5.0 if per_probe < 10 else 60.0)
  return p


def test_dear_probes_predict_the_count_from_two_figures():
  probes = []
  planner = _dear_planner(per_probe=120.0, probes=probes)  # probes as dear as compiles
  choice = cheapest.choose(planner, [hbm_guard.Plan()], [1, 2, 4, 8, 16], offload_bytes=0)
  assert choice.plan.microbatches == 8  # 6 + 58/8 = 13.25 GiB <= 0.95 x 15.75
  # One probe: the failed compile's own figure is the other point of need(k) = F + P / k.
  assert probes == [16] and planner.probes_are_dear


def test_dear_probes_without_a_real_figure_probe_both_ends():
  probes = []
  planner = _dear_planner(per_probe=120.0, probes=probes)
  planner.state = dataclasses.replace(planner.state, real={})  # (as if the failure had no figure)
  choice = cheapest.choose(planner, [hbm_guard.Plan()], [1, 2, 4, 8, 16], offload_bytes=0)
  assert choice.plan.microbatches == 8 and probes == [16, 2]  # k = 2: the fewest split


def test_dear_probes_of_a_familys_two_ends_start_together_before_the_pricing():
  events = []
  def start_probes(plans):
    events.append(("start", sorted(p.microbatches for p in plans)))
    def read(plan):
      events.append(("read", plan.microbatches))
      return _lm_like(plan), 30.0
    return [lambda p=p: read(p) for p in plans]
  def flops(plan):
    events.append(("price", plan.remat_policy))
    return 1e12 if plan.remat_policy is None else 1.3e12
  planner = driver_lib.Driver(lambda p: 1 / 0, flops, capacity=int(15.75 * 2**30),
                                scale=1.0, clock=_Clock(120.0), start_probes=start_probes)
  planner.observe(hbm_guard.Plan(), real_bytes=None, fits=False, seconds=60.0)
  families = [hbm_guard.Plan(remat_policy="nothing_saveable"), hbm_guard.Plan()]
  choice = cheapest.choose(planner, families, [1, 2, 4, 8, 16], offload_bytes=0)
  assert choice.plan == hbm_guard.Plan(microbatches=8)
  # The family without remat is started first, priced while its probes run, then read.
  assert events[0] == ("start", [2, 16]) and events[1][0] == "price"
  assert [e for e in events if e[0] == "read"] == [("read", 16), ("read", 2)]
  assert [p.seconds for p in planner.probes] == [30.0, 30.0]  # each one's own seconds


def test_dear_probes_read_the_second_figure_where_a_probe_is_running():
  # A mixture of experts (bench_archs): its probe of 4, started while the plain step
  # compiled, is running when the family is searched: the line is drawn through it and
  # the most, and no round is spent on the fewest split (2).
  events = []
  def start_probes(plans):
    events.append(("start", [p.microbatches for p in plans]))
    return [lambda p=p: (_lm_like(p), 30.0) for p in plans]
  planner = driver_lib.Driver(lambda p: 1 / 0, lambda plan: 1e12, capacity=int(15.75 * 2**30),
                              scale=1.0, clock=_Clock(120.0), start_probes=start_probes)
  planner.observe(hbm_guard.Plan(), real_bytes=None, fits=False, seconds=60.0)
  planner.prefetch([hbm_guard.Plan(microbatches=4)])  # the opening's
  choice = cheapest.choose(planner, [hbm_guard.Plan()], [1, 2, 4, 8, 16], offload_bytes=0)
  assert choice.plan == hbm_guard.Plan(microbatches=8)  # 6 + 58/8 = 13.25 GiB
  assert events == [("start", [4]), ("start", [16])]


def test_another_familys_failure_is_no_anchor():
  # The plain step failed low (an unsplit program, no donation); the donated family's split
  # program holds more at k = 2 than that figure: the model must be anchored in the family.
  probes = []
  def probe(plan):
    probes.append(plan.microbatches)
    return int((8 + 24 / plan.microbatches) * 2**30)  # 20 GiB at k = 2, 9.5 at 16
  planner = driver_lib.Driver(probe, lambda plan: 1e12, capacity=int(15.75 * 2**30),
                                scale=1.0, clock=_Clock(120.0))
  planner.observe(hbm_guard.Plan(), real_bytes=int(19.37 * 2**30), fits=False, seconds=60.0)
  donated = hbm_guard.Plan(donate_argnums=(0,))
  choice = cheapest.choose(planner, [donated], [1, 2, 4, 8, 16], offload_bytes=0)
  # Anchored on the plain figure, k = 2 would be predicted at 14.0 GiB and fail; in the
  # family, 8 + 24/4 = 14 GiB <= 0.95 x 15.75 at k = 4.
  assert probes == [16, 2] and choice.plan.microbatches == 4


def test_a_slow_failed_compile_makes_probes_dear_before_any_probe():
  planner = driver_lib.Driver(lambda p: 1, lambda p: 1.0, capacity=100)
  planner.observe(hbm_guard.Plan(), real_bytes=200, fits=False, seconds=2.0)
  assert not planner.probes_are_dear
  planner.observe(hbm_guard.Plan(microbatches=2), real_bytes=150, fits=False, seconds=17.0)
  assert planner.probes_are_dear


def test_cheap_probes_still_bisect():
  probes = []
  planner = _dear_planner(per_probe=2.0, probes=probes)
  choice = cheapest.choose(planner, [hbm_guard.Plan()], [1, 2, 4, 8, 16], offload_bytes=0)
  assert choice.plan.microbatches == 8 and not planner.probes_are_dear
  # The failure rules out 1 and 2; 4, the fewest it leaves, is probed first and does not
  # fit; then the top and the midpoint above 4, and 8 is confirmed by its own probe.
  assert probes == [4, 16, 8]


def test_cheap_probes_stop_at_the_fewest_count_a_failure_leaves_if_it_fits():
  probes = []
  planner = _dear_planner(per_probe=2.0, probes=probes)
  planner.state = dataclasses.replace(planner.state, capacity=24 * 2**30)  # (4: 20.5 GiB fits)
  choice = cheapest.choose(planner, [hbm_guard.Plan()], [1, 2, 4, 8, 16], offload_bytes=0)
  # 64 GiB unsplit bounds 2 at 32 GiB (over 1.3 x 24): 4 is the floor, and it fits, so
  # neither the top nor a midpoint is probed (need falls with the count).
  assert choice.plan.microbatches == 4 and probes == [4]


def _flags_only_facts():
  # a step nothing planned can split or remat (microbatching refused, no layers seen)
  return rungs_lib.StepFacts(platform="tpu", num_devices=1, plan_reads=frozenset(),
                              state_argnums=(0,), state_bytes=4 * 2**30, batch_size=16,
                              auto_refused="a batch statistic feeds per-example work")


def test_where_probes_are_dear_the_xla_flags_are_judged_by_one_probe_of_all_of_them():
  from hbm_guard._src.backends import compile as compile_lib  # pylint: disable=g-import-not-at-top
  probed = []
  def probe(plan):  # every flag cuts a little; all of them together still do not fit
    probed.append(plan.describe())
    return int((30 - 3 * len(plan.compiler_options)) * 2**30)
  planner = driver_lib.Driver(probe, lambda plan: 1e12, capacity=int(15.75 * 2**30),
                                clock=_Clock(120.0))
  failed = hbm_guard.Plan(donate_argnums=(0,))
  planner.observe(hbm_guard.Plan(), real_bytes=40 * 2**30, fits=False, seconds=60.0)
  planner.need(failed)  # as the fit did before compiling it: probes are dear (120 s)
  planner.observe(failed, real_bytes=31 * 2**30, fits=False, seconds=60.0)
  rec = compile_lib.budget_record({"peak": 31 * 2**30, "argument": 4 * 2**30, "output": 0,
                                   "alias": 0, "temp": 27 * 2**30, "generated_code": 0},
                                  int(15.75 * 2**30), "fake")
  nxt, skips, _ = planner_lib.next_plan(planner, ladder_lib.load_ladder(), failed,
                                        _flags_only_facts(), rec, "numerics")
  flags = [s for s in skips if s.rung.startswith("xla_")]
  assert nxt is None and len(flags) == 3  # every flag skipped ...
  assert all("every XLA flag at once" in s.reason for s in flags)
  assert len([d for d in probed if "xla_" in d]) == 1  # ... after one probe, not three


def test_flags_and_donation_that_cannot_close_the_gap_are_not_probed():
  # The 368M LM written without hbm_guard, nothing plan-aware: at batch 64 its plain
  # compile failed at 38.61 GiB of 15.75 (all flags, donated, read 31.15: no fit). Half of
  # it, less the 4.1 GiB of state, is over the capacity: no probe, the flags passed over.
  # At batch 16 (19.52 GiB) the flags fit (15.26 GiB): there they are probed, as before.
  from hbm_guard._src.backends import compile as compile_lib  # pylint: disable=g-import-not-at-top
  facts = dataclasses.replace(_flags_only_facts(), state_bytes=int(4.1 * 2**30))
  for failed_gib, probed_flags in ((38.61, False), (19.52, True)):
    probed = []
    def probe(plan, probed=probed):
      probed.append(plan.describe())
      return int(40 * 2**30)
    planner = driver_lib.Driver(probe, lambda plan: 1e12, capacity=int(15.75 * 2**30),
                                  clock=_Clock(120.0))
    real = int(failed_gib * 2**30)
    planner.observe(hbm_guard.Plan(), real_bytes=real, fits=False, seconds=30.0)
    rec = compile_lib.budget_record({"peak": real, "argument": 4 * 2**30, "output": 0,
                                     "alias": 0, "temp": real - 4 * 2**30,
                                     "generated_code": 0}, int(15.75 * 2**30), "fake")
    nxt, skips, _ = planner_lib.next_plan(planner, ladder_lib.load_ladder(), hbm_guard.Plan(),
                                          facts, rec, "numerics")
    flags = [s for s in skips if s.rung.startswith("xla_")]
    assert nxt is None and len(flags) == 3
    if probed_flags:
      assert any("xla_" in d for d in probed) and "probed" in flags[0].reason
    else:
      assert probed == [] and "estimated" in flags[0].reason and "17.25 GiB of 15.75 GiB" in flags[0].reason
      assert all(s.kind is rungs_lib.SkipKind.CANNOT_CLOSE_GAP for s in flags)


def test_a_large_programs_prior_is_closer_to_one_until_measured():
  fast, slow = _planner({1: 90 * MiB}), _planner({1: 90 * MiB})
  fast.observe(hbm_guard.Plan(), real_bytes=300 * MiB, fits=False, seconds=2.0)
  slow.observe(hbm_guard.Plan(), real_bytes=300 * MiB, fits=False, seconds=12.5)
  assert fast.scale == tuning.PROBE_SCALE
  assert slow.scale == tuning.LARGE_PROGRAM_PROBE_SCALE < tuning.PROBE_SCALE
  slow.need(hbm_guard.Plan(microbatches=1))
  slow.observe(hbm_guard.Plan(microbatches=1), real_bytes=117 * MiB, fits=False, seconds=30.0)
  assert abs(slow.scale - 1.3) < 1e-9  # a measured ratio replaces the prior


def test_dear_probes_take_fewer_microbatches_when_the_anchor_probe_fits():
  # 937M on v5e:2x2, data parallel: 5.22 GiB at k = 16, 9.11 at k = 2, 12.78 unsplit.
  # The model only looked above its anchor (k = 4); the anchor fits, and so does k = 1.
  figures = {16: 5.22, 8: 5.8, 4: 6.58, 2: 9.11, 1: 12.78}
  probes = []
  def probe(plan):
    probes.append(plan.microbatches)
    return int(figures[plan.microbatches] * 2**30)
  planner = driver_lib.Driver(probe, lambda plan: 1e12, capacity=int(15.75 * 2**30),
                                scale=1.0, clock=_Clock(120.0))
  planner.observe(hbm_guard.Plan(), real_bytes=int(25.12 * 2**30), fits=False, seconds=60.0)
  family = hbm_guard.Plan(donate_argnums=(0,), shard_state=True, shard_batch=True)
  choice = cheapest.choose(planner, [family], [1, 2, 4, 8, 16], offload_bytes=0)
  assert choice.plan.microbatches == 1 and probes == [16, 2, 1]
  figures[1] = 15.5  # unsplit does not fit: the anchor's own count
  planner = driver_lib.Driver(probe, lambda plan: 1e12, capacity=int(15.75 * 2**30),
                                scale=1.0, clock=_Clock(120.0))
  planner.observe(hbm_guard.Plan(), real_bytes=int(25.12 * 2**30), fits=False, seconds=60.0)
  assert cheapest.choose(planner, [family], [1, 2, 4, 8, 16], offload_bytes=0).plan.microbatches == 2


def test_a_later_family_searches_only_the_counts_that_would_cost_less():
  # The README job's figures (MiB, by microbatch count): the remat family is dearer per
  # step but fits at fewer microbatches. Its search starts below the count at which it
  # would cost more than the donated family's best (8 microbatches).
  figures = {None: {1: 682, 2: 336.5, 4: 155.04, 8: 67.34, 16: 64, 32: 62, 64: 61.15},
             "dots": {1: 300, 2: 138.54, 4: 61.65, 8: 61.9, 16: 61, 32: 60.6, 64: 60.48}}
  probed = []
  def probe(plan):
    probed.append((plan.remat_policy, plan.microbatches))
    return int(figures[plan.remat_policy][plan.microbatches] * MiB)
  flops = lambda plan: 1.0e11 if plan.remat_policy is None else 1.02e11  # noqa: E731
  planner = driver_lib.Driver(probe, flops, capacity=96 * MiB, scale=1.3)
  choice = cheapest.choose(planner, [hbm_guard.Plan(), hbm_guard.Plan(remat_policy="dots")],
                          [1, 2, 4, 8, 16, 32, 64], offload_bytes=0)
  assert choice.plan == hbm_guard.Plan(remat_policy="dots", microbatches=4)
  remat = [k for policy, k in probed if policy == "dots"]
  assert remat == [4, 2]  # 1.02 x (1 + 0.01 x 4) >= 1.07 from 5 microbatches on: not probed
  assert len(probed) == 6


def test_probes_side_by_side_search_thirds_two_at_a_time():
  # The README job's figures again, with probes in a pool: after the first pair (64, 8)
  # the donated family's bisection reads 2 and 4 in one round, not one after the other.
  figures = {None: {1: 682, 2: 336.5, 4: 155.04, 8: 67.34, 16: 64, 32: 62, 64: 61.15},
             "dots": {1: 300, 2: 138.54, 4: 61.65, 8: 61.9, 16: 61, 32: 60.6, 64: 60.48}}
  rounds = []
  def start_probes(plans):
    rounds.append([(p.remat_policy, p.microbatches) for p in plans])
    return [lambda p=p: (int(figures[p.remat_policy][p.microbatches] * MiB), 1.0)
            for p in plans]
  flops = lambda plan: 1.0e11 if plan.remat_policy is None else 1.02e11  # noqa: E731
  for side_by_side, want in ((True, 3), (False, 4)):
    rounds.clear()
    planner = driver_lib.Driver(lambda p: start_probes([p])[0]()[0], flops,
                                  capacity=96 * MiB, scale=1.3,
                                  start_probes=start_probes, side_by_side=side_by_side)
    choice = cheapest.choose(planner, [hbm_guard.Plan(), hbm_guard.Plan(remat_policy="dots")],
                            [1, 2, 4, 8, 16, 32, 64], offload_bytes=0)
    assert choice.plan == hbm_guard.Plan(remat_policy="dots", microbatches=4)
    assert len(rounds) == want and sum(map(len, rounds)) == 6, rounds
  assert rounds[:2] == [[(None, 64), (None, 8)], [(None, 2)]]  # one at a time, without
  # the same plan whatever the figures: every count of a family, fitting from any one on
  for first_fit in range(1, 8):
    counts = [1, 2, 4, 8, 16, 32, 64]
    need = {k: (50 if i + 1 >= first_fit else 500) * MiB for i, k in enumerate(counts)}
    got = []
    for side_by_side in (True, False):
      planner = driver_lib.Driver(
          lambda p: need[p.microbatches], lambda p: 1e9, capacity=96 * MiB, scale=1.3,
          side_by_side=side_by_side,
          start_probes=lambda plans: [lambda p=p: (need[p.microbatches], 1.0) for p in plans])
      got.append(cheapest.choose(planner, [hbm_guard.Plan()], counts, offload_bytes=0).plan.microbatches)
    assert got[0] == got[1] == counts[first_fit - 1]


def test_what_is_made_while_the_first_compile_runs_is_what_the_planner_starts_with():
  # prepare.fallback lowers these probes and prices these families while a fit's first
  # compile runs; a planner asking for others would waste that work.
  rungs = ladder_lib.load_ladder()
  facts = rungs_lib.StepFacts(platform="tpu", num_devices=1, plan_reads=frozenset({"*"}),
                               state_argnums=(0,), state_bytes=40 * MiB, batch_size=16)
  for seconds, dear in ((60.0, True), (2.0, False)):
    started, priced = [], []
    def start_probes(plans, started=started):
      started.append([p.microbatches for p in plans])
      return [lambda: (None, 1.0) for _ in plans]
    def flops(plan, priced=priced):
      priced.append(plan)
      return 1e12 * (1.2 if plan.remat_policy else 1.0)
    planner = driver_lib.Driver(lambda p: None, flops, capacity=int(15.75 * 2**30),
                                  start_probes=start_probes)
    planner.observe(hbm_guard.Plan(), real_bytes=None, fits=False, seconds=seconds)
    fams, counts, _ = space.families(rungs, hbm_guard.Plan(), facts, "numerics")
    cheapest.choose(planner, fams, counts, offload_bytes=0)
    probes, others = space.opening(rungs, hbm_guard.Plan(), facts, "numerics", dear)
    assert started[0] == [p.microbatches for p in probes] == ([16, 2] if dear else [16, 4])
    assert {p.donate_argnums for p in probes} == {(0,)} and len(fams) > 1
    first = dataclasses.replace(probes[0], microbatches=1, rungs=())
    assert {dataclasses.replace(p, rungs=()) for p in priced} == {
        dataclasses.replace(p, rungs=()) for p in others} | {first}


def _readme_planner(figures, fits_by_compile, rounds, compiled, capacity=96 * MiB):
  """The README job's figures, probes in a pool, and real compiles beside them."""
  def start_probes(plans):
    rounds.append([(p.remat_policy, p.microbatches) for p in plans])
    return [lambda p=p: (int(figures[p.remat_policy][p.microbatches] * MiB), 1.0)
            for p in plans]
  def start_compile(plan):
    compiled.append((plan.remat_policy, plan.microbatches))
    fits = fits_by_compile(plan)
    return lambda: (int(figures[plan.remat_policy][plan.microbatches] * MiB), 10.0, fits)
  flops = lambda plan: 1.0e11 if plan.remat_policy is None else 1.02e11  # noqa: E731
  planner = driver_lib.Driver(lambda p: start_probes([p])[0]()[0], flops,
                                capacity=capacity, scale=1.3, start_probes=start_probes,
                                side_by_side=True, start_compile=start_compile)
  return cheapest.choose(planner, [hbm_guard.Plan(), hbm_guard.Plan(remat_policy="dots")],
                        [1, 2, 4, 8, 16, 32, 64], offload_bytes=0), planner


_README_FIGURES = {None: {1: 682, 2: 336.5, 4: 155.04, 8: 67.34, 16: 64, 32: 62, 64: 61.15},
                   "dots": {1: 300, 2: 138.54, 4: 61.65, 8: 61.9, 16: 61, 32: 60.6, 64: 60.48}}


def test_beside_a_compile_taken_to_fit_only_a_count_worth_a_probe_is_probed():
  # A family's most microbatches is compiling: a fewer count is probed beside it only where
  # the model prices it BESIDE_GAIN (3%) cheaper. Under microbatch(4) (1.03 of one), 2 and 1
  # are 1.9 and 2.9% cheaper: the compile is the answer, nothing is probed. Under
  # microbatch(8) (1.07) they are worth it: 2 fits, 1 does not.
  figures = {1: 120, 2: 80, 4: 60, 8: 50}
  for counts, rounds_then, answer in (([1, 2, 4], [], 4), ([1, 2, 4, 8], [[2], [1]], 2)):
    rounds, compiled = [], []
    def start_probes(plans, rounds=rounds):
      rounds.append([p.microbatches for p in plans])
      return [lambda p=p: (figures[p.microbatches] * MiB, 1.0) for p in plans]
    def start_compile(plan, compiled=compiled):
      compiled.append(plan.microbatches)
      return lambda: (figures[plan.microbatches] * MiB, 10.0, True)
    planner = driver_lib.Driver(lambda p: start_probes([p])[0]()[0], lambda p: 1.0e11,
                                capacity=100 * MiB, scale=1.0, start_probes=start_probes,
                                side_by_side=True, start_compile=start_compile)
    k = bisection.smallest_count(planner, hbm_guard.Plan(), counts, decisive=True)
    assert (k, rounds, compiled) == (answer, rounds_then, [counts[-1]])


def test_while_the_floor_is_probed_the_next_familys_decisive_compile_is_lowered():
  # The README job: its failure (682.37 MiB, 36.9 of state) leaves 8 as the plain family's
  # floor. If 8 fits, it bounds the remat family to 1, 2 and 4, and remat at 4 is then
  # compiled beside the probe of 2: it is lowered while 8 is probed, not after.
  events = []
  def start_probes(plans):
    events.append(("probe", [(p.remat_policy, p.microbatches) for p in plans]))
    def read(p):
      events.append(("read", p.remat_policy, p.microbatches))
      return int(_README_FIGURES[p.remat_policy][p.microbatches] * MiB), 1.0
    return [functools.partial(read, p) for p in plans]
  def start_compile(plan):
    events.append(("compile", plan.remat_policy, plan.microbatches))
    return lambda: (int(61.65 * MiB), 7.0, True)
  def lower(plan):
    events.append(("lower", plan.remat_policy, plan.microbatches))
  flops = lambda plan: 1.0e11 if plan.remat_policy is None else 1.02e11  # noqa: E731
  planner = driver_lib.Driver(
      lambda p: start_probes([p])[0]()[0], flops, capacity=96 * MiB, scale=1.3,
      start_probes=start_probes, side_by_side=True, start_compile=start_compile,
      stage_ahead=lower)
  planner.update(state_lib.with_state_bytes, int(36.9 * MiB))
  planner.observe(hbm_guard.Plan(), real_bytes=int(682.37 * MiB), fits=False, seconds=1.0)
  choice = cheapest.choose(planner, [hbm_guard.Plan(), hbm_guard.Plan(remat_policy="dots")],
                          [1, 2, 4, 8, 16, 32, 64], offload_bytes=0)
  assert choice.plan == hbm_guard.Plan(remat_policy="dots", microbatches=4)
  assert events[:4] == [("probe", [(None, 8)]), ("lower", "dots", 4), ("read", None, 8),
                        ("compile", "dots", 4)]


def test_the_decisive_plan_is_compiled_beside_the_probes_not_probed():
  # A plain family's fit (microbatch 8) bounds the remat family to 1, 2, 4: if 2 does not
  # fit, 4 is the choice, so its probe would only decide whether to compile it. It is
  # compiled at once (a plan that does not fit fails libtpu's early check as fast as a
  # probe), beside the probe of 2; the choice is that compile's, with its own figure.
  # It is the dearest plan cheaper than microbatch(8), so it starts as soon as the plain
  # family has one round left (2 and 4), not after it: 4 probes after the first pair's,
  # the plain family's from the top down (4 does not fit: nor does 2), one at a time. Remat
  # at 2 is not probed beside it: 1.9% cheaper by the model, not worth slowing the compile.
  rounds, compiled = [], []
  choice, planner = _readme_planner(_README_FIGURES, lambda p: True, rounds, compiled)
  assert choice.plan == hbm_guard.Plan(remat_policy="dots", microbatches=4)
  assert compiled == [("dots", 4)]
  assert rounds == [[(None, 64), (None, 8)], [(None, 4)]]
  assert [p.compiled for p in planner.probes] == [False] * 3 + [True]  # read last
  events = []  # in the order they started: the compile before the plain family's last probe
  _readme_planner(_README_FIGURES, lambda p: True, events, events)
  assert events == [[(None, 64), (None, 8)], ("dots", 4), [(None, 4)]]
  assert choice.predicted_bytes == int(61.65 * MiB) and "compiled beside" in choice.why
  assert [p.compiled for p in planner.probes].count(True) == 1


def test_a_decisive_compile_that_does_not_fit_or_is_beaten_is_not_chosen():
  # Its compile says it does not fit: the family has nothing below the bound, and the
  # plain family's fit stands (and calibrates nothing: the figure is a compile's own).
  rounds, compiled = [], []
  choice, planner = _readme_planner(_README_FIGURES, lambda p: False, rounds, compiled)
  assert compiled == [("dots", 4)]
  assert choice.plan == hbm_guard.Plan(microbatches=8) and planner.scale == 1.3
  # Fewer microbatches that fit by their probe beat it (the next test: remat at 4 beside
  # remat at 8's compile), the compile left unread.


def test_no_compile_is_started_ahead_from_a_familys_top():
  # jax 0.10's figures: microbatch(8) does not fit, so the plain family's bound is its top
  # (64) until 16 and 32 are read; the dearest plan below 64 (remat at 32) says nothing of
  # the answer, so nothing is compiled ahead. The remat family's own decisive compile (8,
  # cheaper than microbatch(16)) then runs beside its probes, and a probe of 4 beats it.
  figures = {None: {**_README_FIGURES[None], 8: 75.56, 16: 61.65},
             "dots": {**_README_FIGURES["dots"], 8: 61.0}}
  events = []
  choice, _ = _readme_planner(figures, lambda p: True, events, events)
  assert events == [[(None, 64), (None, 8)], [(None, 16), (None, 32)], ("dots", 8),
                    [("dots", 2)], [("dots", 4)]]
  assert choice.plan == hbm_guard.Plan(remat_policy="dots", microbatches=4)
  assert "compiled beside" not in choice.why  # the probe's choice, not the compile's


def test_no_compile_is_started_ahead_where_the_bounding_family_is_flat():
  # bench_fit's activations case (40 MiB): 15.40 MiB at 64 microbatches and 15.61 at 8
  # predict that 4 fits as well, so the answer is likely the plain family's, and a remat
  # compile started ahead would only be beaten, then contend with the compile that follows
  # (the fit took 28-33 s with it, 20 s without).
  figures = {None: {1: 133.78, 2: 27.76, 4: 15.53, 8: 15.61, 16: 15.5, 32: 15.45, 64: 15.40},
             "dots": {1: 60.0, 2: 20.0, 4: 12.0, 8: 11.0, 16: 10.5, 32: 10.2, 64: 10.0}}
  events = []
  choice, _ = _readme_planner(figures, lambda p: True, events, events, capacity=40 * MiB)
  assert choice.plan == hbm_guard.Plan(microbatches=2)
  # Nothing compiled beside but the answer: once 2 bounds the family, the line through 2
  # and 64 puts 1 over, so 2 is compiled beside the probe of 1.
  assert [e for e in events if isinstance(e, tuple)] == [(None, 2)]


def test_the_bound_is_compiled_beside_the_last_probe_its_line_says_fails():
  # A mixture of experts on v5e:1x1 (bench_archs' figures, GiB): 16 fits by its probe, 4
  # does not; through the two, 8 is at 12.2, over once scaled. So 16 is compiled at once,
  # beside the probe of 8, not after it (74 s -> 64 s of a fit whose compile takes 36).
  needs = {1: 30.5, 2: 22.0, 4: 16.60, 8: 11.72, 16: 10.08}
  events = []
  def start_probes(plans):
    events.append([p.microbatches for p in plans])
    return [lambda p=p: (int(needs[p.microbatches] * GiB), 10.0) for p in plans]
  def start_compile(plan):
    events.append(("compile", plan.microbatches))
    return lambda: (int(12.75 * GiB), 36.0, True)
  planner = driver_lib.Driver(lambda p: start_probes([p])[0]()[0], lambda p: 1.0e11,
                              capacity=int(15.75 * GiB), scale=1.3, start_probes=start_probes,
                              side_by_side=True, start_compile=start_compile)
  k = bisection.smallest_count(planner, hbm_guard.Plan(), [1, 2, 4, 8, 16])
  assert k == 16
  assert events == [[16, 4], ("compile", 16), [8]]


GiB = 2**30
# 368M parameters on v5e:1x1 (#17), real figures: the plain step failed at 81.19 GiB
# (undonated, unsplit); the donated families' compiles need these, in GiB.
_LM_NEEDS = {None: {1: 76.0, 2: 62.0, 4: 33.0, 8: 18.8, 16: 11.6},
             "dots": {1: 19.87, 2: 15.62, 4: 11.0, 8: 8.6, 16: 7.5}}
_LM_FLOPS = {None: 3.803e13, "dots": 3.973e13}


def _racing_planner(needs, events, capacity=15.75, flops=None, plain=81.19, state=4.1):
  """A planner whose probes are dear (an 18-s failed compile) and whose compiles run side
  by side: it races compiles at the capacity."""
  def start_compile(plan):
    events.append(("start", plan.remat_policy, plan.microbatches))
    def read():
      events.append(("read", plan.remat_policy, plan.microbatches))
      need = int(needs[plan.remat_policy][plan.microbatches] * GiB)
      return need, 15.0, need <= capacity * GiB
    read.done = lambda: ("read", plan.remat_policy, plan.microbatches) in events
    return read
  planner = driver_lib.Driver(
      lambda p: 1 / 0, lambda p: (flops or _LM_FLOPS)[p.remat_policy],
      capacity=int(capacity * GiB),
      scale=1.3, side_by_side=True, start_compile=start_compile,
      start_probes=lambda plans: 1 / 0)  # a probe here fails the test
  planner.update(state_lib.with_state_bytes, int(state * GiB))
  planner.observe(hbm_guard.Plan(), real_bytes=int(plain * GiB), fits=False, seconds=18.0)
  donated = hbm_guard.Plan(donate_argnums=(0,))
  families = [donated, dataclasses.replace(donated, remat_policy="dots")]
  return planner, families


def test_where_probes_are_dear_the_cheapest_candidates_are_compiled_not_probed():
  # The plain family's 1, 2 and 4 microbatches cannot fit by the failed compile's figure
  # (81.19 GiB less the state twice, split four ways, is still 22 GiB); the cheapest left
  # are remat at 1 and 2 (4.5% more flops, +1% a microbatch): both compiled at once, the
  # dearer first. The cheaper fails; the dearer fits and is the choice, no probe made.
  events = []
  planner, families = _racing_planner(_LM_NEEDS, events)
  assert planner.races
  choice = cheapest.choose(planner, families, [1, 2, 4, 8, 16], offload_bytes=0, race=True)
  assert choice.plan.remat_policy == "dots" and choice.plan.microbatches == 2
  assert events == [("start", "dots", 2), ("start", "dots", 1), ("read", "dots", 1),
                    ("read", "dots", 2)]
  assert [p.compiled for p in planner.probes] == [True, True]
  assert choice.predicted_bytes == int(15.62 * GiB)
  assert planner_lib.program(choice.plan) in planner.state.fit_by_compile


def test_a_race_goes_on_from_what_its_failures_rule_out():
  # Remat at 2 fails too (16.2 GiB): the next round is the plain family at 8 (bounded at
  # 13.2 GiB by the failed compile, so a contender) and remat at 4; no third compile is
  # started while a cheaper one runs.
  needs = {None: _LM_NEEDS[None], "dots": {**_LM_NEEDS["dots"], 2: 16.2}}
  events = []
  planner, families = _racing_planner(needs, events)
  choice = cheapest.choose(planner, families, [1, 2, 4, 8, 16], offload_bytes=0, race=True)
  assert choice.plan.remat_policy == "dots" and choice.plan.microbatches == 4
  assert events == [("start", "dots", 2), ("start", "dots", 1), ("read", "dots", 1),
                    ("read", "dots", 2), ("start", "dots", 4), ("start", None, 8),
                    ("read", None, 8), ("read", "dots", 4)]


def test_a_race_compiles_only_what_its_failures_leave_open_and_ends_with_none():
  # 6 GiB: the plain family is bounded more than BOUND_SLACK over it at every count (8.66
  # GiB at 16). Remat fails at 1 (19.87 GiB), which bounds 2 at 9.9: the compile of 2 is
  # not waited for, but holds a core while it runs, so 4, 8 and 16 follow one at a time.
  events = []
  planner, families = _racing_planner(_LM_NEEDS, events, capacity=6.0)
  assert cheapest.choose(planner, families, [1, 2, 4, 8, 16], offload_bytes=0, race=True) is None
  assert events == [("start", "dots", 2), ("start", "dots", 1), ("read", "dots", 1),
                    ("start", "dots", 4), ("read", "dots", 4), ("start", "dots", 8),
                    ("read", "dots", 8), ("start", "dots", 16), ("read", "dots", 16)]


# A 1B decoder LM fine-tuned on v5e:1x1 (#57), real figures in GiB: per-layer remat needed
# more than no remat at 1 and 2 microbatches (its saved outputs outweigh what it frees).
_REMAT_WORSE = {None: {1: 20.19, 2: 17.18, 4: 15.3, 8: 14.9},
                "dots": {1: 25.23, 2: 19.20, 4: 16.5, 8: 15.0}}


def _raced(needs, remat_flops, plain, state):
  """(the race's choice, (policy, count) of each compile started, the events, the planner)
  for a step whose plain compile failed at `plain` GiB with `state` GiB of state."""
  events = []
  planner, families = _racing_planner(needs, events, flops={None: 1e13, "dots": remat_flops},
                                      plain=plain, state=state)
  choice = cheapest.choose(planner, families, [1, 2, 4, 8], offload_bytes=0, race=True)
  return choice, [e[1:] for e in events if e[0] == "start"], events, planner


def test_a_remat_family_that_needs_more_than_none_is_not_searched_further():
  # No remat at 1 and 2 fail (20.19, 17.18 GiB): F + P / k through them puts microbatch(4)
  # at 15.68 GiB, under the capacity. The next round is the cheapest left (remat at 1)
  # beside that plan, not remat at 1 and 2. Remat at 1 needs more than no remat at 1: its
  # family is not searched further, and microbatch(4), which fits, is the choice, three
  # rounds where the 1B LM took four. The planning says why remat was left.
  choice, started, events, planner = _raced(_REMAT_WORSE, 1.01e13, 25.27, 9.0)
  assert (choice.plan.remat_policy, choice.plan.microbatches) == (None, 4)
  assert started == [(None, 2), (None, 1), (None, 4), ("dots", 1)], events
  notes = model.remat_notes(planner.state)
  assert len(notes) == 1 and "not less than 20.19 GiB without remat" in notes[0], notes


def test_a_race_candidate_its_familys_failures_predict_fits_is_compiled_alone():
  # Remat priced cheaper (as no real remat is) is raced first at 1 and 2 (25.23, 19.20
  # GiB); remat at 8, predicted at 14.68, does not take a place beside no remat at 1, whose
  # figure may rule remat out (it does). No remat fails at 1 and 2, which put 4 at 15.68:
  # it is compiled alone, microbatch(8) not beside it.
  choice, started, events, planner = _raced(_REMAT_WORSE, 0.99e13, 25.27, 9.0)
  assert (choice.plan.remat_policy, choice.plan.microbatches) == (None, 4)
  assert started == [("dots", 2), ("dots", 1), (None, 2), (None, 1), (None, 4)], events
  assert events[-2:] == [("start", None, 4), ("read", None, 4)]


# An encoder-decoder (T5's shape, 386M) on v5e:1x1 (bench_archs), real figures in GiB: its
# plain step failed at 40.01 with 5.75 of state; donated remat needed more than that.
_ENCDEC = {None: {1: 34.5, 2: 18.54, 4: 15.1, 8: 12.0},
           "dots": {1: 41.93, 2: 22.0, 4: 15.5, 8: 12.5}}


def test_the_undonated_failure_less_the_state_is_a_point_of_the_donated_line():
  # Round one: remat at 1 beside microbatch(2) (no remat at 1 is bounded out by the plain
  # step's failure); both fail. Remat needed more than the plain step did undonated, so
  # its family is out; 40.01 - 5.75 at 1 and 18.54 at 2 put microbatch(4) at 10.7 GiB:
  # it is compiled alone, not beside remat at 4 (which took the decisive compile from 75
  # s to 161).
  choice, started, events, planner = _raced(_ENCDEC, 1.005e13, 40.01, 5.75)
  assert (choice.plan.remat_policy, choice.plan.microbatches) == (None, 4)
  assert started == [(None, 2), ("dots", 1), (None, 4)], events
  assert "not less than 40.01 GiB without remat" in model.remat_notes(planner.state)[0]


def test_remat_that_frees_memory_stays_searched():
  planner, families = _racing_planner(_LM_NEEDS, [])
  donated, dots = families
  at = lambda f, k: dataclasses.replace(f, microbatches=k)  # noqa: E731
  planner.observe(at(dots, 1), real_bytes=int(19.87 * GiB), fits=False)
  planner.observe(at(donated, 1), real_bytes=int(76.0 * GiB), fits=False)
  assert model.remat_no_help(planner.state, at(dots, 4)) is None
  assert not model.ruled_out(planner.state, at(dots, 4))
  assert model.remat_notes(planner.state) == []


def test_a_lower_bound_comes_from_the_familys_real_failures():
  planner, families = _racing_planner(_LM_NEEDS, [])
  donated, dots = families
  at = lambda f, k: dataclasses.replace(f, microbatches=k)  # noqa: E731
  # 4.1 + (81.19 - 8.2) / k: a donated plan aliases at most the state's output
  assert abs(model.lower_bound(planner.state, at(donated, 2)) / GiB - 40.60) < 0.01
  assert abs(model.lower_bound(planner.state, at(donated, 16)) / GiB - 8.66) < 0.01
  assert model.lower_bound(planner.state, at(dots, 2)) == 0.0  # another family: nothing known
  planner.observe(at(donated, 8), real_bytes=int(18.8 * GiB), fits=False)
  assert model.lower_bound(planner.state, at(donated, 4)) == float("inf")  # fewer split: needs more
  assert model.lower_bound(planner.state, at(donated, 8)) == float("inf")
  assert model.lower_bound(planner.state, at(donated, 16)) < float("inf")
  # The unsplit program is another: a failed split count says nothing of it
  assert model.lower_bound(planner.state, at(donated, 1)) < float("inf")


def test_what_is_lowered_while_a_dear_first_compile_runs_is_what_a_race_starts_with():
  events = []
  planner, families = _racing_planner(_LM_NEEDS, events)
  cheapest.choose(planner, families, [1, 2, 4, 8, 16], offload_bytes=0, race=True)
  ahead = space.race_opening(families[1:], [1, 2, 4, 8, 16],
                                   lambda f: _LM_FLOPS[f.remat_policy], 2, 0)
  started = [(p, k) for e, p, k in events if e == "start"]
  assert [(p.remat_policy, p.microbatches) for p in ahead] == started


def test_a_race_keeps_a_plan_bounded_just_over_the_capacity():
  # The README job: the plain step failed at 682.37 MiB (state 36.9), which "bounds"
  # microbatch(8) at 113 MiB, and that plan fits in 96: a bound is believed only
  # BOUND_SLACK over the capacity, so the race may still compile it.
  planner = driver_lib.Driver(lambda p: 1 / 0, lambda p: 1e9, capacity=96 * MiB,
                                side_by_side=True, start_probes=lambda plans: 1 / 0,
                                start_compile=lambda plan: 1 / 0)
  planner.update(state_lib.with_state_bytes, int(36.9 * MiB))
  planner.observe(hbm_guard.Plan(), real_bytes=int(682.37 * MiB), fits=False, seconds=18.0)
  donated = hbm_guard.Plan(donate_argnums=(0,))
  at = lambda k: dataclasses.replace(donated, microbatches=k)  # noqa: E731
  assert model.lower_bound(planner.state, at(8)) > 96 * MiB
  kept = race.contenders(planner, [donated], [2, 4, 8, 16])  # pylint: disable=protected-access
  assert kept == [at(8), at(16)]  # 2 and 4 are bounded at 341 and 189 MiB


def test_a_family_that_cannot_close_the_gap_is_not_probed_ahead():
  # The 368M step at batch 64, flags and donation only: the failed compile's 38.61 GiB
  # less the state, halved, is over 15.75 GiB. Pricing a higher class for the report
  # started a dear probe of it anyway (2 s of lowering, a compile never read).
  started = []
  planner = driver_lib.Driver(
      lambda p: 1 / 0, lambda p: 1e12, capacity=int(15.75 * GiB), side_by_side=True,
      start_probes=lambda plans: started.extend(plans) or [lambda: (None, 1.0)] * len(plans))
  planner.update(state_lib.with_state_bytes, int(4.1 * GiB))
  planner.observe(hbm_guard.Plan(), real_bytes=int(38.61 * GiB), fits=False, seconds=18.0)
  donated = hbm_guard.Plan(donate_argnums=(0,))
  assert cheapest.choose(planner, [donated], [1], offload_bytes=0) is None
  assert not started


def test_where_the_planner_races_the_xla_flags_are_compiled_not_probed():
  # The 368M step with only flags and donation (batch 16): a probe of every flag at once
  # took 68 s and the compile after it 70 s. Racing, `donate` is compiled beside (and
  # fails, 32.35 GiB), then the flags plan is the climb's next compile, not probed; once
  # that compile failed, the flags are passed over and nothing is probed.
  from hbm_guard._src.backends import compile as compile_lib  # pylint: disable=g-import-not-at-top
  facts = dataclasses.replace(_flags_only_facts(), state_bytes=int(4.1 * GiB))
  raced = []
  def start_compile(plan):
    raced.append(plan.describe())
    return lambda: (int(32.35 * GiB), 12.0, False)
  planner = driver_lib.Driver(
      lambda p: 1 / 0, lambda plan: 1e12, capacity=int(15.75 * GiB), side_by_side=True,
      start_probes=lambda plans: 1 / 0, start_compile=start_compile)
  real = int(19.52 * GiB)
  planner.observe(hbm_guard.Plan(), real_bytes=real, fits=False, seconds=30.0)
  rec = compile_lib.budget_record({"peak": real, "argument": 4 * GiB, "output": 0,
                                   "alias": 0, "temp": real - 4 * GiB, "generated_code": 0},
                                  int(15.75 * GiB), "fake")
  ladder = ladder_lib.load_ladder()
  nxt, _, _ = planner_lib.next_plan(planner, ladder, hbm_guard.Plan(), facts, rec, "numerics")
  assert planner.races and len(nxt.compiler_options) > 1 and nxt.donate_argnums == (0,)
  planner.observe(nxt, real_bytes=int(16.5 * GiB), fits=False, seconds=60.0)
  after, skips, _ = planner_lib.next_plan(planner, ladder, nxt, facts, rec, "numerics")
  assert after is None or after.compiler_options != nxt.compiler_options
  assert raced == ["donate"] and all(p.compiled for p in planner.probes)


def test_a_count_its_familys_failure_bounds_far_over_the_capacity_is_not_probed():
  # The README job: the plain step failed at 682.37 MiB (state 36.9), which bounds
  # donate + microbatch(4) at 189 MiB, twice the 96 MiB capacity (its probe read 155):
  # the bisection takes it not to fit without a probe, as a race would.
  figures = {64: 61.15, 32: 62.0, 16: 63.0, 8: 67.34, 4: 155.04, 2: 336.5, 1: 657.0}
  probed = []
  def probe(plan):
    probed.append(plan.microbatches)
    return int(figures[plan.microbatches] * MiB)
  planner = driver_lib.Driver(probe, lambda plan: 1e9, capacity=96 * MiB,
                                scale=tuning.PROBE_SCALE)
  planner.update(state_lib.with_state_bytes, int(36.9 * MiB))
  planner.observe(hbm_guard.Plan(), real_bytes=int(682.37 * MiB), fits=False, seconds=1.8)
  donated = hbm_guard.Plan(donate_argnums=(0,))
  assert model.bounded_out(planner.state, dataclasses.replace(donated, microbatches=4))
  assert not model.bounded_out(planner.state, dataclasses.replace(donated, microbatches=8))  # 113 MiB
  choice = cheapest.choose(planner, [donated], [1, 2, 4, 8, 16, 32, 64], offload_bytes=0)
  assert choice.plan.microbatches == 8
  assert probed == [8]  # 4 and fewer are bounded out and 8 fits: no top (before: [64, 8])


@pytest.mark.parametrize("width, started", [(2, [8]), (4, [8, 64])])
def test_the_top_is_probed_beside_the_floor_only_where_a_core_is_left_over(width, started):
  # The README job's figures, probes side by side: on two cores the floor alone (the top
  # would slow it), on more the top beside it, ready if the floor does not fit.
  figures = {64: 61.15, 32: 62.0, 16: 63.0, 8: 67.34, 4: 155.04, 2: 336.5, 1: 657.0}
  starts = []
  def start_probes(plans):
    starts.append(sorted(p.microbatches for p in plans))
    return [lambda p=p: (int(figures[p.microbatches] * MiB), 1.0) for p in plans]
  planner = driver_lib.Driver(lambda p: 1 / 0, lambda plan: 1e9, capacity=96 * MiB,
                                scale=tuning.PROBE_SCALE, start_probes=start_probes,
                                width=width)
  planner.update(state_lib.with_state_bytes, int(36.9 * MiB))
  planner.observe(hbm_guard.Plan(), real_bytes=int(682.37 * MiB), fits=False, seconds=1.8)
  donated = hbm_guard.Plan(donate_argnums=(0,))
  choice = cheapest.choose(planner, [donated], [1, 2, 4, 8, 16, 32, 64], offload_bytes=0)
  assert choice.plan.microbatches == 8 and starts[0] == started
  assert [p.plan.microbatches for p in planner.probes] == [8]  # the top, if started: unread


def test_a_top_count_without_a_figure_is_searched_below_for_every_family():
  """A probe that cannot measure the most microbatches (the trace does not split the batch
  there: a microbatch of one example) leaves the family searched below it, and that count
  out of every family's search; at most MAX_PASSED_OVER such counts."""
  probed = []
  def probe(plan):
    probed.append(plan.microbatches)
    return None if plan.microbatches == 8 else int((40 + 160 / plan.microbatches) * MiB)
  planner = driver_lib.Driver(probe, lambda plan: 1e9, capacity=100 * MiB, scale=1.0)
  donate = hbm_guard.Plan(donate_argnums=(0,))
  assert bisection.smallest_count(planner, donate, [1, 2, 4, 8]) == 4  # 80 MiB; 2 needs 120
  assert planner.state.unmeasured == {8}
  remat = dataclasses.replace(donate, remat_policy="nothing_saveable")
  choice = cheapest.choose(planner, [donate, remat], [1, 2, 4, 8], offload_bytes=0)
  assert choice.plan.microbatches == 4
  assert probed.count(8) == 1  # the count no probe measures is not asked again
  never = driver_lib.Driver(lambda plan: None, lambda plan: 1e9, capacity=100 * MiB)
  assert bisection.smallest_count(never, donate, [1, 2, 4, 8, 16]) is None
  assert len(never.state.unmeasured) == tuning.MAX_PASSED_OVER


def test_a_top_count_reading_above_a_real_compile_of_fewer_is_looked_below():
  """Need falls with the count, except where a microbatch of one example pads (a ViT's
  2.12 GiB at 64 of 64 against 671 MiB at 32, its unsplit step's compile 1.66 GiB): a top
  figure above a real compile of fewer microbatches gets the count below measured; a top
  figure under it that does not fit gives the family up without another probe (after the
  fewest count the failure leaves, 2, read first as the likeliest answer)."""
  def run(top_mib):
    probed = []
    def probe(plan):
      probed.append(plan.microbatches)
      k = plan.microbatches
      return int((top_mib if k == 8 else 40 + 120 / k) * MiB)
    planner = driver_lib.Driver(probe, lambda plan: 1e9, capacity=100 * MiB, scale=1.0)
    planner.observe(hbm_guard.Plan(), real_bytes=166 * MiB, fits=False)
    count = bisection.smallest_count(planner, hbm_guard.Plan(donate_argnums=(0,)), [1, 2, 4, 8])
    return count, probed
  count, probed = run(top_mib=212)  # above the unsplit step's real 166: not need's fall
  assert count == 4 and 4 in probed  # 100 MiB at 2 is over 95; 70 at 4
  assert run(top_mib=150) == (None, [2, 8])  # under 166 and over 95: the family cannot fit


def test_a_refusals_hint_costs_a_few_probes_not_a_search():
  # The exact search measured each family unsplit; the wider class's hint predicts the
  # count from F + P / k and probes it, then the count the two figures predict: at most two
  # probes a family, where a bisection over 8 counts took three or four.
  def need(plan):  # the state (20 MiB) plus activations that split
    per = 133 if plan.remat_policy is None else 54
    return int((20 + per / plan.microbatches + (4 if plan.microbatches > 1 else 0)) * MiB)
  probed = []
  def probe(plan):
    probed.append(plan)
    return need(plan)
  flops = lambda p: 1e9 if p.remat_policy is None else 1.3e9  # noqa: E731
  planner = driver_lib.Driver(probe, flops, capacity=43 * MiB, exact=True)
  planner.update(state_lib.with_state_bytes, 20 * MiB)
  donate = hbm_guard.Plan(donate_argnums=(0,))
  dots = dataclasses.replace(donate, remat_policy="dots_with_no_batch_dims_saveable")
  for family in (donate, dots):
    planner.need(family)  # as the exact search left them
  probed.clear()
  choice = hint.wider(planner, [donate, dots], [1, 2, 4, 8, 16, 32], offload_bytes=0)
  assert choice.plan == dataclasses.replace(donate, microbatches=8)  # 20 + 16.6 + 4 <= 40.85
  assert len(probed) <= 2


def test_a_hint_whose_first_split_does_not_shrink_probes_the_floor():
  # The MSE step of test_report_page: its inputs do not split, so its figure at 2 equals the
  # unsplit one and F + P / k through them predicts no count. The family's floor (its most
  # microbatches) is probed next, then the count the floor and the failure predict.
  figures = {1: 2359316, 2: 2359492, 4: 2097284, 8: 1966212, 16: 1900676, 32: 1867908}
  probed = []
  def probe(plan):
    probed.append(plan.microbatches)
    return figures[plan.microbatches]
  def run(capacity):
    planner = driver_lib.Driver(probe, lambda p: 1e9, capacity=capacity, exact=True)
    planner.update(state_lib.with_state_bytes, 256 << 10)
    donate = hbm_guard.Plan(donate_argnums=(0,))
    planner.need(donate)
    probed.clear()
    return hint.wider(planner, [donate], [1, 2, 4, 8, 16, 32], offload_bytes=0)
  choice = run(capacity=2293836)
  assert choice.plan.microbatches == 4 and probed == [2, 32, 4]
  assert run(capacity=1800000) is None and probed == [2, 32]  # the floor fails: none fits
