"""guarded_jit: the drop-in for `jax.jit`. Its keywords are GuardOptions' fields, each
default read from there (written once); the step it returns is a `guard.GuardedFunction`."""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
from typing import Any, Callable, Sequence

from hbm_guard._src.backends import options as options_lib
from hbm_guard._src.guard.guard import GuardedFunction
from hbm_guard._src.plans import plan as plan_lib


class _Default:
  """A keyword's default, told apart from the same value given explicitly (which, beside
  `options=`, replaces that field); shown as the value itself in help(). The value is
  GuardOptions' own field default, written there once."""
  __slots__ = ("value",)

  def __init__(self, option: str):
    self.value = _OPTION_FIELDS[option].default

  def __repr__(self):
    return repr(self.value.value if isinstance(self.value, enum.Enum) else self.value)


_OPTION_FIELDS = {f.name: f for f in dataclasses.fields(options_lib.GuardOptions)}


def guarded_jit(fun: Callable | None = None, /, *,
                capacity: int | str | None = _Default("capacity"),
                target: str | None = _Default("target"), max_class: str = _Default("max_class"),
                max_attempts: int = _Default("max_attempts"),
                ladder: str | Sequence[Any] | None = _Default("ladder"),
                state_argnums: int | Sequence[int] = _Default("state_argnums"),
                report_dir: str | None = _Default("report_dir"),
                auto_fallback: bool = _Default("auto_fallback"),
                plan_cache: str | os.PathLike | bool | None = _Default("plan_cache"),
                plan: plan_lib.Plan | dict | str | None = _Default("plan"),
                search: str = _Default("search"),
                headroom: float = _Default("headroom"),
                plan_cache_retry_exhausted: bool = _Default("plan_cache_retry_exhausted"),
                options: options_lib.GuardOptions | None = None,
                **jit_kwargs):
  """`jax.jit` that recompiles down a fallback ladder until the step fits in memory.

  Args:
    fun: the step. Usable as `@guarded_jit` or `@guarded_jit(...)`, on functions and
      methods.
    capacity: bytes, "16GiB", or a device name ("v5e"): peak memory from
      `memory_analysis()` above it counts as an out-of-memory (kind "budget"), on any
      backend.
    target: a TPU topology ("v5e:2x2"): climb against libtpu's compiler for it, then run
      locally with the plan that fits the target.
    max_class: the highest rung class allowed: "exact", "numerics" or "behaviour".
    max_attempts: most compiles per input signature (>= 1).
    ladder: a ladder JSON path or list of rungs; default `configs/ladder.json`.
    state_argnums: arguments the step replaces (state in, state out with the same
      structure), which the guard may donate and shard. Default: the `donate_argnums`
      given for `jax.jit` (what the caller has given up already); never inferred beyond
      them: the caller may still hold an argument the guard cannot see.
    report_dir: where the post-mortem JSON goes (default $HBM_GUARD_REPORT_DIR or
      ./hbm_guard_reports); written atomically after every attempt.
    auto_fallback: False: diagnose, report, change nothing and raise (the compiler's own
      error, or CapacityExceededError for `capacity=`). A bool only.
    plan_cache: a directory remembering the plan that fit each program and signature (a
      restart compiles once); True/None: $HBM_GUARD_PLAN_CACHE or ~/.cache/hbm_guard/plans;
      False or "off": none.
    plan: the plan to start from: a `Plan`, its dict, a JSON file (as the report's
      `final_plan`), or a report. It must stay within these options (its rungs within
      `max_class`, donation within `state_argnums`). With `auto_fallback=False` the plan
      is pinned: compiled as is, and an error if it does not fit.
    search: "probes" (default): after a failure, price candidate plans by cheap probes and
      compile the cheapest predicted to fit; "ladder": the next rung, one compile each.
    headroom: the fraction of the capacity a *predicted* figure must stay under (0.5-1.0);
      the compiler's exact figure of a compiled plan is held against the capacity itself.
    plan_cache_retry_exhausted: climb again even when the plan cache remembers that
      nothing fit this program.
    options: a `GuardOptions` holding all of the above (and `max_fit_seconds`, `progress`,
      `auto_plan_aware`: False, helpers only); keyword arguments replace its fields.
    **jit_kwargs: passed to `jax.jit` (static_argnums, donate_argnums, in_shardings, ...).

  Example:
    step = hbm_guard.guarded_jit(train_step, state_argnums=0, target="v5e:2x2")
    state, metrics = step(state, batch)
    step.plan, step.attempts
  """
  given = dict(capacity=capacity, target=target, max_class=max_class,
               max_attempts=max_attempts, ladder=ladder, state_argnums=state_argnums,
               report_dir=report_dir, auto_fallback=auto_fallback, plan_cache=plan_cache,
               plan=plan, search=search, headroom=headroom,
               plan_cache_retry_exhausted=plan_cache_retry_exhausted, **jit_kwargs)
  if options is not None:  # what was given explicitly replaces options' fields, even a
    given = {k: v for k, v in given.items() if not isinstance(v, _Default)}  # default value
  else:
    given = {k: v.value if isinstance(v, _Default) else v for k, v in given.items()}
  if fun is None:
    return functools.partial(guarded_jit, options=options, **given)
  if options is None:
    return GuardedFunction(fun, options_lib.make(**given))
  return GuardedFunction(fun, options, **given)
