"""For a target: of the plans that fit, does the search choose the one estimated fastest?

    .venv/bin/python -m benchmarks.bench_target_quality [--model lm,lm512,...|all] [--target v5e:1x1]

Where a step only compiles for a target (`target=`, preflight) nothing runs, so "fastest" is
libtpu's own estimate of each compiled program (`step_time`: its per-op cycles, loops times
their trip counts). bench_plan_quality's models at a TPU's batch, and bench_scale's LM
at two layers, are compiled under every plan of the space (donation on; remat policy none /
dots / nothing; every microbatch count to 16), each compile's peak and estimated step
time read. Then at 70%, 50% and 35% of the donated step's peak the guard fits the step from
scratch for the target, as a user's preflight would, once as it is and once with
`estimated_rivals=3`. A row prints the plan the search chose, the plan estimated fastest of
those that fit, chosen ÷ fastest by the estimates, the fit's seconds against one compile
of the fastest plan, and the same for the plan kept after the rivals. A benchmark, not a test: the seconds are
this machine's.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time

import jax

import hbm_guard
from benchmarks import bench_plan_quality as quality
from benchmarks import bench_scale as scale
from hbm_guard.integrations import flax as hg_flax

BATCH_SCALE = 8  # bench_plan_quality's batches are sized for a CPU; a TPU's are larger
MAX_COUNT = 16
RIVALS = 3  # estimated_rivals of the second fit of each row


def models():
  """name -> (step, abstract state, abstract batch)."""
  out = {}
  for name, (module, step, batch) in quality.models().items():
    state = jax.eval_shape(lambda m=module, b=batch: quality._state(m, b))  # noqa: SLF001
    big = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        (x.shape[0] * BATCH_SCALE, *x.shape[1:]), x.dtype), batch)
    out[name] = (step, state, big)
  size = scale.Size(layers=2, emb=512, mlp=2048, seq=512, batch=16)
  state, batch, _ = scale.abstract_args(size)
  out["lm512"] = (hg_flax.train_step(scale.loss_fn), state, batch)
  return out


def _guard(step, target: str, **kw):
  return hbm_guard.guarded_jit(step, state_argnums=0, target=target, max_class="numerics",
                               plan_cache=False, progress=False,
                               report_dir=tempfile.mkdtemp(), **kw)


def _space(batch) -> list[hbm_guard.Plan]:
  size = jax.tree.leaves(batch)[0].shape[0]
  counts = [k for k in range(1, min(size, MAX_COUNT) + 1) if size % k == 0]
  return [hbm_guard.Plan(), *(hbm_guard.Plan(donate_argnums=(0,), remat_policy=p,
                                             microbatches=k)
                              for p in quality.POLICIES for k in counts)]


def _compiled(step, state, batch, target: str, plan: hbm_guard.Plan,
              capacity: int | None = None) -> dict | None:
  """`plan` compiled for the target (at `capacity`: libtpu's own verdict there, as the
  guard holds a target to it): peak, estimated step time, seconds; None where it does not
  fit."""
  g = _guard(step, target, plan=plan, auto_fallback=False,
             **({"capacity": capacity} if capacity else {}))
  t0 = time.perf_counter()
  try:
    g.fit(state, batch)
  except (hbm_guard.HbmGuardError, jax.errors.JaxRuntimeError):
    return None
  attempt = g.attempts[-1]
  if attempt.estimate is None or not attempt.memory:
    return None
  return {"peak": attempt.memory["peak"], "estimate_s": attempt.estimate.seconds,
          "compile_s": time.perf_counter() - t0}


def every_plan(step, state, batch, target: str) -> dict[hbm_guard.Plan, dict]:
  """Each plan of the space compiled for the whole chip: peak and estimated step time."""
  out = {}
  for plan in _space(batch):
    found = _compiled(step, state, batch, target, plan)
    if found:
      out[plan] = found
      print(f"  {plan.describe()}: peak {hbm_guard.format_bytes(found['peak'])}, "
            f"{1000 * found['estimate_s']:.2f} ms", file=sys.stderr, flush=True)
  return out


def fitting(step, state, batch, target: str, plans: dict[hbm_guard.Plan, dict],
            capacity: int) -> dict[hbm_guard.Plan, dict]:
  """The plans that fit `capacity`: those whose whole-chip peak is under it as they are,
  and those over it compiled again at it (libtpu may squeeze them, with another program)."""
  out = {}
  for plan, found in plans.items():
    if found["peak"] > capacity:
      found = _compiled(step, state, batch, target, plan, capacity)
    if found:
      out[plan] = found
  return out


def rows(name: str, target: str) -> list[dict]:
  step, state, batch = models()[name]
  plans = every_plan(step, state, batch, target)
  donated = plans[hbm_guard.Plan(donate_argnums=(0,))]["peak"]
  out = []
  for fraction in quality.CAPACITIES:
    capacity = int(fraction * donated)
    fits = fitting(step, state, batch, target, plans, capacity)
    row = {"model": name, "capacity": f"{fraction:.0%}", "fitting": len(fits)}
    if not fits:
      out.append({**row, "chosen": "-", "fastest": "-", "ratio": None})
      continue
    fastest = min(fits, key=lambda p: fits[p]["estimate_s"])
    best = fits[fastest]["estimate_s"]
    searched = _fit(step, state, batch, target, capacity, fits, best)
    compared = _fit(step, state, batch, target, capacity, fits, best, estimated_rivals=RIVALS)
    out.append({**row, "fastest": fastest.describe(), "compile_s": fits[fastest]["compile_s"],
                **searched, **{"rivals_" + k: v for k, v in compared.items()},
                "estimates_ms": {p.describe(): round(1000 * f["estimate_s"], 3)
                                 for p, f in fits.items()}})
  return out


def _fit(step, state, batch, target: str, capacity: int, fits: dict, best: float,
         **options) -> dict:
  """The guard from scratch at `capacity`: the plan it keeps, that plan's estimate ÷ the
  fastest's (the benchmark's own compile of it where it has one), compiles, seconds."""
  g = _guard(step, target, capacity=capacity, **options)
  t0 = time.perf_counter()
  try:
    chosen = g.fit(state, batch)
  except hbm_guard.HbmGuardError:
    return {"chosen": "none", "ratio": None, "compiles": len(g.attempts),
            "fit_s": time.perf_counter() - t0}
  fit_s = time.perf_counter() - t0
  found = fits.get(dataclasses.replace(chosen, rungs=()))
  kept = next((a.estimate for a in reversed(g.attempts)
               if a.plan == chosen and a.estimate is not None), None)
  seconds = found["estimate_s"] if found else kept and kept.seconds
  return {"chosen": chosen.describe(), "ratio": seconds / best if seconds else None,
          "compiles": len(g.attempts), "fit_s": fit_s,
          "compared": g.estimated.to_dict()["plans"] if g.estimated else []}


def markdown(results: list[dict]) -> str:
  lines = ["| model | capacity | plans that fit | searched (flops) | estimated fastest that fits "
           f"| searched ÷ fastest | fit s / one compile of the fastest s | kept with estimated_rivals={RIVALS} "
           "| kept ÷ fastest | fit s |", "|---|---|---|---|---|---|---|---|---|---|"]
  ratio = lambda r: f"{r:.3f}" if r else "?"  # noqa: E731
  for r in results:
    if r["chosen"] == "-":
      lines.append(f"| {r['model']} | {r['capacity']} | 0 | - | - | - | - | - | - | - |")
      continue
    lines.append(f"| {r['model']} | {r['capacity']} | {r['fitting']} | {r['chosen']} | "
                 f"{r['fastest']} | {ratio(r['ratio'])} | "
                 f"{r['fit_s']:.1f} / {r['compile_s']:.1f} | {r['rivals_chosen']} | "
                 f"{ratio(r['rivals_ratio'])} | {r['rivals_fit_s']:.1f} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--model", default="all",
                      help="all, or comma-separated of: " + ", ".join(models()))
  parser.add_argument("--target", default="v5e:1x1")
  parser.add_argument("--json", help="also write the rows here")
  args = parser.parse_args()
  names = list(models()) if args.model == "all" else args.model.split(",")
  unknown = set(names) - set(models())
  if unknown:
    parser.error(f"unknown model(s) {sorted(unknown)}")
  quality.print_rows(names, lambda name: rows(name, args.target), markdown, args.json)


if __name__ == "__main__":
  main()
