"""Fits an nnx train step to a v5e chip's budget, then trains it here.

    python -m examples.nnx_mlp.main [--config.batch=2048] [--hbm_guard_max_class=exact]
"""

from absl import app
from ml_collections import config_flags

import hbm_guard
from hbm_guard import flags as hbm_flags
from examples.nnx_mlp import train

_CONFIG = config_flags.DEFINE_config_file(
    "config", "examples/nnx_mlp/configs/default.py", "The job's settings.")


def main(argv):
  del argv
  hbm_guard.quiet_libtpu_on_cpu_host()
  config = _CONFIG.value
  losses, step = train.train_and_evaluate(config, **hbm_flags.guard_options(dict(config.guard)))
  for a in step.attempts:
    print(f"compile #{a.number}: {a.plan.describe()}: {a.outcome}")
  print(f"plan in force: {step.plan.describe()}")
  print("losses: " + " ".join(f"{x:.4f}" for x in losses))
  if step.report_path:
    print(hbm_guard.render_report(step.report_path))


if __name__ == "__main__":
  app.run(main)
