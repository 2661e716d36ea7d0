"""How many compiles each strategy spends to make a train step fit, on the real compiler.

    .venv/bin/python -m benchmarks.bench_fit [--cases a,b,...] [--json OUT]

Each case is a Flax train step that does not fit its TPU target (libtpu compiles for it
here, no TPU needed). Each strategy is run until it finds something that fits:
- hbm_guard: guarded_jit's planner (probes, then the cheapest plan predicted to fit);
- ladder: guarded_jit with search="ladder" (one rung per compile);
- accelerate: Accelerate's find_executable_batch_size (batch x 0.9 after each failure);
- lightning-power / lightning-binsearch: Lightning's batch-size finder from batch 2;
- maxtext: a binary search of the largest batch per remat policy (estimator style);
- exhaustive: every plan (remat x microbatches x offload x sharding), to find the best.
Printed per strategy: compiles (failed), compile seconds, whether the global batch was
kept, the peak against capacity, and compute cost against the best fitting plan (flops of
one global batch by the compiler's count; microbatching adds 1% per extra microbatch and
offload its host transfers, as the planner counts them; a smaller batch is scaled up to
the same examples).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import tempfile
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import hbm_guard
from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.backends import targets
from hbm_guard._src.search import tuning
from hbm_guard.integrations import flax as hg_flax
from examples.recover_e1000 import train as lm

MiB = 1 << 20
POLICIES = (None, "dots_with_no_batch_dims_saveable", "nothing_saveable")


class MLP(nn.Module):
  width: int
  depth: int

  @nn.compact
  def __call__(self, x):
    for _ in range(self.depth):
      x = jnp.tanh(nn.Dense(self.width)(x))
    return x


def _mlp_loss(params, batch, apply_fn):
  return jnp.mean((apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  what: str
  target: str
  capacity_mib: int
  batch: int
  make: Callable[[int], tuple[Any, Any]]  # batch size -> (state, batch)
  remat: bool  # whether the model wraps its layers for the remat rung
  loss: Callable = lm.loss_fn


def _lm_case(width, depth, seq):
  cfg = lm.Config(width=width, depth=depth, seq=seq)

  def make(b):
    c = dataclasses.replace(cfg, batch=b)
    return lm.make_state(c), lm.make_batch(c, 0)
  return make


def _mlp_case(width, depth, feat):
  def make(b):
    model = MLP(width, depth)
    x = jnp.ones((b, feat))
    params = model.init(jax.random.key(0), x[:1])["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                          tx=optax.adam(1e-3))
    return state, {"x": x, "y": jnp.zeros((b, width))}
  return make


CASES = {
    "activations": Case("activations", "transformer, activation-heavy", "v5e:1x1", 40, 64,
                        _lm_case(128, 2, 128), True),
    "padding": Case("padding", "transformer of width 72 (TPU tiles pad it to 128)",
                    "v5e:1x1", 40, 64, _lm_case(72, 2, 120), True),
    "optimizer": Case("optimizer", "MLP, parameters and Adam state dominate", "v5e:1x1", 84,
                      32, _mlp_case(1024, 5, 1024), False, _mlp_loss),
    "sharding": Case("sharding", "the same MLP on 4 chips: sharding is the answer", "v5e:2x2",
                     40, 32, _mlp_case(1024, 5, 1024), False, _mlp_loss),
    "nothing": Case("nothing", "MLP at a capacity below its parameters", "v5e:1x1", 8, 32,
                    _mlp_case(1024, 5, 1024), False, _mlp_loss),
}


class Runner:
  """Compiles one plan at one batch size, counting compiles and seconds."""

  def __init__(self, case: Case, report_dir: str):
    self.case, self.dir = case, report_dir
    self.compiles = self.failed = 0
    self.seconds = 0.0
    self._made: dict[int, Any] = {}
    self._flops: dict[tuple, float] = {}

  def args(self, b):
    if b not in self._made:
      self._made[b] = self.case.make(b)
    return self._made[b]

  def guard(self, **kw):
    step = hg_flax.train_step(self.case.loss)
    return hbm_guard.guarded_jit(step, state_argnums=0, target=self.case.target,
                                 capacity=f"{self.case.capacity_mib}MiB", plan_cache=False,
                                 max_class="numerics", report_dir=self.dir, **kw)

  def try_plan(self, plan: hbm_guard.Plan, b: int) -> dict | None:
    """Compiles `plan` at batch b: its memory if it fits, else None."""
    g = self.guard(plan=plan, auto_fallback=False)
    t0 = time.perf_counter()
    try:
      g.fit(*self.args(b))
      ok = True
    except (jax.errors.JaxRuntimeError, hbm_guard.HbmGuardError):
      ok = False
    self.seconds += time.perf_counter() - t0
    self.compiles += 1
    self.failed += not ok
    return (g.attempts[-1].memory or {}) if ok else None

  def cost(self, plan: hbm_guard.Plan, b: int) -> float:
    """Flops of one global batch under `plan`, as the planner prices it."""
    key = (plan.remat_policy, b)
    if key not in self._flops:
      g = self.guard()
      flat = dataclasses.replace(plan, microbatches=1, offload_optimizer=False,
                                 shard_state=False, donate_argnums=())
      self._flops[key] = g._step.flops(flat, self.args(b), {}) or math.nan  # pylint: disable=protected-access
    state = self.args(b)[0]
    opt = sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
    cost = self._flops[key] * (1 + tuning.MICROBATCH_OVERHEAD * (plan.microbatches - 1))
    if plan.offload_optimizer:
      cost += 2 * opt * tuning.FLOPS_PER_HOST_BYTE
    return cost * self.case.batch / b


def _pow2(n):
  return [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= n and n % k == 0]


def donated(**kw):
  return hbm_guard.Plan(donate_argnums=(0,), **kw)


def run_guard(case, r: Runner, search: str):
  g = r.guard(search=search)
  t0 = time.perf_counter()
  try:
    g.fit(*r.args(case.batch))
    plan, mem = g.plan, g.attempts[-1].memory or {}
  except hbm_guard.HbmGuardError:
    plan, mem = None, None
  r.seconds = time.perf_counter() - t0  # probes included
  r.compiles = len(g.attempts)
  r.failed = sum(a.outcome is not compile_lib.Outcome.FITS for a in g.attempts)
  probes = sum(len(a.planning.probes) for a in g.attempts if a.planning is not None)
  return plan, case.batch, mem, {"probes": probes}


def run_accelerate(case, r: Runner):
  b = case.batch
  while b >= 1:
    mem = r.try_plan(donated(), b)
    if mem is not None:
      return donated(), b, mem, {}
    b = int(b * 0.9)
  return None, 0, None, {}


def run_lightning(case, r: Runner, mode: str):
  b, good, bad, mem_good = 2, None, None, None
  while b <= case.batch:  # power: double until it fails (never above the global batch)
    mem = r.try_plan(donated(), b)
    if mem is None:
      bad = b
      break
    good, mem_good = b, mem
    b *= 2
  if mode == "binsearch" and good is not None and bad is not None:
    lo, hi = good, bad
    while hi - lo > 1:
      mid = (lo + hi) // 2
      mem = r.try_plan(donated(), mid)
      if mem is None:
        hi = mid
      else:
        lo, mem_good = mid, mem
    good = lo
  return (donated(), good, mem_good, {}) if good else (None, 0, None, {})


def run_maxtext(case, r: Runner):
  best = (None, 0, None)
  for policy in (POLICIES if case.remat else (None,)):
    lo, hi, mem_lo = 0, case.batch, None
    while lo < hi:  # the largest batch that fits with this policy
      mid = (lo + hi + 1) // 2
      mem = r.try_plan(donated(remat_policy=policy), mid)
      if mem is None:
        hi = mid - 1
      else:
        lo, mem_lo = mid, mem
    if lo > best[1]:
      best = (donated(remat_policy=policy), lo, mem_lo)
  return best + ({},)


def exhaustive(case, r: Runner):
  plans = []
  for policy in (POLICIES if case.remat else (None,)):
    for k in _pow2(case.batch):
      for offload in ((False, True) if not case.remat else (False,)):
        for shard in ((False, True) if case.target != "v5e:1x1" else (False,)):
          plans.append(donated(remat_policy=policy, microbatches=k, offload_optimizer=offload,
                               shard_state=shard))
  fitting = []
  for plan in plans:
    mem = r.try_plan(plan, case.batch)
    if mem is not None:
      fitting.append((r.cost(plan, case.batch), plan, mem))
  return min(fitting, key=lambda t: t[0]) if fitting else None


def run_case(case: Case) -> list[dict]:
  targets.Target.parse(case.target).devices()
  rows = []
  with tempfile.TemporaryDirectory() as d:
    best_r = Runner(case, d)
    best = exhaustive(case, best_r)
    best_cost = best[0] if best else None
    strategies = {
        "hbm_guard": lambda r: run_guard(case, r, "probes"),
        "ladder": lambda r: run_guard(case, r, "ladder"),
        "accelerate": lambda r: run_accelerate(case, r),
        "lightning-power": lambda r: run_lightning(case, r, "power"),
        "lightning-binsearch": lambda r: run_lightning(case, r, "binsearch"),
        "maxtext": lambda r: run_maxtext(case, r),
    }
    for name, fn in strategies.items():
      r = Runner(case, d)
      plan, b, mem, extra = fn(r)
      cost = r.cost(plan, b) if plan is not None else None
      row = {"case": case.name, "strategy": name, "compiles": r.compiles, "failed": r.failed,
             "seconds": round(r.seconds, 1), "fits": plan is not None,
             "batch": b, "batch_kept": plan is not None and b == case.batch,
             "plan": plan.describe() if plan else None,
             "peak_mib": round(mem["peak"] / MiB, 1) if mem and "peak" in mem else None,
             "capacity_mib": case.capacity_mib,
             "cost_vs_best": round(cost / best_cost, 3) if cost and best_cost else None,
             **extra}
      rows.append(row)
      print(json.dumps(row), flush=True)
    rows.append({"case": case.name, "strategy": "exhaustive", "compiles": best_r.compiles,
                 "failed": best_r.failed, "seconds": round(best_r.seconds, 1),
                 "fits": best is not None, "batch": case.batch, "batch_kept": best is not None,
                 "plan": best[1].describe() if best else None,
                 "peak_mib": round(best[2]["peak"] / MiB, 1) if best else None,
                 "capacity_mib": case.capacity_mib, "cost_vs_best": 1.0 if best else None})
    print(json.dumps(rows[-1]), flush=True)
  return rows


def markdown(rows: list[dict]) -> str:
  """Every strategy side by side per case, as BENCHMARKS.md shows it (`regenerate`)."""
  out = ["The compiler is libtpu compiling for the TPU target on this CPU machine; seconds "
         "are compile seconds here (probes included for hbm_guard).", "",
         "`cost` is the compute of one global batch against the best fitting plan that an "
         "exhaustive search found (1.00 = the best); `peak` is memory_analysis's sum, which "
         "libtpu's own check (the verdict that decides) can put a few percent higher or "
         "lower than what it enforces. The batch-size strategies compile the donated "
         "step (donation given to them for free, as a careful user would write it); "
         "hbm_guard and the ladder start from the plain step.", ""]
  for case in dict.fromkeys(r["case"] for r in rows):
    c = CASES[case]
    out += [f"### {case}: {c.what}", "",
            f"{c.target}, capacity {c.capacity_mib} MiB per chip, global batch {c.batch}.", "",
            "| strategy | compiles (failed) | seconds | fits | batch kept | plan | peak MiB | cost |",
            "|---|---|---|---|---|---|---|---|"]
    for r in rows:
      if r["case"] != case:
        continue
      probes = f", {r['probes']} probes" if r.get("probes") else ""
      plan = r["plan"] or "-"
      if not r["batch_kept"] and r["fits"]:
        plan += f" at batch {r['batch']}"
      out.append(f"| {r['strategy']} | {r['compiles']} ({r['failed']}){probes} | "
                 f"{r['seconds']} | {'yes' if r['fits'] else 'no'} | "
                 f"{'yes' if r['batch_kept'] else 'no'} | {plan} | {r['peak_mib'] or '-'} | "
                 f"{r['cost_vs_best'] if r['cost_vs_best'] is not None else '-'} |")
    out.append("")
  guard = [r for r in rows if r["strategy"] == "hbm_guard"]
  extra = [r["compiles"] - 1 for r in guard]
  costs = [r["cost_vs_best"] for r in guard if r["cost_vs_best"] is not None]
  out += ["### Summary (hbm_guard)", "",
          f"- compiles after the first failure: mean {sum(extra) / max(1, len(extra)):.2f}, "
          f"most {max(extra, default=0)}",
          f"- chosen plan's cost against the best fitting plan: most "
          f"{max(costs, default=float('nan')):.3f}",
          f"- global batch kept wherever something fits: "
          f"{all(r['batch_kept'] for r in guard if r['fits'])}", ""]
  return "\n".join(out)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--cases", default=",".join(CASES))
  parser.add_argument("--json", default=None)
  parser.add_argument("--markdown", default=None,
                      help="also write the tables to this file (they are printed anyway)")
  parser.add_argument("--from-json", default=None, help="format rows saved by --json")
  args = parser.parse_args()
  if args.from_json:
    with open(args.from_json, encoding="utf-8") as f:
      rows = json.load(f)
    print(markdown(rows))
    return
  targets.quiet_libtpu_on_cpu_host()
  from absl import logging  # pylint: disable=g-import-not-at-top
  logging.set_verbosity(logging.FATAL)  # the strategies' failed compiles are expected
  rows = []
  for name in args.cases.split(","):
    rows += run_case(CASES[name])
  if args.json:
    with open(args.json, "w", encoding="utf-8") as f:
      json.dump(rows, f, indent=1)
  print(markdown(rows))
  if args.markdown:
    with open(args.markdown, "w", encoding="utf-8") as f:
      f.write(markdown(rows))


if __name__ == "__main__":
  main()
