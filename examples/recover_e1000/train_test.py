"""Fast check of the main job's loop: a tiny config, the same guard, two steps."""

import tempfile

import numpy as np
from absl.testing import absltest

from examples.recover_e1000 import train
from examples.recover_e1000.configs import default


class TrainTest(absltest.TestCase):

  def test_climbs_on_the_cpu_budget_and_trains(self):
    config = default.get_config()
    config.width, config.depth, config.seq, config.batch, config.steps = 32, 2, 16, 16, 2
    # No TPU target here: a CPU budget below the plain step's peak makes the guard climb.
    losses, step = train.train_and_evaluate(
        config, capacity="2MiB", max_class="numerics", plan_cache=False,
        report_dir=tempfile.mkdtemp())
    self.assertLen(losses, 2)
    self.assertTrue(np.all(np.isfinite(losses)))
    self.assertEqual(step.attempts[0].outcome, "oom")
    self.assertEqual(step.attempts[-1].outcome, "fits")
    self.assertNotEqual(step.plan, step.attempts[0].plan)


if __name__ == "__main__":
  absltest.main()
