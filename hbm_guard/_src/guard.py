"""guarded_jit: `jax.jit` that climbs a fallback ladder when the step does not fit.

A call goes straight to a `jax.jit` object (jax's C++ fast path). Only when jax traces an
input signature the guard has not fitted does it step in: the traced function raises
`NewSignature` before anything compiles, and the guard fits that signature (serialised by
a lock, one `fit.Fit` each), climbing from the plan in force. Each plan has its own jit
object, whose traced function only accepts the signatures fitted to that plan, so a plan
always belongs to the signatures it was fitted for, signatures sharing a plan share one
jit (no recompiles), and the executable the fit compiled is the one the next call runs.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import threading
from typing import Any, Callable, Hashable, Sequence

import jax
from absl import logging

from hbm_guard._src import backend as backend_lib
from hbm_guard._src import climb as climb_lib
from hbm_guard._src import compile as compile_lib
from hbm_guard._src import errors
from hbm_guard._src import estimated as estimated_lib
from hbm_guard._src import fit as fit_lib
from hbm_guard._src import layout as layout_lib
from hbm_guard._src import options as options_lib
from hbm_guard._src import plan as plan_lib
from hbm_guard._src import plan_cache as plan_cache_lib
from hbm_guard._src import record as record_lib
from hbm_guard._src import planner as planner_lib
from hbm_guard._src import steps as steps_lib
from hbm_guard._src import tournament as tournament_lib
from hbm_guard._src.search import rivals as rivals_lib

default_offload_filter = layout_lib.default_offload_filter

try:  # Hide hbm_guard's frames from user tracebacks, as jax hides its own (equinox does too).
  from jax._src import traceback_util  # pylint: disable=g-import-not-at-top
  traceback_util.register_exclusion(os.path.dirname(os.path.abspath(__file__)))
  _api_boundary = traceback_util.api_boundary
except (ImportError, AttributeError):  # a private API: without it, tracebacks are longer
  _api_boundary = lambda fun: fun  # noqa: E731


class GuardedFunction:
  """A jitted step that recompiles down the ladder when it does not fit. See guarded_jit."""

  def __init__(self, fun: Callable, options: options_lib.GuardOptions | None = None,
               **kwargs):
    if options is None:
      options = options_lib.make(**kwargs)
    elif kwargs:
      options = options_lib.make(**{**options.as_kwargs(), **kwargs})
    functools.update_wrapper(self, fun)
    self.options = options
    self._fun = fun
    self._step = steps_lib.StepBuilder(fun, options)
    self._backend = backend_lib.make(self._step, options)
    self._cache = plan_cache_lib.resolve(options.plan_cache)
    name = self._step.name
    self._ledger = fit_lib.Ledger(name, options, f"{name}-{os.getpid()}-{id(self):x}")
    self._lock = threading.RLock()
    self._by_signature: dict[Hashable, steps_lib.PlanJit] = {}
    self._many_plans = False
    self._plan = options.plan or plan_lib.Plan()  # the latest fit's plan (a target's)
    self._estimated: estimated_lib.Outcome | None = None  # the latest fit's rivals compared
    # The first call's jit only detects the new signature. It is never reused to run the
    # step: a jit whose first trace raised loses jax's C++ fast path for good.
    allowed: set = set()
    hot_jit = self._step.jit(plan_lib.Plan(), None, 0, allowed, {})
    self._hot = steps_lib.PlanJit(plan_lib.Plan(), hot_jit, None, allowed, {})

  @property
  def plan(self) -> plan_lib.Plan:
    """The plan of the most recently fitted input signature."""
    return self._plan

  @property
  def attempts(self) -> list[climb_lib.Attempt]:
    """Every compile so far, of every input signature, in order."""
    return self._ledger.attempts

  @property
  def estimated(self) -> estimated_lib.Outcome | None:
    """For a target fitted with `estimated_rivals`: the plans the latest fit compiled and
    compared by their estimated step times (the search's choice first); else None."""
    return self._estimated

  @property
  def report_path(self) -> str | None:
    """The post-mortem JSON, once one was written."""
    return self._ledger.path

  # -- fitting ----------------------------------------------------------------------------

  def _start(self, nargs: int) -> plan_lib.Plan:
    """Where a new signature's climb starts: the plan in force (a pinned plan= checked
    again now that negative argnums resolve), or plain jit when fallback is off."""
    o = self.options
    if not (o.auto_fallback or o.plan is not None):
      return plan_lib.Plan()
    if o.plan is not None and self._plan is o.plan:
      return o.trusted(self._plan, nargs=nargs, source="plan=")
    return self._plan

  def _fit(self, key, args, kwargs, failed_run: compile_lib.Trial | None = None
           ) -> steps_lib.PlanJit:
    """Fits one input signature (one at a time); returns the jit that runs it.

    `failed_run`: the plan in force compiled but ran out of memory at its first call (a
    GPU); the climb starts from it as from a failed compile.
    """
    with self._lock:
      if key in self._by_signature and failed_run is None:  # fitted by another thread
        return self._by_signature[key]
      bad = [i for i in self.options.state_argnums if not -len(args) <= i < len(args)]
      if bad:
        raise errors.InvalidOptionError(
            f"hbm_guard: state_argnums {bad} out of range for {len(args)} positional "
            f"argument(s) of {self._step.name}.")
      start = self._start(len(args))
      if failed_run is not None:
        start = failed_run.plan
        self._by_signature.pop(key, None)
      fit = fit_lib.Fit(self._step, self._backend, self.options, self._cache, self._ledger,
                        key, args, kwargs)
      self._estimated = None  # a fit that raises compared nothing
      result = fit.run(start, failed_run)
      compared = self._estimated = self._compare_estimates(fit, result)
      if compared is not None:
        result = dataclasses.replace(result, plan=compared.winner)
      entry = self._step.plan_jit(self._backend.runnable(result.plan), args)
      entry.allowed.add(key)
      self._by_signature[key] = entry
      self._many_plans = len({id(e) for e in self._by_signature.values()}) > 1
      self._plan, self._hot = result.plan, entry
      self._time_rivals(fit, result, key, args, kwargs)
      if compared is not None:
        self._ledger.write(fit_lib.Status.FITS, final_plan=result.plan,
                           estimated=compared.to_dict())
        fit.remember(result.plan, tuple(a.to_dict() for a in self._ledger.attempts))
      elif len(result.attempts) > 1 or self._ledger.path is not None:
        self._ledger.write(fit_lib.Status.FITS, final_plan=result.plan)
      if len(result.attempts) > 1:
        logging.info("hbm_guard: %s fits with %s after %d compile(s)", self._step.name,
                     result.plan.describe(), len(result.attempts))
      return entry

  def _compare_estimates(self, fit: fit_lib.Fit, result: climb_lib.Result
                         ) -> estimated_lib.Outcome | None:
    """For a target, where the user allows it (`estimated_rivals`): plans near the
    search's choice compiled, the one estimated fastest kept (`estimated`); None where
    nothing was compared. Rivals stop where the fit's time budget would not cover one."""
    field = fit.rivals(result, estimated=True) if self.options.estimated_rivals else None
    if field is None or not result.attempts:
      return None
    def compile_plans(plans):
      out = []
      for plan, trial in zip(plans, fit.compile_rivals(plans)):
        if trial is None:  # past the time budget
          out.append(None)
          continue
        e = estimated_lib.Estimated.of(plan, trial)
        logging.info("hbm_guard: %s, estimated against %s: %s%s", plan.describe(),
                     result.plan.describe(), trial.outcome,
                     "" if e.seconds is None else f", {1000 * e.seconds:.2f} ms a step")
        out.append(e)
      return out
    chosen = estimated_lib.Estimated.of(result.plan, result.attempts[-1])
    outcome = estimated_lib.compare(field, chosen, compile_plans,
                                    self.options.estimated_rivals, width=fit.rival_width)
    if outcome.winner != result.plan:
      logging.info("hbm_guard: %s: %s in place of %s: %s", self._step.name,
                   outcome.winner.describe(), result.plan.describe(), outcome.why)
    return outcome

  def _time_rivals(self, fit: fit_lib.Fit, result: climb_lib.Result, key, args, kwargs):
    """Where the step runs here and the search left plans near its choice: the first steps
    time them against it (`tournament`); one process only (several must agree on a plan)."""
    o = self.options
    field = (fit.rivals(result) if o.timed_rivals and not self._many_plans
             and jax.process_count() == 1 else None)
    if field is None or rivals_lib.next_rival(
        field, result.plan, frozenset({planner_lib.program(result.plan)})) is None:
      return
    shapes = layout_lib.abstract_tree((args, kwargs))
    def entry(plan):
      e = self._step.plan_jit(self._backend.runnable(plan), shapes[0])
      e.allowed.add(key)
      return e
    def compile_fits(plan):
      trial = self._backend.compile(plan, key, *shapes)
      logging.info("hbm_guard: %s, to time against %s: %s", plan.describe(),
                   result.plan.describe(), trial.outcome)
      return trial.outcome is compile_lib.Outcome.FITS
    def recoverable(error, call_args):  # a rival's allocation failed: nothing consumed
      rec = record_lib.parse(error)
      return (rec is not None and not rec.is_compile_time
              and self._donated_alive(entry(result.plan), call_args))
    self._hot = tournament_lib.Tournament(
        field, result.plan, entry, compile_fits,
        functools.partial(self._settle, key, fit, entry), max_rivals=o.timed_rivals,
        recoverable=recoverable)

  def _settle(self, key, fit: fit_lib.Fit, entry, outcome: tournament_lib.Outcome):
    """The plan the first steps settled on runs this signature from now on, directly."""
    with self._lock:
      if not isinstance(self._hot, tournament_lib.Tournament):
        return  # another signature was fitted meanwhile: this one keeps its plan
      winner = entry(outcome.winner)
      self._by_signature[key] = self._hot = winner
      self._plan = outcome.winner
      timed = {"why": outcome.why, "plans": [t.to_dict() for t in outcome.timings]}
      self._ledger.write(fit_lib.Status.FITS, final_plan=outcome.winner, timed=timed)
      fit.remember(outcome.winner, tuple(a.to_dict() for a in self._ledger.attempts))
      logging.info("hbm_guard: %s settles on %s: %s", self._step.name,
                   outcome.winner.describe(), ", ".join(
                       f"{t.plan.describe()} {1000 * t.median:.2f} ms" for t in outcome.timings))

  def _donated_alive(self, entry: steps_lib.PlanJit, args) -> bool:
    """Whether every argument the plan donates is still there (not consumed)."""
    donated = set(entry.plan.donate_argnums) | set(self.options.user_donate)
    return not any(getattr(x, "is_deleted", lambda: False)()
                   for i in donated if i < len(args) for x in jax.tree_util.tree_leaves(args[i]))

  def _first_run(self, entry: steps_lib.PlanJit, key, args, kwargs):
    """The first call of a newly fitted plan: a runtime out-of-memory (a GPU allocating at
    run time) is climbed from like a compile-time one, when nothing the caller held was
    consumed; otherwise it is raised, saying so."""
    try:
      return entry(layout_lib.place(args, entry.layout), kwargs)
    except jax.errors.JaxRuntimeError as e:
      rec = record_lib.parse(e)
      if rec is None or rec.is_compile_time or not self.options.auto_fallback:
        raise
      if not self._donated_alive(entry, args):
        raise errors.StateConsumedError.at_first_call(
            name=self._step.name, plan=entry.plan.describe()) from e
      entry.allowed.discard(key)
      trial = compile_lib.Trial(self._plan, compile_lib.Outcome.OOM, 0.0,
                                entry.facts.get(key), rec, error=e)
      entry = self._fit(key, args, kwargs, failed_run=trial)
      return entry(layout_lib.place(args, entry.layout), kwargs)

  # -- calling ----------------------------------------------------------------------------

  @_api_boundary
  def __call__(self, *args, **kwargs):
    if self._many_plans:  # signatures live on several jits: dispatch on the signature
      key = self._step.key(args, kwargs)
      entry = self._by_signature.get(key)
      if entry is not None:
        return entry(args, kwargs)
    else:
      try:
        return self._hot(args, kwargs)
      except steps_lib.NewSignature as e:
        key = e.key
      entry = self._by_signature.get(key)
      if entry is not None:  # fitted earlier, to another plan's jit
        return entry(args, kwargs)
    entry = self._fit(key, args, kwargs)
    return self._first_run(entry, key, args, kwargs)  # state moved once, then direct

  def replace(self, **options) -> "GuardedFunction":
    """A new guarded step over the same function, with some options changed (a target)."""
    return GuardedFunction(self._fun, self.options, **options)

  def __get__(self, instance, owner=None):
    """As a method decorator: binds the instance as the first argument (like a function)."""
    if instance is None:
      return self
    return _Bound(self, instance)

  @_api_boundary
  def fit(self, *args, **kwargs) -> plan_lib.Plan:
    """Finds (and installs) the plan that fits these arguments, without running the step.
    The plan is the one fitted: for a target, with its TPU options."""
    key = self._step.key(args, kwargs)
    if key not in self._by_signature:
      self._fit(key, args, kwargs)
    return self._plan

  def _any_jit(self):
    return self._step.jit(self._backend.runnable(self._plan))

  @_api_boundary
  def trace(self, *args, **kwargs):
    return self._any_jit().trace(*args, **kwargs)

  @_api_boundary
  def lower(self, *args, **kwargs):
    """Lowers under the plan in force (like jax.jit(...).lower); call fit() first to climb."""
    return self._any_jit().lower(*args, **kwargs)

  @_api_boundary
  def eval_shape(self, *args, **kwargs):
    return jax.eval_shape(self._any_jit(), *args, **kwargs)


class _Bound:
  """A GuardedFunction bound to an instance, as a method."""

  def __init__(self, guarded: GuardedFunction, instance):
    self._guarded, self._instance = guarded, instance
    functools.update_wrapper(self, guarded._fun)  # pylint: disable=protected-access

  @_api_boundary
  def __call__(self, *args, **kwargs):
    return self._guarded(self._instance, *args, **kwargs)

  def __getattr__(self, name):
    attr = getattr(self._guarded, name)
    if name in ("fit", "lower", "trace", "eval_shape"):  # each takes the step's arguments
      return functools.partial(attr, self._instance)
    return attr


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
