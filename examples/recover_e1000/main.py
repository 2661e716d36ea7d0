"""Trips a real E1000 compiling a Flax train step for TPU v5e, and recovers.

    python -m examples.recover_e1000.main                     # the defaults below
    python -m examples.recover_e1000.main --hbm_guard_max_class=exact   # see it give up
"""

from absl import app
from absl import flags

from hbm_guard import flags as hbm_flags
from hbm_guard._src import report as report_lib
from hbm_guard._src import targets
from examples.recover_e1000 import train

_STEPS = flags.DEFINE_integer("steps", 5, "Training steps to run after the plan fits.")
_BATCH = flags.DEFINE_integer("batch", 64, "Global batch (sequences).")

# This job's defaults: fall back automatically, for one v5e chip given a 96 MiB budget (a
# tiny model needs a tiny budget to overflow), allowing microbatching (class numerics).
flags.FLAGS.set_default("hbm_guard_auto_fallback", True)
flags.FLAGS.set_default("hbm_guard_target", "v5e:1x1")
flags.FLAGS.set_default("hbm_guard_capacity", "96MiB")
flags.FLAGS.set_default("hbm_guard_max_class", "numerics")


def main(argv):
  del argv
  targets.quiet_libtpu_on_cpu_host()  # libtpu only compiles here: keep its start-up quiet
  cfg = train.Config(steps=_STEPS.value, batch=_BATCH.value)
  losses, step = train.train(cfg, **hbm_flags.guard_options())
  for a in step.attempts:
    need = (a.record.required_bytes if a.record else a.memory and a.memory["peak"])
    print(f"compile #{a.number}: {a.plan.describe():<55} {a.outcome:<4} "
          f"{'needs' if a.record else 'peak'} {need / 2**20:8.1f} MiB "
          f"({a.record.kind if a.record else 'memory_analysis'})")
  print(f"plan in force: {step.plan.describe()}")
  print("losses: " + " ".join(f"{x:.4f}" for x in losses))
  if step.report_path:
    print(f"report: {step.report_path}")
    import json
    with open(step.report_path, encoding="utf-8") as f:
      print(report_lib.render(json.load(f)))


if __name__ == "__main__":
  app.run(main)
