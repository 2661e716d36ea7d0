"""Fit cost at a real size: a ~370M-parameter Flax LM on one v5e chip, abstract arguments.

    .venv/bin/python -m benchmarks.bench_scale                  # 24 layers: ~30 min here
    .venv/bin/python -m benchmarks.bench_scale --layers 4 --emb 512 --mlp 2048 --seq 512
    .venv/bin/python -m benchmarks.bench_scale --unmodified --skip-halving  # no helpers
    .venv/bin/python -m benchmarks.bench_scale --unmodified --no-drop-in --skip-halving  # flags only

Prints, for the plan-aware step under `target="v5e:1x1"` at the chip's real capacity:
compiles, probes, seconds of the fit, one compile of the plan it found (the same process,
after the fit: a warm compile), the ratio fit / that compile, and batch halving on the
plain step side by side (compiles, seconds, the batch it ends on). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec as P

import hbm_guard
from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.backends import targets as targets_lib
from hbm_guard._src.files import report as report_lib
from hbm_guard._src.search import planner as planner_lib
from hbm_guard.integrations import flax as hg_flax


@dataclasses.dataclass(frozen=True)
class Size:
  layers: int = 24
  emb: int = 1024
  mlp: int = 4096
  heads: int = 16
  seq: int = 1024
  vocab: int = 32000
  batch: int = 16


class Block(nn.Module):
  size: Size
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x):
    s = self.size
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.MultiHeadDotProductAttention(num_heads=s.heads, dtype=self.dtype)(
        h, h, mask=nn.make_causal_mask(jnp.ones(x.shape[:2])))
    x = x + h
    h = nn.LayerNorm(dtype=self.dtype)(x)
    h = nn.Dense(s.emb, dtype=self.dtype)(nn.gelu(nn.Dense(s.mlp, dtype=self.dtype)(h)))
    return x + h


class LM(nn.Module):
  size: Size

  @nn.compact
  def __call__(self, tokens):
    s = self.size
    dtype = hbm_guard.compute_dtype(jnp.float32)
    x = nn.Embed(s.vocab, s.emb)(tokens).astype(dtype)
    for _ in range(s.layers):
      x = hg_flax.remat(Block)(s, dtype=dtype)(x)  # per-layer remat by plan
    return nn.Dense(s.vocab, dtype=dtype)(nn.LayerNorm(dtype=dtype)(x)).astype(jnp.float32)


class PlainLM(nn.Module):
  """The same LM written without hbm_guard: what `--unmodified` fits."""
  size: Size

  @nn.compact
  def __call__(self, tokens):
    s = self.size
    x = nn.Embed(s.vocab, s.emb)(tokens)
    for _ in range(s.layers):
      x = Block(s)(x)
    return nn.Dense(s.vocab)(nn.LayerNorm()(x))


def plain_train_step(state, batch):
  """A train step written the ordinary way: jax.value_and_grad of a loss closing over
  the batch, as Flax's lm1b example does."""
  def loss(params):
    logits = state.apply_fn({"params": params}, batch["inputs"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
  value, grads = jax.value_and_grad(loss)(state.params)
  return state.apply_gradients(grads=grads), value


def loss_fn(params, batch, apply_fn):
  logits = apply_fn({"params": params}, batch["inputs"])
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  return jnp.mean(nll)


def abstract_args(s: Size, model_class=LM):
  model = model_class(s)
  tokens = jax.ShapeDtypeStruct((s.batch, s.seq), jnp.int32)

  def create():
    params = model.init(jax.random.key(0), jnp.zeros((1, s.seq), jnp.int32))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                         tx=optax.adamw(1e-4))
  state = jax.eval_shape(create)
  n = sum(x.size for x in jax.tree.leaves(state.params))
  return state, {"inputs": tokens, "targets": tokens}, n


def own_shardings(target: str, state, batch):
  """Hand-written FSDP, as a multi-chip job passes it: a ("data", "fsdp") mesh over the
  target's chips, each state leaf's largest dimension over "fsdp", the batch over "data"."""
  devices = np.array(targets_lib.Target.parse(target).devices())
  mesh = jax.sharding.Mesh(devices.reshape(-1, 2), ("data", "fsdp"))

  def spec(x):
    dims = sorted(range(x.ndim), key=lambda d: -x.shape[d])
    d = next((d for d in dims if x.shape[d] % 2 == 0), None)
    return NamedSharding(mesh, P(*[("fsdp" if i == d else None) for i in range(x.ndim)]))
  state_s = jax.tree.map(spec, state)
  batch_s = jax.tree.map(lambda _: NamedSharding(mesh, P("data")), batch)
  return {"in_shardings": (state_s, batch_s), "out_shardings": (state_s, None)}


def _compared(g) -> list[dict]:
  """The plans `estimated_rivals` compiled, from the fit's report (none without it)."""
  if not g.report_path:
    return []
  with open(g.report_path, encoding="utf-8") as f:
    return (json.load(f).get("estimated") or {}).get("plans") or []


def fit(s: Size, target: str, max_fit_seconds: float | None, unmodified: bool = False,
        own: bool = False, drop_in: bool = True, estimated_rivals: int = 0,
        memory_breakdown: bool = True, one_compile: bool = True):
  state, batch, n = abstract_args(s, PlainLM if unmodified else LM)
  step = plain_train_step if unmodified else hg_flax.train_step(loss_fn)
  shardings = own_shardings(target, state, batch) if own else {}
  return {"params": n, **measure(step, state, batch, target, max_fit_seconds=max_fit_seconds,
                                 auto_plan_aware=drop_in, estimated_rivals=estimated_rivals,
                                 memory_breakdown=memory_breakdown, one_compile=one_compile,
                                 **shardings)}


def measure(step, state, batch, target: str, *, one_compile: bool = True, **options):
  """Fits `step` for `target` as a user would (abstract arguments, `.fit`), then compiles the
  plan it found once more in this process: what the fit cost against that one compile."""
  shardings = {k: options[k] for k in ("in_shardings", "out_shardings") if k in options}
  g = hbm_guard.guarded_jit(step, state_argnums=0, target=target, max_class="numerics",
                            plan_cache=False, report_dir=tempfile.mkdtemp(), **options)
  t0 = time.perf_counter()
  plan, error = None, None
  try:
    plan = g.fit(state, batch)
  except hbm_guard.HbmGuardError as e:
    error = str(e).split(" (https://")[0]
  seconds = time.perf_counter() - t0
  made = [p for a in g.attempts if a.planning is not None for p in a.planning.probes]
  probes = [p for p in made if not p.compiled]
  beside = [p for p in made if p.compiled]  # compiles at the capacity beside the probes
  row = {"compiles": len(g.attempts), "probes": len(probes),
         "probe_seconds": sum(p.seconds for p in probes),
         "beside_failed": sum(1 for p in beside
                              if plan is None or p.plan != planner_lib.program(plan)),
         "fit_seconds": seconds,
         "plan": plan.describe() if plan else None, "error": error,
         "estimate": next((a.estimate for a in reversed(g.attempts) if a.estimate), None),
         "compared": _compared(g),
         "breakdowns": [a.breakdown for a in g.attempts if a.breakdown is not None],
         "attempts": [(a.plan.describe(), a.outcome.value, a.seconds,
                       (a.memory or {}).get("peak") or (a.record.required_bytes
                                                        if a.record else None))
                      for a in g.attempts],
         "report": g.report_path}
  if plan is not None and one_compile:  # one compile of the plan found, in this process
    again = hbm_guard.guarded_jit(step, state_argnums=0, target=target, max_class="numerics",
                                  plan_cache=False, plan=plan, auto_fallback=False,
                                  report_dir=tempfile.mkdtemp(), **shardings)
    t1 = time.perf_counter()
    again.fit(state, batch)
    row["one_compile_seconds"] = time.perf_counter() - t1
    row["ratio"] = seconds / row["one_compile_seconds"]
    row["peak"] = (again.attempts[-1].memory or {}).get("peak")
  return row


def halving(s: Size, target: str):
  """What people do today: halve the batch of the plain step until it compiles."""
  b, compiles, t0 = s.batch, 0, time.perf_counter()
  while b >= 1:
    state, batch, _ = abstract_args(dataclasses.replace(s, batch=b))
    g = hbm_guard.guarded_jit(hg_flax.train_step(loss_fn), target=target, plan_cache=False,
                              auto_fallback=False, progress=False,
                              report_dir=tempfile.mkdtemp())
    compiles += 1
    try:
      g.fit(state, batch)
      if g.attempts[-1].outcome is compile_lib.Outcome.FITS:
        break
    except (jax.errors.JaxRuntimeError, hbm_guard.HbmGuardError):
      pass
    b //= 2
  return {"compiles": compiles, "seconds": time.perf_counter() - t0, "batch": b}


def main():
  p = argparse.ArgumentParser()
  for f in dataclasses.fields(Size):
    p.add_argument(f"--{f.name}", type=int, default=f.default)
  p.add_argument("--target", default="v5e:1x1")
  p.add_argument("--max-fit-seconds", type=float, default=None)
  p.add_argument("--skip-halving", action="store_true")
  p.add_argument("--unmodified", action="store_true",
                 help="fit a step written without hbm_guard (the drop-in analysis)")
  p.add_argument("--no-drop-in", action="store_true",
                 help="with --unmodified: auto_plan_aware=False, so only donation and XLA "
                      "flags can apply (how long the guard takes to say no)")
  p.add_argument("--own-shardings", action="store_true",
                 help="pass hand-written FSDP in/out_shardings over the target's chips")
  p.add_argument("--estimated-rivals", type=int, default=0,
                 help="compile this many plans near the search's choice and keep the one "
                      "the compiled programs estimate fastest")
  a = p.parse_args()
  s = Size(**{f.name: getattr(a, f.name) for f in dataclasses.fields(Size)})
  print(f"jax {jax.__version__}, {s}, target {a.target}", flush=True)
  r = fit(s, a.target, a.max_fit_seconds, a.unmodified, a.own_shardings, not a.no_drop_in,
          a.estimated_rivals)
  print(f"hbm_guard: {r['params'] / 1e6:.0f}M params; {r['compiles']} compiles "
        f"(+{r['beside_failed']} that failed beside them, in place of probes), "
        f"{r['probes']} probes "
        f"({r['probe_seconds']:.0f} s); fit {r['fit_seconds']:.0f} s; "
        f"plan {r['plan']}; {r.get('error') or ''}", flush=True)
  if "ratio" in r:
    print(f"one compile of that plan: {r['one_compile_seconds']:.0f} s; fit / compile = "
          f"{r['ratio']:.2f}; peak {hbm_guard.format_bytes(r['peak'])} per chip", flush=True)
  if r.get("estimate") is not None:
    e = r["estimate"]
    whose = " (the search's plan)" if r["compared"] else ""
    print(f"estimated step time on the target{whose}: {1000 * e.seconds:.1f} ms "
          f"({e.by_cycles} ops by libtpu's cycles, {e.by_roofline} by the roofline; read in "
          f"{e.read_seconds:.1f} s of the fit)", flush=True)
  for c in r["compared"]:
    kept = " (kept)" if c["plan"] == r["plan"] else ""
    print(f"  compared: {c['plan']}{kept}: {report_lib.compared(c)}", flush=True)
  if not a.skip_halving:
    h = halving(s, a.target)
    print(f"batch halving: {h['compiles']} compiles, {h['seconds']:.0f} s, ends at batch "
          f"{h['batch']} of {s.batch}", flush=True)


if __name__ == "__main__":
  main()
