"""guarded_jit: `jax.jit` that climbs a fallback ladder when the step does not fit.

A call goes straight to a `jax.jit` object (jax's C++ fast path). Only when jax traces an
input signature the guard has not fitted does it step in: the traced function raises
`_NewSignature` before anything compiles, and the guard fits that signature (serialised by
a lock), climbing from the plan in force. Each plan has its own jit object, whose traced
function only accepts the signatures fitted to that plan, so a plan always belongs to the
signatures it was fitted for, signatures sharing a plan share one jit (no recompiles), and
the executable the fit compiled is the one the next call runs.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import threading
import time
from typing import Any, Callable, Hashable, Sequence

import jax
import numpy as np
from absl import logging

from hbm_guard._src import argnums as argnums_lib
from hbm_guard._src import climb as climb_lib
from hbm_guard._src import compile as compile_lib
from hbm_guard._src import diagnose as diagnose_lib
from hbm_guard._src import errors
from hbm_guard._src import hosts as hosts_lib
from hbm_guard._src import ladder as ladder_lib
from hbm_guard._src import layout as layout_lib
from hbm_guard._src import options as options_lib
from hbm_guard._src import plan as plan_lib
from hbm_guard._src import plan_cache as plan_cache_lib
from hbm_guard._src import record as record_lib
from hbm_guard._src import planner as planner_lib
from hbm_guard._src import report as report_lib
from hbm_guard._src import targets as targets_lib
from hbm_guard._src import trace as trace_lib

MiB = 1 << 20
default_offload_filter = layout_lib.default_offload_filter

try:  # Hide hbm_guard's frames from user tracebacks, as jax hides its own (equinox does too).
  from jax._src import traceback_util  # pylint: disable=g-import-not-at-top
  traceback_util.register_exclusion(os.path.dirname(os.path.abspath(__file__)))
  _api_boundary = traceback_util.api_boundary
except (ImportError, AttributeError):  # a private API: without it, tracebacks are longer
  def _api_boundary(fun):
    return fun


class _NewSignature(Exception):
  """Raised at trace time for an input signature not fitted to this jit's plan."""

  def __init__(self, key):
    super().__init__("hbm_guard: new input signature")
    self.key = key


@dataclasses.dataclass(eq=False)
class _PlanJit:
  """A jit object for one plan (and, with a layout, one state structure)."""
  plan: plan_lib.Plan
  jitted: Any
  layout: dict[int, Any] | None
  allowed: set  # signatures this jit may trace
  facts: dict  # signature -> compile_lib.TraceFacts of its last trace

  def __call__(self, args, kwargs):
    try:
      return self.jitted(*args, **kwargs)
    except ValueError:
      # State the caller holds in another layout than the plan's (sharded, on host): move
      # it once; the step returns it in the planned layout, so later calls are direct.
      if not self.layout:
        raise
      return self.jitted(*layout_lib.place(args, self.layout), **kwargs)


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
    self._name = getattr(fun, "__name__", "step")
    self._target = options.target
    self._capacity = options.budget
    self._max_class = options.max_class
    self._max_attempts = options.max_attempts
    self._rungs = options.ladder
    self._state_argnums = options.state_argnums
    self._offload_filter = options.offload_filter
    self._auto_fallback = options.auto_fallback
    self._user_donate = options.user_donate
    self._jit_kwargs = options.jax_jit_kwargs()  # donation is merged per plan
    self._replaced: tuple[tuple[int, Any], ...] = ()  # learnt at the first trace
    self._n_outputs: int | None = None
    self._cache = plan_cache_lib.resolve(options.plan_cache)
    self._report = report_lib.Writer(options.report_dir,
                                     f"{self._name}-{os.getpid()}-{id(self):x}")
    self._lock = threading.RLock()
    self._jits: dict[Hashable, _PlanJit] = {}
    self._by_signature: dict[Hashable, _PlanJit] = {}
    self._many_plans = False
    self._cache_parts: dict[str, Any] = {}
    self._auto_capacity: int | None = None  # a GPU's free memory, when no capacity= given
    self._search = options.search
    self._pinned = options.plan is not None
    self._plan = options.plan or plan_lib.Plan()  # the latest fit's plan (a target's)
    self.attempts: list[climb_lib.Attempt] = []
    # The first call's jit only detects the new signature. It is never reused to run the
    # step: a jit whose first trace raised loses jax's C++ fast path for good.
    allowed: set = set()
    self._hot = _PlanJit(plan_lib.Plan(), self._jit(plan_lib.Plan(), None, 0, allowed, {}),
                         None, allowed, {})

  @property
  def plan(self) -> plan_lib.Plan:
    """The plan of the most recently fitted input signature."""
    return self._plan

  @property
  def report_path(self) -> str | None:
    """The post-mortem JSON, once one was written."""
    return self._report.path

  # -- building -------------------------------------------------------------------------

  def _static(self, nargs: int) -> tuple[int, ...]:
    return tuple(i % nargs for i in self._jit_kwargs.get("static_argnums", ())) if nargs else ()

  def _key(self, args, kwargs) -> Hashable:
    return trace_lib.signature(args, kwargs, self._static(len(args)),
                               self._jit_kwargs.get("static_argnames", ()))

  def _traced(self, plan: plan_lib.Plan, allowed, facts):
    fun, state_argnums = self._fun, self._state_argnums

    @functools.wraps(fun)
    def traced(*args, **kwargs):
      key = self._key(args, kwargs)
      if allowed is not None and key not in allowed:
        raise _NewSignature(key)
      with plan_lib.plan_scope(plan) as scope:
        out = fun(*args, **kwargs)
      facts[key] = compile_lib.TraceFacts(
          reads=frozenset(scope.reads), replaced=trace_lib.replaced_state(args, out, state_argnums),
          n_outputs=len(out) if isinstance(out, (tuple, list)) else None,
          batch_size=scope.facts.get("batch_size"), loss_form=scope.facts.get("loss_form"),
          optimizer_streaming=scope.facts.get("optimizer_streaming"))
      return out

    return traced

  def _jit(self, plan: plan_lib.Plan, layout, nargs: int, allowed, facts):
    kw = dict(self._jit_kwargs)
    donate = tuple(sorted(set(self._user_donate) | set(plan.donate_argnums)))
    if donate:
      kw["donate_argnums"] = donate
    if plan.compiler_options:  # the user's own options, and the plan's over them
      kw["compiler_options"] = {**(kw.get("compiler_options") or {}),
                                **dict(plan.compiler_options)}
    if layout:
      static = set(self._static(nargs))
      kw["in_shardings"] = tuple(layout.get(i) for i in range(nargs) if i not in static)
      kw["out_shardings"] = layout_lib.out_shardings(layout, self._replaced, self._n_outputs)
    return jax.jit(self._traced(plan, allowed, facts), **kw)

  def _plan_jit(self, plan: plan_lib.Plan, args) -> _PlanJit:
    """The local jit object for `plan` (one per plan and, with a layout, state structure)."""
    layout = None
    if args is not None:
      layout = layout_lib.plan_layout(plan, args, [i for i, _ in self._replaced],
                                      jax.devices(), self._offload_filter)
    jkey = (plan, None if layout is None else
            jax.tree_util.tree_structure(tuple(args[i] for i in layout)),
            None if layout is None else tuple(np.shape(x) for x in jax.tree.leaves(
                tuple(args[i] for i in layout))))
    entry = self._jits.get(jkey)
    if entry is None:
      allowed, facts = set(), {}
      nargs = len(args) if args is not None else 0
      entry = _PlanJit(plan, self._jit(plan, layout, nargs, allowed, facts), layout, allowed,
                       facts)
      self._jits[jkey] = entry
    return entry

  def _local(self, plan: plan_lib.Plan) -> plan_lib.Plan:
    """The plan as the local backend can run it (TPU flags only on TPU)."""
    if jax.default_backend() != "tpu" and plan.compiler_options:
      plan = dataclasses.replace(plan, compiler_options=())
    return plan

  # -- fitting --------------------------------------------------------------------------

  def _try(self, plan: plan_lib.Plan, key, args, kwargs, *, probe: bool = False
           ) -> compile_lib.Trial:
    """One compile under `plan`. A probe on a target gets a 1 MiB limit: libtpu's early
    check then fails it in seconds with what the plan needs."""
    capacity = self._capacity if self._capacity is not None else self._auto_capacity
    if self._target is not None:
      devices = self._target.devices()
      layout = layout_lib.plan_layout(plan, args, [i for i, _ in self._replaced], devices,
                                      self._offload_filter)
      facts: dict = {}
      jitted = self._jit(plan, layout, len(args), None, facts)
      targs, tkw = layout_lib.abstract_args(
          args, kwargs, layout, self._static(len(args)),
          self._jit_kwargs.get("static_argnames", ()), devices)
      options = dict(plan.compiler_options)
      if probe:
        options["xla_tpu_max_hbm_size_mib"] = 1
      elif self._capacity is not None:
        options["xla_tpu_max_hbm_size_mib"] = max(1, self._capacity // MiB)
      if probe or targets_lib.compiler_counts_arguments(self._target):
        capacity = None  # libtpu's own verdict at that limit counts arguments too

      def compile_fn():
        return jitted.lower(*targs, **tkw).compile(options)
    else:
      entry = self._plan_jit(self._local(plan), args)
      entry.allowed.add(key)
      facts = entry.facts
      largs, lkw = (layout_lib.abstract_args(
          args, kwargs, entry.layout, self._static(len(args)),
          self._jit_kwargs.get("static_argnames", ())) if entry.layout else (args, kwargs))

      def compile_fn():
        return entry.jitted.lower(*largs, **lkw).compile()
    try:
      trial = compile_lib.try_compile(plan, compile_fn, lambda: facts.get(key),
                                      capacity=capacity, name=self._name)
    finally:
      if self._target is None and key in entry.allowed and key not in self._by_signature:
        entry.allowed.discard(key)  # re-admitted below if this plan fits
    if trial.facts is not None and not self._replaced:
      self._replaced, self._n_outputs = trial.facts.replaced, trial.facts.n_outputs
    return trial

  def _probe(self, plan: plan_lib.Plan, key, args, kwargs) -> int | None:
    """What `plan` needs, cheaply: libtpu's early figure, or a full compile's peak."""
    trial = self._try(plan, key, args, kwargs, probe=True)
    if trial.record is not None:
      return trial.record.required_bytes
    return (trial.memory or {}).get("peak")

  def _flops(self, plan: plan_lib.Plan, args, kwargs) -> float | None:
    """The step's compute under `plan` (one batch, no placement), by the compiler's count."""
    local = dataclasses.replace(plan, offload_optimizer=False, shard_state=False,
                                donate_argnums=(), compiler_options=())
    try:
      analysis = self._jit(local, None, len(args), None, {}).lower(*args, **kwargs)
      analysis = analysis.cost_analysis()
      if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else {}
      return float(analysis.get("flops", 0.0)) or None
    except Exception:  # pylint: disable=broad-except  (a backend without cost analysis)
      return None

  def _planner(self, key, args, kwargs):
    """A planner for one fit: probes and compute costs of this signature's plans."""
    box: dict = {}

    def plan_next(plan, trial, facts):
      rec = trial.record
      if "planner" not in box:
        capacity = hosts_lib.agree_capacity(
            self._capacity or self._auto_capacity or rec.available_bytes)
        if not capacity:
          return ladder_lib.next_plan(self._rungs, plan, facts, rec, self._max_class) + (None,)
        box["planner"] = planner_lib.Planner(
            lambda p: self._probe(p, key, args, kwargs),
            lambda p: self._flops(p, args, kwargs), capacity,
            scale=planner_lib.PROBE_SCALE if self._target is not None else 1.0,
            exact=self._target is None, headroom=self.options.headroom)
      planner = box["planner"]
      box["last"] = (plan, facts)
      planner.observe(plan, rec.required_bytes, fits=False)
      return planner_lib.next_plan(planner, self._rungs, plan, facts, rec, self._max_class)

    self._fit_planner = box
    return plan_next

  def _above_class(self) -> dict[str, Any] | None:
    """When nothing allowed fits: would a plan of a higher class? Priced by probes."""
    box = getattr(self, "_fit_planner", None) or {}
    if "planner" not in box or "last" not in box:
      return None
    plan, facts = box["last"]
    for klass in ladder_lib.CLASSES[ladder_lib.CLASSES.index(self._max_class) + 1:]:
      fams, counts, _ = planner_lib.families(self._rungs, plan, facts, klass)
      choice = box["planner"].choose(fams, counts, facts.offload_bytes)
      if choice is not None:
        return {"class": klass, "plan": choice.plan.describe(),
                "predicted_bytes": choice.predicted_bytes}
    return None

  def _device_capacity(self, args) -> int | None:
    """Without capacity= on a GPU: the device's limit less what other live arrays hold."""
    if self._capacity is not None or self._target is not None:
      return None
    if jax.default_backend() != "gpu":
      return None
    try:
      stats = jax.local_devices()[0].memory_stats()
    except Exception:  # pylint: disable=broad-except
      return None
    return targets_lib.capacity_from_stats(stats, layout_lib.nbytes(
        [x for x in jax.tree_util.tree_leaves(args) if isinstance(x, jax.Array)]))

  def _donated_alive(self, entry: _PlanJit, args) -> bool:
    """Whether every argument the plan donates is still there (not consumed)."""
    donated = set(entry.plan.donate_argnums) | set(self._user_donate)
    return not any(getattr(x, "is_deleted", lambda: False)()
                   for i in donated if i < len(args) for x in jax.tree_util.tree_leaves(args[i]))

  def _first_run(self, entry: _PlanJit, key, args, kwargs):
    """The first call of a newly fitted plan: a runtime out-of-memory (a GPU allocating at
    run time) is climbed from like a compile-time one, when nothing the caller held was
    consumed; otherwise it is raised, saying so."""
    try:
      return entry(layout_lib.place(args, entry.layout), kwargs)
    except jax.errors.JaxRuntimeError as e:
      rec = record_lib.parse(e)
      if rec is None or rec.is_compile_time or not self._auto_fallback:
        raise
      if not self._donated_alive(entry, args):
        raise errors.StateConsumedError(
            f"hbm_guard: {self._name} ran out of memory at its first call under "
            f"{entry.plan.describe()}, after donated arguments were consumed: the guard "
            "cannot retry without them. Restore the state (e.g. from a checkpoint) and "
            "call again; the guard will refit from this plan.") from e
      entry.allowed.discard(key)
      trial = compile_lib.Trial(self._plan, compile_lib.Outcome.OOM, 0.0,
                                entry.facts.get(key), rec, error=e)
      entry = self._fit(key, args, kwargs, failed_run=trial)
      return entry(layout_lib.place(args, entry.layout), kwargs)

  def _step_facts(self, args, trial: compile_lib.Trial) -> ladder_lib.StepFacts:
    if self._target is not None:
      platform, devices = "tpu", self._target.devices()
    else:
      platform, devices = jax.default_backend(), jax.devices()
    tf = trial.facts or compile_lib.TraceFacts()
    replaced = tuple(i for i, _ in tf.replaced)
    try:
      has_host = any(getattr(m, "kind", "") == "pinned_host"
                     for m in devices[0].addressable_memories())
    except Exception:  # pylint: disable=broad-except
      has_host = False
    return ladder_lib.StepFacts(
        platform=platform, num_devices=len(devices), plan_reads=tf.reads,
        state_argnums=replaced, state_bytes=sum(layout_lib.nbytes(args[i]) for i in replaced),
        batch_size=tf.batch_size, has_host_memory=has_host,
        can_reshard="in_shardings" not in self._jit_kwargs,
        offload_bytes=sum(layout_lib.offload_bytes(args[i], self._offload_filter)
                          for i in replaced))

  def _check_argnums(self, args):
    bad = [i for i in self._state_argnums if not -len(args) <= i < len(args)]
    if bad:
      raise ValueError(f"hbm_guard: state_argnums {bad} out of range for {len(args)} "
                       f"positional argument(s) of {self._name}.")

  def _fit(self, key, args, kwargs, failed_run: compile_lib.Trial | None = None) -> _PlanJit:
    """Fits one input signature (one at a time); returns the jit that runs it.

    `failed_run`: the plan in force compiled but ran out of memory at its first call (a
    GPU); the climb starts from it as from a failed compile.
    """
    with self._lock:
      if key in self._by_signature and failed_run is None:  # fitted by another thread
        return self._by_signature[key]
      self._check_argnums(args)
      self._auto_capacity = self._device_capacity(args)
      start = self._plan if self._auto_fallback or self._pinned else plan_lib.Plan()
      if self._pinned and start is self.options.plan:  # negative argnums known only now
        start = self.options.trusted(start, nargs=len(args), source="plan=")
      cache_key = cached = None
      if failed_run is not None:
        start = failed_run.plan
        self._by_signature.pop(key, None)
      elif self._cache is not None and self._auto_fallback:
        cache_key = self._cache_key(args, kwargs)
        cached = self._cache.get(cache_key, lambda e: self._trusted_entry(e, len(args)))
        if cached is not None and cached.status == "exhausted":
          if jax.process_count() == 1 and not self.options.plan_cache_retry_exhausted:
            self._exhausted_from_cache(cache_key, cached)  # many hosts never stop alone
          cached = None
        if cached is not None:
          logging.info("hbm_guard: %s starts from the cached plan %s (%s)", self._name,
                       cached.plan.describe(), self._cache.path(cache_key))
          start = cached.plan
      if not self._replaced and (start.shard_state or start.offload_optimizer):
        self._learn_state(args, kwargs)  # a planned layout needs the replaced state first
      def try_plan(p):
        if failed_run is not None and p == failed_run.plan:
          return failed_run
        return self._try(p, key, args, kwargs)

      result = climb_lib.climb(
          try_plan, start, rungs=self._rungs,
          max_class=self._max_class, max_attempts=self._max_attempts,
          auto_fallback=self._auto_fallback,
          step_facts=lambda t: self._step_facts(args, t),
          first_number=len(self.attempts) + 1,
          signature=trace_lib.describe_args(args, kwargs, self._state_argnums),
          on_attempt=self._record,
          plan_next=self._planner(key, args, kwargs) if self._search == "probes" else None)
      if cache_key is not None:
        self._cache.put(cache_key, plan_cache_lib.Entry(
            status="fits" if result.status is climb_lib.Status.FITS else "exhausted",
            plan=result.plan, attempts=tuple(a.to_dict() for a in result.attempts),
            parts=self._cache_parts, written_at=time.time()))
      if result.status is not climb_lib.Status.FITS:
        self._fail(result)
      entry = self._plan_jit(self._local(result.plan), args)
      entry.allowed.add(key)
      self._by_signature[key] = entry
      self._many_plans = len({id(e) for e in self._by_signature.values()}) > 1
      self._plan, self._hot = result.plan, entry
      if len(result.attempts) > 1 or self._report.path is not None:
        self._write_report("fits")
      if len(result.attempts) > 1:
        logging.info("hbm_guard: %s fits with %s after %d compile(s)", self._name,
                     result.plan.describe(), len(result.attempts))
      return entry

  def _cache_key(self, args, kwargs) -> str:
    """What decides the plan: the program under the default plan, where it must fit, how."""
    lowered = self._learn_state(args, kwargs, lower=True)
    if self._target is not None:
      where = f"target:{self._target.name}"
    else:
      where = f"{jax.default_backend()}:{jax.devices()[0].device_kind}x{jax.device_count()}"
    self._cache_parts = {
        "program": hashlib.sha256(lowered.as_text().encode()).hexdigest(), "where": where,
        "capacity": self._capacity, "max_class": self._max_class,
        "ladder": [r.to_dict() for r in self._rungs], "state_argnums": self._state_argnums,
        "max_attempts": self._max_attempts, "search": self._search,
        "headroom": self.options.headroom,
        "compiler_options": self.options.jit_kwargs.get("compiler_options"),
        "compile_environment": plan_cache_lib.compile_environment(),
        "versions": plan_cache_lib.versions()}
    self._cache_parts = json.loads(json.dumps(self._cache_parts, default=repr))
    return plan_cache_lib.digest(self._cache_parts)

  def _learn_state(self, args, kwargs, lower: bool = False):
    """Traces (or lowers) under the default plan: which state the step replaces."""
    facts: dict = {}
    jitted = self._jit(plan_lib.Plan(), None, len(args), None, facts)
    if lower:  # by shape and dtype only: where the caller's arrays live is not the program
      args, kwargs = layout_lib.shapes_only(args, kwargs, self._static(len(args)),
                                            self._jit_kwargs.get("static_argnames", ()))
    out = jitted.lower(*args, **kwargs) if lower else jitted.trace(*args, **kwargs)
    if not self._replaced and facts:
      first = next(iter(facts.values()))
      self._replaced, self._n_outputs = first.replaced, first.n_outputs
    return out

  def _trusted_entry(self, entry: plan_cache_lib.Entry, nargs: int) -> plan_cache_lib.Entry:
    """A cache entry as this guard may use it: its plans within the options, an
    exhaustion young enough to believe; a ValueError (a miss) otherwise."""
    source = "the plan cache entry"
    plan = self.options.trusted(entry.plan, nargs=nargs, source=source)
    if entry.status != "exhausted":
      return dataclasses.replace(entry, plan=plan, attempts=())
    age = entry.age_seconds()
    if age is None or not -300 <= age <= plan_cache_lib.EXHAUSTED_MAX_AGE_S:
      raise ValueError("an exhaustion of unknown age, or older than "
                       f"{plan_cache_lib.EXHAUSTED_MAX_AGE_S / 86400:.0f} days, is not believed")
    attempts = []
    for i, a in enumerate(entry.attempts[:self._max_attempts], start=1):
      tried = self.options.trusted(plan_lib.Plan.from_dict(a.get("plan")), nargs=nargs,
                                   source=source)
      if a.get("outcome") != "oom":
        raise ValueError("an exhaustion whose attempts did not all fail")
      attempts.append({"number": i, "plan": tried.to_dict(), "described": tried.describe(),
                       "outcome": "oom", "seconds": 0.0, "signature": "", "skipped": []})
    if not attempts:
      raise ValueError("an exhaustion with no attempts")
    return dataclasses.replace(entry, plan=plan, attempts=tuple(attempts))

  def _exhausted_from_cache(self, cache_key: str, cached):
    """A retry after exhaustion does not climb again: same program, same answer. Unless
    asked to: the error says how old the answer is and what it covers."""
    path = self._cache.path(cache_key)
    data = report_lib.build(
        function=self._name, status="exhausted", attempts=list(cached.attempts),
        final_plan=None, target=self._target.name if self._target else None,
        capacity_bytes=self._capacity, max_class=self._max_class,
        ladder=[r.to_dict() for r in self._rungs],
        note=f"from the plan cache {path}: no compile was made")
    written = self._report.write(data)
    age = cached.age_seconds() or 0.0
    raise errors.LadderExhaustedError(
        f"hbm_guard: no plan fits {self._name}: the plan cache remembers, from "
        f"{age / 3600:.1f} h ago, {len(cached.attempts)} compile(s) of this program for "
        f"{self._cache_parts.get('where')} that all failed (last: {cached.plan.describe()}), "
        "under the same capacity, ladder, max_class, compiler flags (XLA_FLAGS, "
        "LIBTPU_INIT_ARGS, jax config) and versions; nothing was compiled. To climb again: "
        "plan_cache_retry_exhausted=True (--hbm_guard_plan_cache_retry_exhausted), or "
        f"`hbm-guard cache clear {self._cache.directory}`. "
        + (f"Report: {self._report.path}" if written else "The report could not be written."),
        report_path=self._report.path)

  def _record(self, attempt: climb_lib.Attempt):
    """Every attempt is in the report before it is in the log: a kill loses neither."""
    self.attempts.append(attempt)
    if attempt.outcome != "fits":
      self._write_report("climbing")
    need = attempt.record.required_bytes if attempt.record else (attempt.memory or {}).get("peak")
    logging.info("hbm_guard: %s attempt #%d [%s] %s: %s%s in %.1f s", self._name,
                 attempt.number, attempt.signature, attempt.plan.describe(), attempt.outcome,
                 f", needs {diagnose_lib.format_bytes(need)}" if need else "",
                 attempt.seconds)

  def _fail(self, result: climb_lib.Result):
    trial, attempts = result.last, result.attempts
    diag = attempts[-1].diagnosis
    rec = trial.record
    fmt = diagnose_lib.format_bytes
    status = "diagnosed" if result.status is climb_lib.Status.DIAGNOSED else "exhausted"
    above = self._above_class() if result.status is climb_lib.Status.EXHAUSTED else None
    written = self._write_report(status, above)
    where = (f"Report: {self._report.path}" if written else "The report could not be written.")
    if result.status is climb_lib.Status.DIAGNOSED:
      logging.error("hbm_guard: %s does not fit (%s); auto fallback is off. %s", self._name,
                    diag.summary, where)
      if trial.error is not None:
        raise trial.error  # the compiler's own error, unchanged
      raise errors.CapacityExceededError(
          f"hbm_guard: {self._name} needs {fmt(rec.required_bytes)} of "
          f"{fmt(rec.available_bytes)} ({diag.scenario}: {diag.summary}); auto fallback is "
          f"off, so nothing was changed. {where}", report_path=self._report.path,
          attempts=attempts)
    tried = "; ".join(a.plan.describe() for a in attempts)
    if above:
      where = (f"Allowing max_class='{above['class']}' would fit: {above['plan']} (predicted "
               f"{fmt(above['predicted_bytes'])}). " + where)
    err = errors.LadderExhaustedError(
        f"hbm_guard: no plan fits {self._name} in {fmt(rec.available_bytes)} after "
        f"{len(attempts)} compile(s) (tried: {tried}); the last needed "
        f"{fmt(rec.required_bytes)} ({diag.scenario}: {diag.summary}) {where}",
        report_path=self._report.path, attempts=attempts)
    raise err from trial.error

  def _write_report(self, status: str, above_class: dict[str, Any] | None = None) -> bool:
    data = report_lib.build(
        function=self._name, status=status, attempts=[a.to_dict() for a in self.attempts],
        final_plan=self._plan.to_dict() if status == "fits" else None,
        target=self._target.name if self._target else None, capacity_bytes=self._capacity,
        max_class=self._max_class, ladder=[r.to_dict() for r in self._rungs],
        above_class=above_class)
    return self._report.write(data)

  # -- calling --------------------------------------------------------------------------

  @_api_boundary
  def __call__(self, *args, **kwargs):
    if self._many_plans:  # signatures live on several jits: dispatch on the signature
      key = self._key(args, kwargs)
      entry = self._by_signature.get(key)
      if entry is not None:
        return entry(args, kwargs)
    else:
      try:
        return self._hot(args, kwargs)
      except _NewSignature as e:
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

  def fit(self, *args, **kwargs) -> plan_lib.Plan:
    """Finds (and installs) the plan that fits these arguments, without running the step."""
    key = self._key(args, kwargs)
    entry = self._by_signature.get(key) or self._fit(key, args, kwargs)
    return entry.plan if self._target is None else self._plan

  def _any_jit(self):
    return self._jit(self._local(self._plan), None, 0, None, {})

  def trace(self, *args, **kwargs):
    return self._any_jit().trace(*args, **kwargs)

  def lower(self, *args, **kwargs):
    """Lowers under the plan in force (like jax.jit(...).lower); call fit() first to climb."""
    return self._any_jit().lower(*args, **kwargs)

  def eval_shape(self, *args, **kwargs):
    return jax.eval_shape(self._any_jit(), *args, **kwargs)


class _Bound:
  """A GuardedFunction bound to an instance, as a method."""

  def __init__(self, guarded: GuardedFunction, instance):
    self._guarded, self._instance = guarded, instance
    functools.update_wrapper(self, guarded._fun)  # pylint: disable=protected-access

  def __call__(self, *args, **kwargs):
    return self._guarded(self._instance, *args, **kwargs)

  def fit(self, *args, **kwargs):
    return self._guarded.fit(self._instance, *args, **kwargs)

  def lower(self, *args, **kwargs):
    return self._guarded.lower(self._instance, *args, **kwargs)

  def __getattr__(self, name):
    return getattr(self._guarded, name)


def guarded_jit(fun: Callable | None = None, /, *, capacity: int | str | None = None,
                target: str | None = None, max_class: str = "exact", max_attempts: int = 8,
                ladder: str | Sequence[Any] | None = None,
                state_argnums: int | Sequence[int] = (), report_dir: str | None = None,
                auto_fallback: bool = True,
                plan_cache: str | os.PathLike | bool | None = None,
                plan: plan_lib.Plan | dict | str | None = None, search: str = "probes",
                headroom: float = ladder_lib.HEADROOM,
                plan_cache_retry_exhausted: bool = False,
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
      structure), which the guard may donate and shard. Never inferred: the caller may
      still hold an argument the guard cannot see.
    report_dir: where the post-mortem JSON goes (default $HBM_GUARD_REPORT_DIR or
      ./hbm_guard_reports); written atomically after every attempt.
    auto_fallback: False: diagnose and report, change nothing, and raise (the compiler's
      own error, or CapacityExceededError for `capacity=`). A bool, nothing else.
    plan_cache: a directory remembering the plan that fit each program and input
      signature, so a restarted job compiles once and fails none; True/None: $HBM_GUARD_PLAN_CACHE,
      else ~/.cache/hbm_guard/plans; False (or "off"): no cache.
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
    options: a `GuardOptions` holding all of the above; keyword arguments given as well
      replace its fields.
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
  if options is not None:  # only what differs from guarded_jit's defaults overrides it
    defaults = dict(capacity=None, target=None, max_class="exact", max_attempts=8,
                    ladder=None, state_argnums=(), report_dir=None, auto_fallback=True,
                    plan_cache=None, plan=None, search="probes", headroom=ladder_lib.HEADROOM,
                    plan_cache_retry_exhausted=False)
    given = {k: v for k, v in given.items() if k not in defaults or v is not defaults[k]
             and v != defaults[k]}
  if fun is None:
    return functools.partial(guarded_jit, options=options, **given)
  if options is None:
    return GuardedFunction(fun, options_lib.make(**given))
  return GuardedFunction(fun, options, **given)
