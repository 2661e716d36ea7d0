"""What the memory breakdown costs a fit, at a real size: the 368M LM of bench_scale,
unmodified (the drop-in), fitted for v5e:1x1 with `memory_breakdown` on and off, one after
the other in one process. Prints each fit's seconds and compiles, the seconds reading the
dumps took (the rest of the cost is libtpu writing them), the kept plan's breakdown, and the
first program's parts as predicted under the plan kept beside what the compiler allotted.

    PYTHONPATH=. .venv/bin/python -m benchmarks.bench_breakdown
    PYTHONPATH=. .venv/bin/python -m benchmarks.bench_breakdown --model vit

`--model` fits one of bench_models' steps instead (a ViT, a T5, a CNN, an LSTM, a scanned
LM: kinds the tests do not use), at the capacity bench_models gives it.
"""

import argparse
import json
import tempfile
import time

import hbm_guard
from benchmarks import bench_models
from benchmarks import bench_scale
from hbm_guard._src.files import report as report_lib
from hbm_guard._src.memory import breakdown_check


def _fit_model(name: str, target: str, on: bool) -> dict:
  """bench_models' step `name` fitted as bench_scale.fit fits the LM: the same row."""
  step_fn, state, batch, capacity = bench_models.models()[name]()
  g = hbm_guard.guarded_jit(step_fn, state_argnums=0, target=target, capacity=capacity,
                            max_class="numerics", plan_cache=False, progress=False,
                            memory_breakdown=on, report_dir=tempfile.mkdtemp())
  t0 = time.perf_counter()
  plan = g.fit(state, batch)
  made = [p for a in g.attempts if a.planning is not None for p in a.planning.probes]
  return {"compiles": len(g.attempts), "probes": sum(not p.compiled for p in made),
          "fit_seconds": time.perf_counter() - t0, "plan": plan.describe(),
          "breakdowns": [a.breakdown for a in g.attempts if a.breakdown is not None],
          "report": g.report_path}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--target", default="v5e:1x1")
  p.add_argument("--rounds", type=int, default=1)
  p.add_argument("--model", default="lm368", choices=["lm368", *bench_models.models()])
  a = p.parse_args()
  size = bench_scale.Size()
  rows = {True: [], False: []}
  for _ in range(a.rounds):
    for on in (False, True):
      t0 = time.perf_counter()
      if a.model == "lm368":
        row = bench_scale.fit(size, a.target, None, unmodified=True, memory_breakdown=on,
                              one_compile=False)
      else:
        row = _fit_model(a.model, a.target, on)
      row["wall"] = time.perf_counter() - t0
      rows[on].append(row)
  fmt = lambda r: (f"fit {r['fit_seconds']:.1f} s, {r['compiles']} compile(s), "  # noqa: E731
                   f"{r['probes']} probe(s), plan {r['plan']}")
  for on in (False, True):
    for r in rows[on]:
      print(f"breakdown {'on ' if on else 'off'}: {fmt(r)}")
  on = min(r["fit_seconds"] for r in rows[True])
  off = min(r["fit_seconds"] for r in rows[False])
  read = [sum(b.seconds for b in r["breakdowns"]) for r in rows[True]]
  print(f"fit with the breakdown / without: {on / off:.3f} ({on:.1f} s / {off:.1f} s, best "
        f"of {a.rounds}); reading the dumps: {min(read):.2f} s of the fit")
  kept = rows[True][-1]["breakdowns"]
  if kept:
    print("\n".join(report_lib.breakdown_lines(kept[0].to_dict())[:12]))
  if rows[True][-1].get("report"):  # the first program's parts, predicted and compiled
    with open(rows[True][-1]["report"], encoding="utf-8") as f:
      compared = json.load(f).get("predicted_vs_compiled") or []
    said = breakdown_check.summary(compared)
    print(f"predicted under the plan kept, and compiled ({said or 'none judged'}):")
    print("\n".join(breakdown_check.lines(compared)))


if __name__ == "__main__":
  main()
