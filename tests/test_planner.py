"""The planner's probe calibration: a prior until real compiles measure how low probes run."""

import hbm_guard
from hbm_guard._src import planner as planner_lib

MiB = 2**20


def _planner(figures):
  return planner_lib.Planner(lambda plan: figures[plan.microbatches], lambda plan: 1e9,
                             capacity=100 * MiB, scale=planner_lib.PROBE_SCALE)


def test_measured_ratios_replace_the_prior_and_only_ever_grow():
  figures = {1: 90 * MiB, 2: 80 * MiB, 4: 75 * MiB}
  planner = _planner(figures)
  plan = lambda k: hbm_guard.Plan(microbatches=k)  # pylint: disable=unnecessary-lambda-assignment
  assert planner.scale == planner_lib.PROBE_SCALE
  for k in figures:
    planner.need(plan(k))  # as the planner does before it compiles a plan
  assert not planner.fits(planner.need(plan(4)))  # 75 x 1.3 > 95
  planner.observe(plan(2), real_bytes=88 * MiB, fits=False)  # probes run 1.1 low here
  assert abs(planner.scale - 1.1) < 1e-9
  assert planner.fits(planner.need(plan(4)))  # 75 x 1.1 = 82.5 <= 95: worth a compile now
  planner.observe(plan(1), real_bytes=108 * MiB, fits=False)  # 1.2: the larger stands
  assert abs(planner.scale - 1.2) < 1e-9
  planner.observe(plan(4), real_bytes=63 * MiB, fits=True)  # a fit below its probe: ignored
  assert abs(planner.scale - 1.2) < 1e-9


def test_an_unprobed_plan_does_not_calibrate():
  planner = _planner({1: 90 * MiB})
  planner.observe(hbm_guard.Plan(microbatches=1), real_bytes=300 * MiB, fits=False)
  assert planner.scale == planner_lib.PROBE_SCALE


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
  p = planner_lib.Planner(probe, lambda plan: 1e12, capacity=int(15.75 * 2**30), scale=1.0,
                          clock=_Clock(per_probe))
  p.observe(hbm_guard.Plan(), real_bytes=_lm_like(hbm_guard.Plan()), fits=False,
            seconds=5.0 if per_probe < 10 else 60.0)
  return p


def test_dear_probes_predict_the_count_from_two_figures():
  probes = []
  planner = _dear_planner(per_probe=120.0, probes=probes)  # probes as dear as compiles
  choice = planner.choose([hbm_guard.Plan()], [1, 2, 4, 8, 16], offload_bytes=0)
  assert choice.plan.microbatches == 8  # 6 + 58/8 = 13.25 GiB <= 0.95 x 15.75
  # One probe: the failed compile's own figure is the other point of need(k) = F + P / k.
  assert probes == [16] and planner.probes_are_dear


def test_dear_probes_without_a_real_figure_probe_both_ends():
  probes = []
  planner = _dear_planner(per_probe=120.0, probes=probes)
  planner._real.clear()  # pylint: disable=protected-access  (as if the failure had no figure)
  choice = planner.choose([hbm_guard.Plan()], [1, 2, 4, 8, 16], offload_bytes=0)
  assert choice.plan.microbatches == 8 and probes == [16, 2]  # k = 2: the fewest split


def test_another_familys_failure_is_no_anchor():
  # The plain step failed low (an unsplit program, no donation); the donated family's split
  # program holds more at k = 2 than that figure: the model must be anchored in the family.
  probes = []
  def probe(plan):
    probes.append(plan.microbatches)
    return int((8 + 24 / plan.microbatches) * 2**30)  # 20 GiB at k = 2, 9.5 at 16
  planner = planner_lib.Planner(probe, lambda plan: 1e12, capacity=int(15.75 * 2**30),
                                scale=1.0, clock=_Clock(120.0))
  planner.observe(hbm_guard.Plan(), real_bytes=int(19.37 * 2**30), fits=False, seconds=60.0)
  donated = hbm_guard.Plan(donate_argnums=(0,))
  choice = planner.choose([donated], [1, 2, 4, 8, 16], offload_bytes=0)
  # Anchored on the plain figure, k = 2 would be predicted at 14.0 GiB and fail; in the
  # family, 8 + 24/4 = 14 GiB <= 0.95 x 15.75 at k = 4.
  assert probes == [16, 2] and choice.plan.microbatches == 4


def test_a_slow_failed_compile_makes_probes_dear_before_any_probe():
  planner = planner_lib.Planner(lambda p: 1, lambda p: 1.0, capacity=100)
  planner.observe(hbm_guard.Plan(), real_bytes=200, fits=False, seconds=2.0)
  assert not planner.probes_are_dear
  planner.observe(hbm_guard.Plan(microbatches=2), real_bytes=150, fits=False, seconds=17.0)
  assert planner.probes_are_dear


def test_cheap_probes_still_bisect():
  probes = []
  planner = _dear_planner(per_probe=2.0, probes=probes)
  choice = planner.choose([hbm_guard.Plan()], [1, 2, 4, 8, 16], offload_bytes=0)
  assert choice.plan.microbatches == 8 and not planner.probes_are_dear
  assert probes[0] == 16 and len(probes) >= 3 and 8 in probes  # confirmed by a probe
