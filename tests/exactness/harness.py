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
from hbm_guard._src import auto_grad
from hbm_guard._src import compile as compile_lib
from hbm_guard._src import options as options_lib
from hbm_guard._src import plan as plan_lib
from hbm_guard._src import steps as steps_lib

RTOL = 1e-5
STEPS = 3
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


def distance(a, b) -> float:
  """The largest relative distance between matching leaves (0 for equal integer leaves)."""
  worst = 0.0
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = _host(x), _host(y)
    if x.shape != y.shape:
      return float("inf")
    if not np.issubdtype(x.dtype, np.inexact):
      worst = max(worst, 0.0 if np.array_equal(x, y) else float("inf"))
      continue
    x, y = x.astype(np.float64), y.astype(np.float64)
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
      worst = max(worst, 0.0 if np.array_equal(x, y, equal_nan=True) else float("inf"))
      continue
    scale = max(float(np.linalg.norm(y.ravel())), FLOOR)
    worst = max(worst, float(np.linalg.norm((x - y).ravel())) / scale)
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
               run_refused: bool = True) -> Outcome:
  """The step under a pinned plan (traced by the guard's own builder) against jax.jit.
  `run_refused=False`: a split the guard refused is only traced (it runs jax's own
  gradient), and its distance reported as 0."""
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
  return Outcome(split, refused, distance(got, want), auto)


def batch_size(case: Case) -> int:
  """The batch's size as the guard votes it from the step's batch arguments (time-major
  inputs [T, B, D] beside labels [B]: B)."""
  _, *args = case.make()
  return auto_grad.Context.from_args(tuple(args), {}, (), ()).batch_size


def donated_peak(case: Case) -> int:
  state, *args = case.make()
  compiled = jax.jit(case.step, donate_argnums=0).lower(state, *args).compile()
  return compile_lib.memory_of(compiled)["peak"]


@dataclasses.dataclass(frozen=True)
class Fitted:
  plan: Any  # the plan fitted, or None where no plan fits
  distance: float
  auto: str | None


def under_capacity(case: Case, capacity: int, report_dir: str,
                   steps: int = STEPS) -> Fitted:
  """The step as users meet it: guarded_jit with a capacity, climbing on its own."""
  state, *args = case.make()
  guarded = hbm_guard.guarded_jit(case.step, state_argnums=0, capacity=capacity,
                                  max_class="numerics", plan_cache=False,
                                  report_dir=report_dir, **dict(case.options))
  try:
    got = _run(guarded, state, args, steps)
  except hbm_guard.LadderExhaustedError:
    return Fitted(None, 0.0, None)
  want = _run(jax.jit(case.step), state, args, steps)
  auto = "; ".join(str(a.auto) for a in guarded.attempts if a.auto) or None
  return Fitted(guarded.plan, distance(got, want), auto)
