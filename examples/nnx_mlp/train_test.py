"""Fast check of the nnx example: a tiny config on a CPU budget, two steps."""

import tempfile

import numpy as np
from absl.testing import absltest

from examples.nnx_mlp import train
from examples.nnx_mlp.configs import default


class TrainTest(absltest.TestCase):

  def test_climbs_and_trains(self):
    config = default.get_config()
    config.width, config.hidden, config.depth, config.batch, config.steps = 64, 64, 2, 256, 2
    losses, step = train.train_and_evaluate(
        config, capacity="600KiB", max_class="numerics", plan_cache=False,
        report_dir=tempfile.mkdtemp())
    self.assertLen(losses, 2)
    self.assertTrue(np.all(np.isfinite(losses)))
    self.assertEqual(step.attempts[0].outcome, "oom")
    self.assertEqual(step.attempts[-1].outcome, "fits")


if __name__ == "__main__":
  absltest.main()
