"""The README main job's fit against one compile of the plan it finds (issue #17: <= 1.5x).

    .venv/bin/python -m benchmarks.bench_main_job [--runs 3]

Each run fits the job's step (v5e:1x1 at 96 MiB, with `.fit`) as the README runs it: with
the plan cache on, in an empty directory of its own, so the fit pays for the cache's key
(`--no-plan-cache`: without it). It then compiles the plan it found once more in the same
process, and prints compiles, probes, seconds and the ratio. A benchmark, not a test: the
seconds are this machine's.
"""

import argparse
import tempfile
import time

import hbm_guard
from hbm_guard.integrations import flax as hg_flax
from examples.recover_e1000 import train


def _guarded(**options):
  options.setdefault("plan_cache", False)
  return hg_flax.guarded_train_step(train.loss_fn, target="v5e:1x1", capacity="96MiB",
                                    max_class="numerics", progress=False,
                                    report_dir=tempfile.mkdtemp(), **options)


def run_once(plan_cache: bool = True) -> dict:
  cfg = train.Config()
  args = train.make_state(cfg), train.make_batch(cfg, 0)  # small: the arrays themselves
  step = _guarded(plan_cache=tempfile.mkdtemp() if plan_cache else False)
  t0 = time.perf_counter()
  plan = step.fit(*args)
  fit_s = time.perf_counter() - t0
  probes = [p for a in step.attempts if a.planning for p in a.planning.probes]
  again = _guarded(plan=plan, auto_fallback=False)
  t1 = time.perf_counter()
  again.fit(*args)
  one_s = time.perf_counter() - t1
  return {"plan": plan.describe(), "compiles": len(step.attempts),
          "beside": sum(p.compiled for p in probes), "probes": sum(not p.compiled for p in probes),
          "fit_s": fit_s, "one_compile_s": one_s, "ratio": fit_s / one_s}


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--runs", type=int, default=3)
  parser.add_argument("--no-plan-cache", action="store_true",
                      help="fit without the plan cache (its key not paid for)")
  args = parser.parse_args()
  hbm_guard.quiet_libtpu_on_cpu_host()
  print("| run | compiles | of them beside the probes | probes | fit s | one compile s | "
        "fit / compile | plan |")
  print("|---|---|---|---|---|---|---|---|")
  for i in range(args.runs):
    r = run_once(plan_cache=not args.no_plan_cache)
    print(f"| {i + 1} | {r['compiles']} | {r['beside']} | {r['probes']} | {r['fit_s']:.1f} | "
          f"{r['one_compile_s']:.1f} | {r['ratio']:.2f} | {r['plan']} |", flush=True)


if __name__ == "__main__":
  main()
