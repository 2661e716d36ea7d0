"""Runs one training step under the guard and under jax.jit, from the same state, and says
whether the guard split the batch and how far apart the two trainings ended.

The rule the corpus and the fuzzer hold the drop-in to: where the guard says it split the
batch exactly, 3 steps train within `RTOL` of jax.jit; where it refused, it runs jax's own
gradient; far above capacity the guarded step is jax.jit's, bit for bit. A crash jax.jit
does not have is a failure either way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import hbm_guard
from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.backends import options as options_lib
from hbm_guard._src.backends import steps as steps_lib
from hbm_guard._src.dropin import batch_context
from hbm_guard._src.plans import plan as plan_lib

RTOL = 1e-5
STEPS = 3
# A distance above RTOL is cross-checked in float64, leaf by leaf. A leaf is apart from
# jax.jit only where (a) it is further than NOISE times what rounding alone moves it
# (jax.jit in float32 against jax.jit in float64: an optimizer that normalises a gradient
# that is zero but for rounding, as Adafactor or Adam do for an attention key's bias, moves
# it by a whole step either way), and (b) the guard's float64 run is still apart from
# jax.jit's float64 run, by more than RTOL64 and more than SHRINK64 of the float32
# distance (rounding shrinks there by about 1e-8; a semantic difference does not). A step
# that computes in bfloat16 or float16 is held to 4 of that type's epsilons, not RTOL.
RTOL64 = 1e-9
SHRINK64 = 1e-3
NOISE = 10.0
FLOOR = 1e-3  # values smaller than this (a PPO loss of normalised advantages) are compared
              # absolutely: rounding is relative to the terms summed, not to their total


@dataclasses.dataclass(frozen=True)
class Case:
  """A step `step(state, *args) -> (state, metrics)` and how to make its arguments."""
  name: str
  step: Callable
  make: Callable[[], tuple]  # () -> (state, *args)
  stochastic: bool = False  # draws random numbers: a split draws others (same distribution)
  expect_split: bool | None = None  # None: either is right, as long as it is honest
  options: tuple = ()  # extra guarded_jit keywords, as (name, value) pairs


@dataclasses.dataclass(frozen=True)
class Outcome:
  split: bool  # the guard said it split the batch exactly
  refused: str | None
  distance: float  # largest relative distance of any leaf after STEPS steps
  auto: str | None
  # where `distance` is above the step's tolerance: the largest float64 distance of a leaf
  # apart beyond rounding (0.0: every leaf apart was rounding, see NOISE)
  distance64: float | None = None
  tolerance: float = RTOL

  @property
  def different(self) -> bool:
    """Whether the guard's step trains differently from jax.jit (not only rounding)."""
    return self.distance > self.tolerance and (
        self.distance64 is None or self.distance64 > 0.0)


def semantic(d32: float, d64: float) -> bool:
  """Whether a difference seen in float32 is still there in float64."""
  return d64 > max(RTOL64, SHRINK64 * d32)


def in_float64(case: "Case") -> "Case":
  """`case` with its floating inputs in float64 (to run under `jax.enable_x64`)."""
  def make():
    return jax.tree.map(
        lambda x: x.astype(jnp.float64) if isinstance(x, (jax.Array, np.ndarray)) and
        jnp.issubdtype(x.dtype, jnp.floating) else x, case.make())
  return dataclasses.replace(case, make=make)


def distance(a, b) -> float:
  """The largest relative distance between matching leaves (0 for equal integer leaves)."""
  return max(leaf_distances(a, b), default=0.0)


def leaf_distances(a, b) -> list[float]:
  """Each matching leaf's relative distance (0 for equal integer leaves)."""
  out = []
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = _host(x), _host(y)
    if x.shape != y.shape:
      out.append(float("inf"))
      continue
    if not np.issubdtype(x.dtype, np.inexact):
      out.append(0.0 if np.array_equal(x, y) else float("inf"))
      continue
    x, y = x.astype(np.float64), y.astype(np.float64)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
      out.append(0.0 if np.array_equal(x, y, equal_nan=True) else float("inf"))
      continue
    scale = max(float(np.linalg.norm(y.ravel())), FLOOR)
    out.append(float(np.linalg.norm((x - y).ravel())) / scale)
  return out


def tolerance(case: "Case") -> float:
  """RTOL, or 4 epsilons of the narrowest float type the step computes in."""
  state, *args = case.make()
  try:
    closed = jax.make_jaxpr(case.step)(state, *args)
  except Exception:  # pylint: disable=broad-except
    return RTOL
  eps = [float(jnp.finfo(v.aval.dtype).eps) for v in _all_vars(closed.jaxpr)
         if jnp.issubdtype(getattr(v.aval, "dtype", np.int32), jnp.floating)]
  return max([RTOL] + [4 * e for e in eps if e > 1e-6])


def _all_vars(jaxpr):
  for e in jaxpr.eqns:
    yield from e.outvars
    for p in e.params.values():
      for x in (p if isinstance(p, (tuple, list)) else (p,)):
        inner = getattr(x, "jaxpr", x)
        if hasattr(inner, "eqns"):
          yield from _all_vars(inner)


def beyond_rounding(got32, want32, got64, want64, tol: float) -> float:
  """The largest float64 distance of a leaf apart beyond rounding (0.0 where none is)."""
  worst = 0.0
  for d32, noise, d64 in zip(leaf_distances(got32, want32), leaf_distances(want32, want64),
                             leaf_distances(got64, want64)):
    if d32 > tol and d32 > NOISE * noise and semantic(d32, d64):
      worst = max(worst, d64)
  return worst


def _host(x) -> np.ndarray:
  if jax.dtypes.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return np.asarray(x)


def _copy(tree):
  return jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, tree)


def _run(fun: Callable, state, args, steps: int):
  outs = []
  for _ in range(steps):
    state, metrics = fun(_copy(state), *args)
    outs.append(metrics)
  return state, outs


def under_plan(case: Case, plan: plan_lib.Plan, steps: int = STEPS,
               run_refused: bool = True, cross_check: bool = True) -> Outcome:
  """The step under a pinned plan (traced by the guard's own builder) against jax.jit.
  `run_refused=False`: a split the guard refused is only traced (it runs jax's own
  gradient), and its distance reported as 0. A split more than RTOL apart is run again in
  float64 (`cross_check`), to tell rounding from a semantic difference."""
  state, *args = case.make()
  builder = steps_lib.StepBuilder(case.step, options_lib.make(state_argnums=0,
                                                              **dict(case.options)))
  facts: dict = {}
  guarded = builder.jit(plan, None, 1 + len(args), None, facts)
  if not run_refused:
    guarded.trace(state, *args)
    fact = next(iter(facts.values()), None)
    if getattr(fact, "auto_refused", None) is not None or not getattr(fact, "auto", None):
      return Outcome(False, getattr(fact, "auto_refused", None), 0.0, getattr(fact, "auto", None))
  got = _run(guarded, state, args, steps)
  want = _run(jax.jit(case.step), state, args, steps)
  fact = next(iter(facts.values()), None)
  auto = getattr(fact, "auto", None)
  refused = getattr(fact, "auto_refused", None)
  split = bool(auto) and refused is None and "(exact)" in auto and plan.microbatches > 1
  apart = distance(got, want)
  apart64 = None
  tol = tolerance(case) if apart > RTOL else RTOL
  if cross_check and split and apart > tol and not case.stochastic:
    with jax.enable_x64(True):
      case64 = in_float64(case)
      state64, *args64 = case64.make()
      got64 = _run(steps_lib.StepBuilder(case.step, options_lib.make(
          state_argnums=0, **dict(case.options))).jit(plan, None, 1 + len(args64), None, {}),
                   state64, args64, steps)
      want64 = _run(jax.jit(case.step), state64, args64, steps)
      apart64 = beyond_rounding(got, want, got64, want64, tol)
  return Outcome(split, refused, apart, auto, apart64, tol)


def batch_size(case: Case) -> int:
  """The batch's size as the guard reads it: the size the analysis split at 2
  microbatches, else as voted from the step's batch arguments (time-major inputs
  [T, B, D] beside labels [B]: B)."""
  state, *args = case.make()
  builder = steps_lib.StepBuilder(case.step, options_lib.make(state_argnums=0,
                                                              **dict(case.options)))
  facts: dict = {}
  try:
    builder.jit(plan_lib.Plan(microbatches=2), None, 1 + len(args), None, facts).trace(
        state, *args)
  except Exception:  # pylint: disable=broad-except  (an odd batch: voted)
    pass
  fact = next(iter(facts.values()), None)
  if getattr(fact, "batch_size", None):
    return fact.batch_size
  return batch_context.Context.from_args(tuple(args), {}, (), ()).batch_size


def donated_peak(case: Case) -> int:
  state, *args = case.make()
  compiled = jax.jit(case.step, donate_argnums=0).lower(state, *args).compile()
  return compile_lib.memory_of(compiled)["peak"]


@dataclasses.dataclass(frozen=True)
class Fitted:
  plan: Any  # the plan fitted, or None where no plan fits
  distance: float
  auto: str | None
  # every refusal the climb met (a probe's, a compile's beside it), as the report has them
  refused: tuple[str, ...] = ()
  error: str | None = None  # the error where no plan fits (what the user reads)


def under_capacity(case: Case, capacity: int, report_dir: str,
                   steps: int = STEPS) -> Fitted:
  """The step as users meet it: guarded_jit with a capacity, climbing on its own."""
  state, *args = case.make()
  guarded = hbm_guard.guarded_jit(case.step, state_argnums=0, capacity=capacity,
                                  max_class="numerics", plan_cache=False,
                                  report_dir=report_dir, **dict(case.options))
  try:
    got = _run(guarded, state, args, steps)
  except hbm_guard.LadderExhaustedError as e:
    return Fitted(None, 0.0, None, _refused(guarded), str(e))
  want = _run(jax.jit(case.step), state, args, steps)
  auto = "; ".join(str(a.auto) for a in guarded.attempts if a.auto) or None
  return Fitted(guarded.plan, distance(got, want), auto, _refused(guarded))


def _refused(guarded) -> tuple[str, ...]:
  """The refusals of the guard's report (each met while tracing some plan)."""
  import json  # pylint: disable=import-outside-toplevel
  if not guarded.report_path:
    return ()
  with open(guarded.report_path, encoding="utf-8") as f:
    return tuple(r["why"] for r in json.load(f).get("refused") or ())
