"""Random loss programs over a batch, for the differential fuzzer.

A program is a list of op names applied in turn to the per-example activations
`h = tanh(x @ w)` ([B, F]), then a final reduction to the loss. The ops mix what the
analysis has rules for (elementwise maps, work along the feature axis) with what mixes or
reorders examples (sorts, cumulative sums and rolls over the batch, writes at batch
positions, scatters, constants and callbacks of the batch's length, custom derivative
rules, loops, batch statistics). Each program is run under a pinned microbatch plan and
under jax.jit: a split that trains differently is the one result never allowed.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tests.exactness import harness

B, D, F = 8, 5, 6


@jax.custom_vjp
def _clip_gradient(x):
  return x


_clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.01, 0.01),))


@jax.custom_vjp
def _normalised_gradient(x):
  return x


_normalised_gradient.defvjp(lambda x: (x, None), lambda _, g: (g / (jnp.linalg.norm(g) + 1e-3),))


@jax.custom_jvp
def _softplus(x):
  return jnp.logaddexp(x, 0.0)


_softplus.defjvp(lambda p, t: (_softplus(p[0]), jax.nn.sigmoid(p[0]) * t[0]))


@jax.custom_jvp
def _centred(x):
  return jnp.sin(x)


_centred.defjvp(lambda p, t: (_centred(p[0]), t[0] - t[0].mean(0)))


def _while_normaliser(h, x):
  def body(c):
    i, s = c
    return i + 1, 0.5 * (s + jnp.sum(x ** 2, -1) / s)
  _, s = jax.lax.while_loop(lambda c: c[0] < 3, body, (0, jnp.ones(x.shape[0])))
  return h / s[:, None]


def _callback_scale(h, x):
  w = jax.pure_callback(lambda a: (np.abs(a) + 1).astype(np.float32),
                        jax.ShapeDtypeStruct((x.shape[0],), jnp.float32), x[:, 0])
  return h * w[:, None]


# op name -> (h, x) -> h. Those marked in MIXING may make examples interact.
OPS: dict[str, Callable] = {
    "tanh": lambda h, x: jnp.tanh(h),
    "square": lambda h, x: h * h,
    "sin": lambda h, x: jnp.sin(h),
    "relu": lambda h, x: jax.nn.relu(h),
    "softplus_custom_jvp": lambda h, x: _softplus(h),
    "clip_gradient_custom_vjp": lambda h, x: _clip_gradient(h),
    "softmax_features": lambda h, x: jax.nn.softmax(h, axis=-1),
    "cumsum_features": lambda h, x: jnp.cumsum(h, axis=-1) / F,
    "sort_features": lambda h, x: jnp.sort(h, axis=-1),
    "top_k_features": lambda h, x: jnp.concatenate([jax.lax.top_k(h, 2)[0], h[:, 2:]], -1),
    "scale_by_input": lambda h, x: h * x[:, :1],
    "stack_features": lambda h, x: jnp.stack([h, h * h], axis=1).mean(1),
    "mask_normalised": lambda h, x: h * ((x[:, :1] > 0) / jnp.maximum((x[:, 0] > 0).sum(), 1)),
    "input_statistic": lambda h, x: h * (x[:, :1] - x[:, :1].mean()) / (x[:, :1].std() + 1e-3),
    "input_logsumexp": lambda h, x: h * jax.nn.logsumexp(x[:, 0]),
    # may mix or reorder examples
    "cumsum_batch": lambda h, x: jnp.cumsum(h, axis=0) / B,
    "sort_batch": lambda h, x: jnp.sort(h, axis=0),
    "roll_batch": lambda h, x: jnp.roll(h, 1, axis=0),
    "reverse_batch": lambda h, x: h[::-1],
    "centre_batch": lambda h, x: h - h.mean(0),
    "max_batch": lambda h, x: h / (jnp.max(jnp.abs(h)) + 1),
    "write_first_rows": lambda h, x: h.at[:2].set(0.0),
    "dynamic_update_slice": lambda h, x: jax.lax.dynamic_update_slice(h, jnp.zeros((1, F)), (1, 0)),
    "scatter_add_rows": lambda h, x: h.at[jnp.array([0, 3])].add(h[1]),
    "position_weights": lambda h, x: h * jnp.arange(x.shape[0])[:, None] / B,
    "constant_weights": lambda h, x: h * jnp.asarray(np.tile([1.0, 0.5], B // 2))[:, None],
    "uniform_constant": lambda h, x: h * jnp.asarray(np.full((B, 1), 0.5, np.float32)),
    "callback_weights": _callback_scale,
    "centred_custom_jvp": lambda h, x: _centred(h),
    "normalised_gradient_custom_vjp": lambda h, x: _normalised_gradient(h),
    "while_loop_normaliser": _while_normaliser,
    "top_k_batch": lambda h, x: jax.lax.top_k(h.T, B)[0].T,
}
MIXING = frozenset(list(OPS)[list(OPS).index("cumsum_batch"):])

REDUCTIONS: dict[str, Callable] = {
    "mean": lambda h, x: jnp.mean(h ** 2),
    "sum": lambda h, x: jnp.sum(h ** 2) / 10,
    "log_mean": lambda h, x: jnp.log(jnp.mean(h ** 2) + 1.0),
    "weighted_mean": lambda h, x: jnp.sum(jnp.sum(h ** 2, -1) * (x[:, 1] > 0)) / jnp.maximum(
        jnp.sum(x[:, 1] > 0), 1),
    "mean_plus_decay": lambda h, x: jnp.mean(h ** 2) + 0.01 * jnp.sum(h.mean(0) ** 2),
    # batch statistics of the parameters' values read per example (centred moments)
    "centred_variance": lambda h, x: jnp.mean((h - h.mean(0)) ** 2),
    "correlation_with_input": lambda h, x: -jnp.sum(
        (h[:, 0] - h[:, 0].mean()) * (x[:, 0] - x[:, 0].mean())) / jnp.sqrt(
            jnp.sum((h[:, 0] - h[:, 0].mean()) ** 2) * jnp.sum((x[:, 0] - x[:, 0].mean()) ** 2)
            + 1e-6),
    "standardised_by_batch": lambda h, x: jnp.mean(
        ((h - h.mean(0)) / (h.std(0) + 1e-2)) ** 2 * x[:, :1]),
    "softmax_over_batch": lambda h, x: jnp.sum(jax.nn.softmax(h[:, 0]) * h[:, 1]),
    "covariance_off_diagonal": lambda h, x: jnp.sum(
        ((h - h.mean(0)).T @ (h - h.mean(0)) / B * (1 - jnp.eye(h.shape[1]))) ** 2),
}


# What picks between a program's two branches (`lax.cond`), when it has two: the
# parameters and a constant are the same for every microbatch; the batch is not.
CHOOSERS: dict[str, Callable] = {
    "parameter": lambda p, x: p["w"][0, 0] > 0,
    "constant": lambda p, x: jnp.int32(1),
    "batch_mean": lambda p, x: x[:, 0].mean() > 0,
}


@dataclasses.dataclass(frozen=True)
class Program:
  ops: tuple[str, ...]
  reduction: str
  k: int
  branch: tuple[str, ...] | None = None  # ops of a second branch, chosen by `chooser`
  chooser: str = "parameter"

  def loss(self, p, x):
    h = jnp.tanh(x @ p["w"])

    def run(ops):
      out = h
      for name in ops:
        out = OPS[name](out, x)
      return REDUCTIONS[self.reduction](out @ p["v"], x)
    if self.branch is None:
      return run(self.ops)
    return jax.lax.cond(CHOOSERS[self.chooser](p, x), lambda: run(self.branch),
                        lambda: run(self.ops))

  def case(self) -> harness.Case:
    def step(params, x):
      loss, g = jax.value_and_grad(self.loss)(params, x)
      return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), {"loss": loss}

    def make():
      key = jax.random.key(hash(self) % (1 << 31))
      k1, k2, k3 = jax.random.split(key, 3)
      return ({"w": jax.random.normal(k1, (D, F)) * 0.5, "v": jax.random.normal(k2, (F, F)) * 0.5},
              jax.random.normal(k3, (B, D)))
    cond = "" if self.branch is None else f" | cond({self.chooser}): {' '.join(self.branch)}"
    return harness.Case(" ".join(self.ops) + f" | {self.reduction} | k={self.k}{cond}",
                        step, make)


def random_program(rng: random.Random, max_ops: int = 4) -> Program:
  names = sorted(OPS)
  ops = tuple(rng.choice(names) for _ in range(rng.randint(0, max_ops)))
  program = Program(ops, rng.choice(sorted(REDUCTIONS)), rng.choice((2, 4, B)))
  if rng.random() < 0.25:  # a second branch, chosen by a cond
    branch = tuple(rng.choice(names) for _ in range(rng.randint(0, max_ops)))
    program = dataclasses.replace(program, branch=branch, chooser=rng.choice(sorted(CHOOSERS)))
  return program


@dataclasses.dataclass(frozen=True)
class Verdict:
  program: object  # a Program or a token_programs.TokenProgram
  split: bool
  distance: float
  error: str | None = None  # a crash jax.jit does not have
  distance64: float | None = None  # the same in float64, where `distance` > RTOL
  refused: str | None = None

  @property
  def silently_different(self) -> bool:
    """Split, and apart from jax.jit by more than rounding (checked in float64)."""
    return self.split and self.distance > harness.RTOL and (
        self.distance64 is None or harness.semantic(self.distance, self.distance64))

  @property
  def rounding(self) -> bool:
    """Split, apart by more than RTOL in float32, by rounding only (float64 agrees)."""
    return self.split and self.distance > harness.RTOL and not self.silently_different

  @property
  def internal_error(self) -> bool:
    """A refusal that says it is the guard's own bug."""
    from hbm_guard._src.dropin import intercept  # pylint: disable=import-outside-toplevel
    return bool(self.refused) and intercept.INTERNAL_ERROR in self.refused


def judge(program, steps: int = 1, run_refused: bool = True) -> Verdict:
  """The program under its microbatch plan against jax.jit (a refused one only traced,
  unless `run_refused`: it runs jax's own gradient); a split apart by more than RTOL is
  run again in float64."""
  from hbm_guard._src.plans import plan as plan_lib  # pylint: disable=import-outside-toplevel
  case = program.case()
  try:
    out = harness.under_plan(case, plan_lib.Plan(microbatches=program.k), steps=steps,
                             run_refused=run_refused)
  except Exception as e:  # pylint: disable=broad-except  (reported: a crash is a failure)
    try:
      harness._run(jax.jit(case.step), *_split(case.make()), steps)  # pylint: disable=protected-access
    except Exception:  # pylint: disable=broad-except  (jax.jit fails too: not the guard's)
      return Verdict(program, False, 0.0)
    return Verdict(program, False, 0.0, f"{type(e).__name__}: {e}"[:300])
  return Verdict(program, out.split, out.distance, None, out.distance64, out.refused)


def _split(made: Sequence) -> tuple:
  return made[0], list(made[1:])
