"""GuardedFunction: a `jax.jit` that climbs a fallback ladder when the step does not fit.

A call goes straight to a `jax.jit` object (jax's C++ fast path). Only when jax traces an
input signature the guard has not fitted does it step in: the traced function raises
`NewSignature` before anything compiles, and the guard fits that signature (serialised by
a lock, one `fit.Fit` each), climbing from the plan in force. Each plan has its own jit
object, whose traced function only accepts the signatures fitted to that plan, so a plan
always belongs to the signatures it was fitted for, signatures sharing a plan share one
jit (no recompiles), and the executable the fit compiled is the one the next call runs.
Which of the plans that fit is kept (estimated or timed rivals) is `keep`'s; the public
constructor, `guarded_jit`, is `api`'s.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Callable, Hashable

import jax

from hbm_guard._src.backends import backend as backend_lib
from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.backends import estimated as estimated_lib
from hbm_guard._src.backends import options as options_lib
from hbm_guard._src.backends import steps as steps_lib
from hbm_guard._src.files import plan_cache as plan_cache_lib
from hbm_guard._src.guard import boundary
from hbm_guard._src.guard import climb as climb_lib
from hbm_guard._src.guard import fit as fit_lib
from hbm_guard._src.guard import keep
from hbm_guard._src.guard import tournament as tournament_lib
from hbm_guard._src.plans import layout as layout_lib
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.record import errors
from hbm_guard._src.record import record as record_lib


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

  def _fit(self, key, args, kwargs, failed_run: compile_lib.Trial | None = None
           ) -> steps_lib.PlanJit:
    """Fits one input signature (one at a time); returns the jit that runs it.

    `failed_run`: the plan in force compiled but ran out of memory at its first call (a
    GPU); the climb starts from it as from a failed compile.
    """
    with self._lock:
      if key in self._by_signature and failed_run is None:  # fitted by another thread
        return self._by_signature[key]
      self._step.check_state_argnums(len(args))
      start = self.options.start(self._plan, nargs=len(args))
      if failed_run is not None:
        start = failed_run.plan
        self._by_signature.pop(key, None)
      fit = fit_lib.Fit(self._step, self._backend, self.options, self._cache, self._ledger,
                        key, args, kwargs)
      self._estimated = None  # a fit that raises compared nothing
      result = fit.run(start, failed_run)
      kept = keep.choose(fit, result, self._step, self._backend, self.options, self._ledger,
                         key, args, kwargs, [e for k, e in self._by_signature.items()
                                             if k != key],
                         functools.partial(self._settle, key, fit))
      self._by_signature[key] = kept.entry
      self._many_plans = len({id(e) for e in self._by_signature.values()}) > 1
      self._plan, self._hot, self._estimated = kept.plan, kept.hot, kept.estimated
      return kept.entry

  def _settle(self, key, fit: fit_lib.Fit, entry, outcome: tournament_lib.Outcome):
    """The plan the first steps settled on runs this signature from now on, directly."""
    with self._lock:
      if not isinstance(self._hot, tournament_lib.Tournament):
        return  # another signature was fitted meanwhile: this one keeps its plan
      self._by_signature[key] = self._hot = entry(outcome.winner)
      self._plan = outcome.winner
      keep.settled(fit, self._ledger, self._step.name, outcome)

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
      if not keep.donated_alive(entry, args, self.options):
        raise errors.StateConsumedError.at_first_call(
            name=self._step.name, plan=entry.plan.describe()) from e
      entry.allowed.discard(key)
      trial = compile_lib.Trial(self._plan, compile_lib.Outcome.OOM, 0.0,
                                entry.facts.get(key), rec, error=e)
      entry = self._fit(key, args, kwargs, failed_run=trial)
      return entry(layout_lib.place(args, entry.layout), kwargs)

  # -- calling ----------------------------------------------------------------------------

  @boundary.api_boundary
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
    return boundary.Bound(self, instance)

  @boundary.api_boundary
  def fit(self, *args, **kwargs) -> plan_lib.Plan:
    """Finds (and installs) the plan that fits these arguments, without running the step.
    The plan is the one fitted: for a target, with its TPU options."""
    key = self._step.key(args, kwargs)
    if key not in self._by_signature:
      self._fit(key, args, kwargs)
    return self._plan

  def _any_jit(self):
    return self._step.jit(self._backend.runnable(self._plan))

  @boundary.api_boundary
  def trace(self, *args, **kwargs):
    return self._any_jit().trace(*args, **kwargs)

  @boundary.api_boundary
  def lower(self, *args, **kwargs):
    """Lowers under the plan in force (like jax.jit(...).lower); call fit() first to climb."""
    return self._any_jit().lower(*args, **kwargs)

  @boundary.api_boundary
  def eval_shape(self, *args, **kwargs):
    return jax.eval_shape(self._any_jit(), *args, **kwargs)
