"""guarded_jit: `jax.jit` that climbs a fallback ladder when the step does not fit.

A call goes straight to a `jax.jit` object (jax's C++ fast path). Only when jax traces a
new input signature does the guard step in: the traced function raises `_NewSignature`
before anything is compiled, the guard compiles the step plan by plan until one fits,
and installs a fresh jit object for that plan whose compiled executable the next call
reuses. (A fresh object and closure, because a jit whose first trace raised loses its
fast path for good.)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from hbm_guard._src import diagnose as diagnose_lib
from hbm_guard._src import errors
from hbm_guard._src import ladder as ladder_lib
from hbm_guard._src import plan as plan_lib
from hbm_guard._src import record as record_lib
from hbm_guard._src import report as report_lib
from hbm_guard._src import targets as targets_lib

log = logging.getLogger("hbm_guard")
MiB = 1 << 20

try:  # Hide hbm_guard's frames from user tracebacks, as jax hides its own (equinox does too).
  from jax._src import traceback_util  # pylint: disable=g-import-not-at-top
  traceback_util.register_exclusion(os.path.dirname(os.path.abspath(__file__)))
  _api_boundary = traceback_util.api_boundary
except (ImportError, AttributeError):  # a private API: without it, tracebacks are longer
  def _api_boundary(fun):
    return fun


class _NewSignature(Exception):
  """Raised at trace time for an input signature the guard has not fitted yet."""

  def __init__(self, key):
    super().__init__("hbm_guard: new input signature")
    self.key = key


@dataclasses.dataclass(frozen=True)
class Attempt:
  """One compile of the step under one plan, and what the compiler said."""
  number: int
  plan: plan_lib.Plan
  outcome: str  # "fits" | "oom"
  seconds: float
  record: record_lib.E1000Record | None = None
  diagnosis: diagnose_lib.Diagnosis | None = None
  memory: dict[str, int] | None = None  # from compiled.memory_analysis()
  skipped: tuple[ladder_lib.Skip, ...] = ()  # rungs passed over to choose the next plan

  def to_dict(self) -> dict[str, Any]:
    return {
        "number": self.number, "plan": self.plan.to_dict(), "described": self.plan.describe(),
        "outcome": self.outcome, "seconds": round(self.seconds, 3),
        "record": self.record.to_dict() if self.record else None,
        "diagnosis": self.diagnosis.to_dict() if self.diagnosis else None,
        "memory": self.memory,
        "skipped": [dataclasses.asdict(s) for s in self.skipped],
    }


def memory_of(compiled) -> dict[str, int] | None:
  """The compiler's own figures for a compiled step, with the peak they add up to."""
  try:
    ma = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except  (not every backend implements it)
    return None
  if ma is None:
    return None
  m = {k: int(getattr(ma, k + "_size_in_bytes", 0) or 0)
       for k in ("argument", "output", "alias", "temp", "generated_code")}
  m["peak"] = m["argument"] + m["output"] - m["alias"] + m["temp"] + m["generated_code"]
  for k in ("argument", "output", "temp"):  # host memory (offloaded), not in the peak
    m["host_" + k] = int(getattr(ma, f"host_{k}_size_in_bytes", 0) or 0)
  return m


def budget_record(memory: dict[str, int], capacity: int, module: str) -> record_lib.E1000Record:
  """A memory_analysis() above the capacity, as a record the ladder reads like E1000's."""
  return record_lib.E1000Record(
      kind=record_lib.BUDGET, memory_space="hbm", used_bytes=memory["peak"],
      capacity_bytes=capacity, exceeded_bytes=memory["peak"] - capacity,
      temp_bytes=memory["temp"], hlo_module=module,
      breakdown={"arguments": memory["argument"], "output": memory["output"],
                 "output aliased": memory["alias"], "HLO temp": memory["temp"],
                 "code": memory["generated_code"]},
      raw=(f"hbm_guard: peak {memory['peak']} bytes (arguments + outputs - aliased + "
           f"temporaries + code) exceeds capacity {capacity} bytes"))


def _leaf_key(x):
  aval = getattr(x, "aval", None)
  if aval is not None:
    return (tuple(aval.shape), str(aval.dtype), bool(getattr(aval, "weak_type", False)))
  try:
    hash(x)
    return ("static", type(x).__name__, x)
  except TypeError:
    return ("unhashable", type(x).__name__, id(x))


def _signature(args, kwargs):
  leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
  return (treedef, tuple(_leaf_key(x) for x in leaves))


def _avals_equal(a, b) -> bool:
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  return ta == tb and all(_leaf_key(x)[:2] == _leaf_key(y)[:2] for x, y in zip(la, lb))


def _replaced(args, out, state_argnums) -> tuple[tuple[int, int | None], ...]:
  """State arguments the step returns anew with the same structure: safe to donate.

  Returns (argnum, output index) pairs; the index is None when the whole output is it.
  """
  found = []
  for i in state_argnums:
    if i >= len(args):
      continue
    if _avals_equal(args[i], out):
      found.append((i, None))
    elif isinstance(out, (tuple, list)):
      j = next((j for j, o in enumerate(out) if _avals_equal(args[i], o)), None)
      if j is not None:
        found.append((i, j))
  return tuple(found)


def default_offload_filter(path: str) -> bool:
  """Which state leaves are optimizer state, by their key path (flax TrainState, optax)."""
  return "opt_state" in path


def _nbytes(tree) -> int:
  return sum(int(np.prod(np.shape(x))) * np.dtype(getattr(x, "dtype", np.float32)).itemsize
             for x in jax.tree_util.tree_leaves(tree))


def _fsdp_spec(shape, n: int) -> P:
  """Shard the largest dimension divisible by n over the 'fsdp' axis; else replicate."""
  dims = sorted(range(len(shape)), key=lambda d: -shape[d])
  for d in dims:
    if shape[d] >= n and shape[d] % n == 0:
      spec = [None] * len(shape)
      spec[d] = "fsdp"
      return P(*spec)
  return P()


class GuardedFunction:
  """A jitted step that recompiles down the ladder when it does not fit. See guarded_jit."""

  def __init__(self, fun: Callable, *, capacity=None, target=None, max_class="exact",
               max_attempts=8, ladder=None, state_argnums=(), report_dir=None,
               auto_fallback=True, offload_filter=default_offload_filter, **jit_kwargs):
    if max_class not in ladder_lib.CLASSES:
      raise ValueError(f"max_class must be one of {ladder_lib.CLASSES}, not {max_class!r}")
    functools.update_wrapper(self, fun)
    self._fun = fun
    self._target = targets_lib.Target.parse(target) if isinstance(target, str) else target
    self._capacity = targets_lib.parse_capacity(capacity)
    if self._capacity is None and self._target is not None:
      self._capacity = self._target.hbm_bytes
    self._max_class = max_class
    self._max_attempts = int(max_attempts)
    self._rungs = ladder_lib.load_ladder(ladder)
    self._state_argnums = ((state_argnums,) if isinstance(state_argnums, int)
                           else tuple(state_argnums))
    self._offload_filter = offload_filter
    self._replaced: tuple[tuple[int, int | None], ...] = ()  # learnt at the first trace
    self._layout: dict[int, Any] | None = None  # planned shardings of state arguments
    self._n_outputs: int | None = None
    self._report_dir = report_dir
    self._auto_fallback = auto_fallback
    user_donate = jit_kwargs.pop("donate_argnums", None) or ()
    self._user_donate = (user_donate,) if isinstance(user_donate, int) else tuple(user_donate)
    self._jit_kwargs = dict(jit_kwargs)  # donation is merged per plan in _make_jit
    self.plan = plan_lib.Plan()
    self.attempts: list[Attempt] = []
    self.report_path: str | None = None
    self._verified: set = set()
    self._last_scope: plan_lib._Scope | None = None
    self._jitted = self._make_jit(self.plan)

  # -- building -------------------------------------------------------------------------

  def _closure(self, plan: plan_lib.Plan, strict: bool):
    fun, verified = self._fun, self._verified
    state_argnums = self._state_argnums

    @functools.wraps(fun)
    def traced(*args, **kwargs):
      key = _signature(args, kwargs)
      if strict and key not in verified:
        raise _NewSignature(key)
      with plan_lib.plan_scope(plan) as scope:
        out = fun(*args, **kwargs)
      scope.facts["replaced"] = _replaced(args, out, state_argnums)
      scope.facts["n_outputs"] = len(out) if isinstance(out, (tuple, list)) else None
      scope.facts["signature"] = key
      self._last_scope = scope
      return out

    return traced

  def _local_plan(self, plan: plan_lib.Plan) -> plan_lib.Plan:
    """The plan as the local backend can run it (TPU flags only on TPU)."""
    if jax.default_backend() != "tpu" and plan.compiler_options:
      plan = dataclasses.replace(plan, compiler_options=())
    return plan

  def _make_jit(self, plan: plan_lib.Plan, *, strict: bool = True,
                layout: dict[int, Any] | None = None, nargs: int = 0):
    kw = dict(self._jit_kwargs)
    donate = tuple(sorted(set(self._user_donate) | set(plan.donate_argnums)))
    if donate:
      kw["donate_argnums"] = donate
    if plan.compiler_options:  # TPU flags; a target's plan runs locally via _local_plan
      kw["compiler_options"] = dict(plan.compiler_options)
    if layout:
      static = set(self._static_argnums(nargs))
      kw["in_shardings"] = tuple(layout.get(i) for i in range(nargs) if i not in static)
      kw["out_shardings"] = self._out_shardings(layout)
    return jax.jit(self._closure(plan, strict), **kw)

  def _out_shardings(self, layout):
    whole = [i for i, j in self._replaced if j is None and i in layout]
    if whole:
      return layout[whole[0]]
    n_out = self._n_outputs or 0
    by_out = {j: layout[i] for i, j in self._replaced if i in layout}
    return tuple(by_out.get(j) for j in range(n_out))

  def _plan_layout(self, plan: plan_lib.Plan, args, devices=None) -> dict[int, Any] | None:
    """Shardings for the state arguments under `plan`: FSDP, host offload, or None."""
    if not (plan.shard_state or plan.offload_optimizer) or not self._replaced:
      return None
    if devices is None:
      devices = self._target.devices() if self._target is not None else jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
    n = len(devices) if plan.shard_state else 1

    def leaf(path, x):
      host = plan.offload_optimizer and self._offload_filter(jax.tree_util.keystr(path))
      spec = _fsdp_spec(np.shape(x), n) if plan.shard_state else P()
      return NamedSharding(mesh, spec, memory_kind="pinned_host" if host else "device")

    return {i: jax.tree_util.tree_map_with_path(leaf, args[i]) for i, _ in self._replaced}

  def _abstract_args(self, args, kwargs, layout):
    """Arguments to lower with: state as planned; on a target, the rest replicated there."""
    static = set(self._static_argnums(len(args)))
    static_names = set(self._jit_kwargs.get("static_argnames") or ())
    mesh = None
    if self._target is not None:
      mesh = jax.sharding.Mesh(np.array(self._target.devices()), ("fsdp",))

    def abstract(x, sharding):
      scalar = not hasattr(x, "dtype")  # a Python scalar traces weakly typed, as under jit
      weak = scalar or bool(getattr(x, "weak_type", False))
      return jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype if scalar else x.dtype,
                                  sharding=sharding, weak_type=weak)

    def other(x):
      return abstract(x, NamedSharding(mesh, P())) if mesh is not None else x

    out = []
    for i, a in enumerate(args):
      if i in static:
        out.append(a)
      elif layout and i in layout:
        out.append(jax.tree.map(abstract, a, layout[i]))
      else:
        out.append(jax.tree.map(other, a))
    kw = {k: (v if k in static_names else jax.tree.map(other, v)) for k, v in kwargs.items()}
    return tuple(out), kw

  def _place(self, args):
    """Moves the caller's state arguments to the planned layout (a no-op once there)."""
    if not self._layout:
      return args
    args = list(args)
    for i, sharding in self._layout.items():
      args[i] = jax.device_put(args[i], sharding)
    return tuple(args)

  def _static_argnums(self, nargs):
    s = self._jit_kwargs.get("static_argnums") or ()
    s = (s,) if isinstance(s, int) else tuple(s)
    return tuple(i % nargs for i in s) if nargs else ()

  # -- compiling ------------------------------------------------------------------------

  def _compile(self, plan: plan_lib.Plan, args, kwargs):
    """Compiles under `plan`: (jit object for local calls or None, memory, scope, layout)."""
    layout = self._plan_layout(plan, args)
    if self._target is not None:
      jitted = self._make_jit(plan, strict=False, layout=layout, nargs=len(args))
      targs, tkw = self._abstract_args(args, kwargs, layout)
      options = dict(plan.compiler_options)
      if self._capacity is not None:
        options["xla_tpu_max_hbm_size_mib"] = max(1, self._capacity // MiB)
      compiled = jitted.lower(*targs, **tkw).compile(options)
      return None, memory_of(compiled), self._last_scope, layout
    jitted = self._make_jit(plan, layout=layout, nargs=len(args))
    largs, lkw = self._abstract_args(args, kwargs, layout) if layout else (args, kwargs)
    compiled = jitted.lower(*largs, **lkw).compile()
    return jitted, memory_of(compiled), self._last_scope, layout

  def _facts(self, scope, args) -> ladder_lib.StepFacts:
    if self._target is not None:
      platform, ndev = "tpu", len(self._target.devices())
    else:
      platform, ndev = jax.default_backend(), jax.device_count()
    replaced = tuple(i for i, _ in (scope.facts.get("replaced", ()) if scope else ()))
    state_bytes = sum(_nbytes(args[i]) for i in replaced)
    offload_bytes = 0
    for i in replaced:
      for path, leaf in jax.tree_util.tree_flatten_with_path(args[i])[0]:
        if self._offload_filter(jax.tree_util.keystr(path)):
          offload_bytes += _nbytes(leaf)
    has_host = False
    try:
      dev = (self._target.devices()[0] if self._target else jax.devices()[0])
      has_host = any(getattr(m, "kind", "") == "pinned_host"
                     for m in dev.addressable_memories())
    except Exception:  # pylint: disable=broad-except
      pass
    return ladder_lib.StepFacts(
        platform=platform, num_devices=ndev,
        plan_reads=frozenset(scope.reads if scope else ()),
        state_argnums=replaced, state_bytes=state_bytes,
        batch_size=(scope.facts.get("batch_size") if scope else None),
        offload_bytes=offload_bytes,
        has_host_memory=has_host,
        can_reshard="in_shardings" not in self._jit_kwargs)

  def _fit(self, key, args, kwargs):
    """Climbs the ladder for one input signature; installs the plan that fits."""
    plan = self.plan
    name = getattr(self._fun, "__name__", "step")
    started = len(self.attempts)
    last_error = None
    while True:
      number = len(self.attempts) + 1
      self._verified.add(key)
      self._last_scope = None
      t0 = time.perf_counter()
      try:
        jitted, memory, scope, layout = self._compile(plan, args, kwargs)
        rec = None
        if (memory is not None and self._capacity is not None
            and memory["peak"] > self._capacity):
          rec = budget_record(memory, self._capacity, f"jit_{name}")
      except jax.errors.JaxRuntimeError as e:
        self._verified.discard(key)
        rec = record_lib.parse(e)
        if rec is None or not rec.is_compile_time or not self._auto_fallback:
          if rec is not None:
            self._write_report(name, "failed", note=str(rec.kind))
          raise
        jitted, memory, scope, layout, last_error = None, None, self._last_scope, None, e
      except Exception:
        self._verified.discard(key)
        raise
      seconds = time.perf_counter() - t0
      if scope is not None and not self._replaced:
        self._replaced = scope.facts.get("replaced", ())
        self._n_outputs = scope.facts.get("n_outputs")
      if rec is None:  # fits
        self.attempts.append(Attempt(number, plan, "fits", seconds, memory=memory))
        break
      self._verified.discard(key)
      diag = diagnose_lib.diagnose(rec)
      facts = self._facts(scope, args)
      history = [(a.plan, a.record.required_bytes) for a in self.attempts[started:]
                 if a.record is not None]
      nxt, skips = ladder_lib.next_plan(
          self._rungs, plan, facts, rec, self._max_class,
          temp_bytes=(memory or {}).get("temp") or rec.temp_bytes, history=history)
      self.attempts.append(Attempt(number, plan, "oom", seconds, rec, diag, memory,
                                   tuple(skips)))
      log.warning("hbm_guard: %s does not fit under plan %r (%s); %s", name, plan.describe(),
                  diag.summary, f"next: {nxt.describe()}" if nxt else "ladder exhausted")
      self._write_report(name, "climbing")
      if nxt is None or len(self.attempts) - started >= self._max_attempts:
        self._write_report(name, "exhausted")
        tried = "; ".join(a.plan.describe() for a in self.attempts[started:])
        need = rec.required_bytes
        msg = (f"hbm_guard: no plan fits {name} in "
               f"{diagnose_lib.format_bytes(rec.available_bytes)} after "
               f"{len(self.attempts) - started} compiles (tried: {tried}); the last needed "
               f"{diagnose_lib.format_bytes(need)} ({diag.scenario}: {diag.summary}) "
               f"Report: {self.report_path}")
        err = errors.LadderExhaustedError(msg, report_path=self.report_path,
                                          attempts=self.attempts[started:])
        if last_error is not None:
          raise err from last_error
        raise err
      plan = nxt

    if self._target is not None:  # fits the target: now build it for the local backend
      local = self._local_plan(plan)
      layout = self._plan_layout(local, args, devices=jax.devices())
      jitted = self._make_jit(local, layout=layout, nargs=len(args))
    self._sync_across_hosts(plan)
    self.plan = plan
    self._jitted = jitted
    self._layout = layout
    if len(self.attempts) - started > 1:
      log.warning("hbm_guard: %s fits with plan %r after %d compiles", name, plan.describe(),
                  len(self.attempts) - started)
      self._write_report(name, "fits")

  def _sync_across_hosts(self, plan: plan_lib.Plan):
    if jax.process_count() == 1:
      return
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    digest = hashlib.sha256(json.dumps(plan.to_dict(), sort_keys=True).encode()).digest()
    multihost_utils.assert_equal(np.frombuffer(digest[:8], dtype=np.int64),
                                 "hbm_guard: processes chose different plans")

  def _write_report(self, name: str, status: str, note: str | None = None):
    directory = self._report_dir or os.environ.get("HBM_GUARD_REPORT_DIR") or "hbm_guard_reports"
    if self.report_path is None:
      self.report_path = os.path.abspath(
          os.path.join(directory, f"{name}-{os.getpid()}-{id(self):x}.json"))
    data = report_lib.build(
        function=name, status=status, attempts=[a.to_dict() for a in self.attempts],
        final_plan=self.plan.to_dict() if status == "fits" else None,
        target=self._target.name if self._target else None, capacity_bytes=self._capacity,
        max_class=self._max_class, ladder=[r.to_dict() for r in self._rungs], note=note)
    try:
      report_lib.write_atomic(self.report_path, data)
    except OSError as e:  # a report must never replace the error the user needs to see
      log.error("hbm_guard: could not write report %s: %s", self.report_path, e)

  # -- calling --------------------------------------------------------------------------

  @_api_boundary
  def __call__(self, *args, **kwargs):
    try:
      return self._jitted(*args, **kwargs)
    except _NewSignature as e:
      key = e.key
    except ValueError:
      # State the caller holds in another layout than the plan's (sharded, on host): move
      # it once; the step returns it in the planned layout, so later calls are direct.
      if not self._layout:
        raise
      return self._jitted(*self._place(args), **kwargs)
    self._fit(key, args, kwargs)
    return self._jitted(*self._place(args), **kwargs)

  def fit(self, *args, **kwargs) -> plan_lib.Plan:
    """Finds (and installs) the plan that fits these arguments, without running the step."""
    self._last_scope = None
    self._make_jit(self._local_plan(self.plan), strict=False).trace(*args, **kwargs)
    key = self._last_scope.facts["signature"]
    if key not in self._verified:
      self._fit(key, args, kwargs)
    return self.plan

  def lower(self, *args, **kwargs):
    """Lowers under the plan in force (like jax.jit(...).lower); call fit() first to climb."""
    return self._make_jit(self._local_plan(self.plan), strict=False).lower(
        *args, **kwargs)

  def eval_shape(self, *args, **kwargs):
    return jax.eval_shape(self._make_jit(self._local_plan(self.plan), strict=False),
                          *args, **kwargs)


def guarded_jit(fun: Callable | None = None, /, *, capacity: int | str | None = None,
                target: str | None = None, max_class: str = "exact", max_attempts: int = 8,
                ladder: str | Sequence[Any] | None = None,
                state_argnums: int | Sequence[int] = (), report_dir: str | None = None,
                auto_fallback: bool = True, **jit_kwargs):
  """`jax.jit` that recompiles down a fallback ladder until the step fits in memory.

  Args:
    fun: the step. Usable as `@guarded_jit` or `@guarded_jit(...)`.
    capacity: bytes, "16GiB", or a device name ("v5e"): peak memory from
      `memory_analysis()` above it counts as an out-of-memory (kind "budget"), on any
      backend.
    target: a TPU topology ("v5e:2x2"): climb against libtpu's compiler for it, then run
      locally with the plan that fits the target.
    max_class: the highest rung class allowed: "exact", "numerics" or "behaviour".
    max_attempts: most compiles per input signature.
    ladder: a ladder JSON path or list of rungs; default `configs/ladder.json`.
    state_argnums: arguments the step replaces (state in, state out with the same
      structure), which the guard may donate and shard. Never inferred: the caller may
      still hold an argument the guard cannot see.
    report_dir: where the post-mortem JSON goes (default $HBM_GUARD_REPORT_DIR or
      ./hbm_guard_reports); written atomically after every attempt.
    auto_fallback: False: diagnose and report, but re-raise the compiler's error as is.
    **jit_kwargs: passed to `jax.jit` (static_argnums, donate_argnums, in_shardings, ...).

  Example:
    step = hbm_guard.guarded_jit(train_step, state_argnums=0, target="v5e:2x2")
    state, metrics = step(state, batch)
    step.plan, step.attempts
  """
  options = dict(capacity=capacity, target=target, max_class=max_class,
                 max_attempts=max_attempts, ladder=ladder, state_argnums=state_argnums,
                 report_dir=report_dir, auto_fallback=auto_fallback, **jit_kwargs)
  if fun is None:
    return functools.partial(guarded_jit, **options)
  return GuardedFunction(fun, **options)
