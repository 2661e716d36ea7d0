"""Trips a real E1000 compiling a Flax train step for TPU v5e, and recovers.

    python -m examples.recover_e1000.main
    python -m examples.recover_e1000.main --config.batch=128 --hbm_guard_max_class=exact
"""

from absl import app
from ml_collections import config_flags

import hbm_guard
from hbm_guard import flags as hbm_flags
from examples.recover_e1000 import train

_CONFIG = config_flags.DEFINE_config_file(
    "config", "examples/recover_e1000/configs/default.py", "The job's settings.")


def main(argv):
  del argv
  hbm_guard.quiet_libtpu_on_cpu_host()  # libtpu only compiles here: keep its start-up quiet
  config = _CONFIG.value
  losses, step = train.train_and_evaluate(config, **hbm_flags.guard_options(dict(config.guard)))
  for a in step.attempts:
    need = (a.record.required_bytes if a.record else a.memory and a.memory["peak"])
    print(f"compile #{a.number}: {a.plan.describe():<55} {a.outcome:<4} "
          f"{'needs' if a.record else 'peak'} {need / 2**20:8.1f} MiB "
          f"({a.record.kind if a.record else 'memory_analysis'})")
  print(f"plan in force: {step.plan.describe()}")
  print("losses: " + " ".join(f"{x:.4f}" for x in losses))
  if step.report_path:
    print(f"report: {step.report_path}")
    print(hbm_guard.render_report(step.report_path))


if __name__ == "__main__":
  app.run(main)
