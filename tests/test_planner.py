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
