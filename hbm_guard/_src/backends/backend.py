"""Where a plan is compiled: here (`LocalBackend`) or for a TPU topology (`TargetBackend`).

The one place where the two differ. Chosen once per guarded step (as chex chooses a
variant): the devices a plan is laid out over, what a device holds, how one compile (or a
cheap probe) runs and what its figure means, and what names the place in the cache key.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
import time
from typing import Any, Callable, Protocol

import jax
from jax._src import core as jax_core

from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.backends import options as options_lib
from hbm_guard._src.backends import steps as steps_lib
from hbm_guard._src.backends import targets as targets_lib
from hbm_guard._src.memory import memory_dump
from hbm_guard._src.plans import layout as layout_lib
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.plans import rungs as rungs_lib
from hbm_guard._src.plans import thread_context
from hbm_guard._src.plans import user_shardings
from hbm_guard._src.search import tuning
from hbm_guard._src.search.state import program

MiB = 1 << 20
# jax's error for a program its sharding types refuse (not public; every jax we support has it)
_SHARDING_TYPE_ERROR = getattr(jax_core, "ShardingTypeError", TypeError)
PROBE_LIMIT_MIB = 1  # libtpu's early check fails a compile given this limit in seconds
# A probe of a plan without XLA flags compiles at XLA's lowest optimisation effort: at 368M
# parameters on v5e:1x1 it took 37.2 s against 52.8 (microbatch 16) and 27.5 against 38.1
# (microbatch 2), reading 8.17 / 21.86 GiB against 8.80 / 21.06: the same count predicted.
# Used where probes are dear (small programs read less steadily at O0: 192 against 128 MiB),
# and not for plans with flags, which are tuned against the default level.
PROBE_OPTIONS = (("optimization_level", "O0"),)
# Where probes are dear, they get a quarter of the capacity as their limit, not 1 MiB: XLA's
# rematerialization then gives up sooner, and the figure is the same. At 368M on v5e:1x1
# (O0, microbatch 2): 21.86 GiB either way, 19.0 s against 25.2; the plain step, 17.69 GiB
# either way, 9.9 s against 39.4. A plan that fits in the quarter compiles whole, and its
# peak is its figure.
DEAR_PROBE_LIMIT_FRACTION = 0.25
# Low effort is for real sizes only: on a step failing at 43 MiB, O0 read 120 MiB where the
# default effort read 40 (and 108 against 36 for its offload plan), and a first compile in
# a process can be slow enough to look dear.
LOW_EFFORT_MIN_CAPACITY = 1 << 30


class Meanwhile(Protocol):
  """Work beside a compile (prepare.Preparation): started with the trace's facts as the
  compile begins, stopped as it ends."""

  def start(self, facts: compile_lib.TraceFacts | None, started: float) -> None: ...

  def stop(self) -> None: ...


class Backend(Protocol):
  """Where a fit compiles. Every capability the fit uses is declared here: `stages` says
  whether the staging methods (lowering apart from compiling, probes and compiles run
  beside each other) do anything; where it is false they are never called."""
  platform: str
  probe_scale: float  # real need / probe figure, before any real compile measured it
  exact_probes: bool  # a probe's figure is the very figure held against the capacity
  stages: bool
  runs_here: bool  # the executables compiled are the ones the step runs (not a target's)

  def devices(self) -> list[Any]: ...

  def capacity(self, args) -> int | None: ...

  def where(self) -> str: ...

  def runnable(self, plan: plan_lib.Plan) -> plan_lib.Plan: ...

  def compile(self, plan: plan_lib.Plan, key, args, kwargs, *, probe: bool = False,
              low_effort: bool = False, meanwhile: Meanwhile | None = None
              ) -> compile_lib.Trial: ...

  def step_facts(self, args, kwargs, trial: compile_lib.Trial) -> rungs_lib.StepFacts: ...

  def program_text(self, plan: plan_lib.Plan, key, args, kwargs) -> str | None: ...

  def stage(self, plan: plan_lib.Plan, key, args, kwargs) -> None: ...

  def stage_ahead(self, plan: plan_lib.Plan, key, args, kwargs) -> None: ...

  def unstage(self) -> None: ...

  def staged_probe(self, plan: plan_lib.Plan, key, args, kwargs, low_effort: bool = False
                   ) -> Callable[[], compile_lib.Trial]: ...

  def staged_compile(self, plan: plan_lib.Plan, key, args, kwargs
                     ) -> Callable[[], compile_lib.Trial]: ...


class _Base:
  """What both backends share: the step, the options, and the facts a trial gives."""
  platform = ""
  probe_scale = 1.0
  exact_probes = True
  stages = False  # compiles whole, one at a time: the staging methods are not called
  runs_here = True

  def __init__(self, step: steps_lib.StepBuilder, options: options_lib.GuardOptions):
    self.step, self.options = step, options
    self._refused: dict[Any, str | None] = {}  # (signature, state) -> why reshard is refused
    self._refusing = threading.Lock()  # the preparation thread asks too, while a compile runs
    self._dumped = False  # (runs_here: the one failure compiled again for its breakdown)

  def devices(self) -> list[Any]:
    raise NotImplementedError

  def program_text(self, plan, key, args, kwargs) -> str | None:
    """The program a plan lowers to where it differs from the step's own; None here."""
    del plan, key, args, kwargs
    return None

  def unstage(self) -> None:
    """Nothing staged."""

  def stage(self, plan, key, args, kwargs) -> None:
    raise NotImplementedError("this backend does not stage")

  stage_ahead = staged_compile = stage

  def staged_probe(self, plan, key, args, kwargs, low_effort=False):
    raise NotImplementedError("this backend does not stage")

  def runnable(self, plan: plan_lib.Plan) -> plan_lib.Plan:
    """The plan as this host runs it (after a target's fit too): TPU flags only on a TPU."""
    if jax.default_backend() != "tpu" and plan.compiler_options:
      plan = dataclasses.replace(plan, compiler_options=())
    return plan

  def step_facts(self, args, kwargs, trial: compile_lib.Trial) -> rungs_lib.StepFacts:
    devices = self.devices()
    tf = trial.facts or compile_lib.TraceFacts()
    given = user_shardings.per_leaf(self.options.jit_kwargs, args, self.step.static(len(args)))
    replaced = tuple(i for i, _ in tf.replaced)
    self.step.learn(trial.facts)  # the refusal's trace shards that state (asked before a compile)
    try:
      has_host = any(getattr(m, "kind", "") == "pinned_host"
                     for m in devices[0].addressable_memories())
    except Exception:  # pylint: disable=broad-except
      has_host = False
    return rungs_lib.StepFacts(
        platform=self.platform, num_devices=len(devices), plan_reads=tf.reads,
        state_argnums=replaced, state_bytes=sum(layout_lib.nbytes(args[i]) for i in replaced),
        batch_size=tf.batch_size, has_host_memory=has_host,
        can_reshard=user_shardings.extendable(self.options.jit_kwargs),
        reshard_refused=self._reshard_refused(args, kwargs, given),
        user_layout=bool(given),
        offload_bytes=sum(layout_lib.offload_bytes(args[i], self.options.offload_filter)
                          for i in replaced),
        auto_refused=tf.auto_refused, gradient_seen=tf.auto is not None)

  def _reshard_refused(self, args, kwargs, given) -> str | None:
    """Why the step's own types refuse its state sharded further, or None. Under Explicit
    axes a step type-checks against its inputs' shardings (`given`): traced once to see."""
    if not user_shardings.explicit(given):
      return None
    # what the trace shards is the state the step returns anew: an answer made before
    # that was known (it shards nothing) is not the answer once it is
    key = (self.step.key(args, kwargs), tuple(i for i, _ in self.step.replaced))
    with self._refusing:  # one trace per signature, and no answer before it is known
      if key not in self._refused:
        self._refused[key] = self._refusal(args, kwargs)
      return self._refused[key]

  def _refusal(self, args, kwargs) -> str | None:
    devices = self.devices()
    jitted, targs, tkw = self.step.on_devices(plan_lib.Plan(shard_state=True), args, kwargs,
                                              devices, {})
    try:
      with user_shardings.context_on(devices):
        jitted.trace(*targs, **tkw)
    except _SHARDING_TYPE_ERROR as e:
      first = str(e).splitlines()[0] if str(e) else type(e).__name__
      return (f"under Explicit mesh axes the step's types refuse its state "
              f"sharded further ({first[:200]})")
    return None

  def _trial(self, plan, compile_fn, facts_fn, capacity, placed=(), speed=None
             ) -> compile_lib.Trial:
    """`compile_fn(options)` compiled (with a dump's options where a breakdown is asked
    for), classified, and broken down from the dump."""
    with memory_dump.scope(self.options.memory_breakdown) as dump:
      # (`runs_here`: compiled as the calls will run it, a dump's options keying another;
      # the first failure, the step as written, is compiled again for its dump: no other)
      trial = compile_lib.try_compile(
          plan, lambda: compile_fn({} if self.runs_here else dump.options()), facts_fn,
          capacity=capacity, name=self.step.name, speed=speed)
      self.step.learn(trial.facts)
      layout = layout_lib.describe(placed, [i for i, _ in self.step.replaced])
      if self.runs_here and dump.directory is not None:
        if trial.outcome is not compile_lib.Outcome.OOM or self._dumped:
          return dataclasses.replace(trial, layout=layout)
        self._dumped = memory_dump.compile_again(compile_fn, dump.options())
      args = memory_dump.arguments(self.step.fun, self.options.state_argnums,
                                   plan.microbatches, len(self.devices()))
      return dataclasses.replace(trial, layout=layout, breakdown=dump.breakdown(args, trial))


class LocalBackend(_Base):
  """Compiles with this process's backend: the executable a fit compiles is the one the
  next call runs. A probe is a full compile (cheap off a TPU), so its figure is exact."""

  def __init__(self, step, options):
    super().__init__(step, options)
    self.platform = jax.default_backend()

  def devices(self) -> list[Any]:
    return jax.devices()

  def where(self) -> str:
    return f"{self.platform}:{jax.devices()[0].device_kind}x{jax.device_count()}"

  def capacity(self, args) -> int | None:
    """capacity=, else on a GPU the allocator's limit less what other live arrays hold."""
    if self.options.budget is not None or self.platform != "gpu":
      return self.options.budget
    try:
      stats = jax.local_devices()[0].memory_stats()
    except Exception:  # pylint: disable=broad-except
      return None
    return targets_lib.capacity_from_stats(stats, layout_lib.nbytes(
        [x for x in jax.tree_util.tree_leaves(args) if isinstance(x, jax.Array)]))

  def compile(self, plan, key, args, kwargs, *, probe=False, low_effort=False,
              meanwhile=None) -> compile_lib.Trial:
    del meanwhile  # nothing to prepare here: a probe is a full compile
    entry = self.step.plan_jit(self.runnable(plan), args)
    entry.allowed.add(key)
    largs, lkw = self.step.abstract(args, kwargs, entry.layout) if entry.layout else (args, kwargs)
    try:
      def compile_fn(dump_options):
        traced = entry.jitted.trace(*largs, **lkw)
        self.step.saw_traced(plan, args, kwargs, traced)
        lowered = traced.lower()
        if probe:
          compile_lib.check_split(plan, entry.facts.get(key))
        return lowered.compile(dump_options or None)
      return self._trial(plan, compile_fn, lambda: entry.facts.get(key), self.capacity(args),
                         largs)
    finally:
      entry.allowed.discard(key)  # admitted again by the guard if this plan is chosen


class TargetBackend(_Base):
  """Compiles ahead of time for a TPU topology with libtpu on this host. A probe gets a
  small limit (1 MiB; a quarter of the capacity where probes are dear): libtpu's early
  check then fails it in seconds with what the plan needs, an estimate that runs low until
  a real compile measures by how much."""
  platform = "tpu"
  probe_scale = tuning.PROBE_SCALE
  exact_probes = False
  stages = True
  runs_here = False

  def __init__(self, step, options):
    super().__init__(step, options)
    self.target = options.target
    # (program, signature) -> a lowering made ahead (prepare.py), read once by its probe
    self._staged: dict[tuple[plan_lib.Plan, Any], concurrent.futures.Future] = {}

  def devices(self) -> list[Any]:
    devices = self.target.devices()
    targets_lib.ask_ahead(self.target)  # its answer is read once a compile is done
    return devices

  def where(self) -> str:
    return f"target:{self.target.name}"

  def capacity(self, args) -> int | None:
    return self.options.budget

  def _options(self, plan, probe, low_effort
               ) -> tuple[dict[str, Any], Callable[[], int | None] | None]:
    """The compiler options a compile (or a probe) of `plan` gets, and the capacity its
    memory_analysis is held to (None: libtpu's own verdict counts the arguments)."""
    options = dict(plan.compiler_options)
    capacity = self.options.budget
    low_effort = low_effort and (capacity or 0) >= LOW_EFFORT_MIN_CAPACITY
    if probe:
      options["xla_tpu_max_hbm_size_mib"] = PROBE_LIMIT_MIB
      if low_effort:
        options["xla_tpu_max_hbm_size_mib"] = max(
            PROBE_LIMIT_MIB, int(capacity * DEAR_PROBE_LIMIT_FRACTION) // MiB)
      if (low_effort and not plan.compiler_options
          and targets_lib.accepts_options(self.target, PROBE_OPTIONS)):
        options.update(PROBE_OPTIONS)
    elif capacity is not None:
      options["xla_tpu_max_hbm_size_mib"] = max(1, capacity // MiB)
    if probe or capacity is None:
      return options, None
    # Asked once the compile is done (asked ahead as the step lowers): where libtpu's own
    # verdict at that limit counts the arguments too, it is the only check.
    counts = functools.partial(targets_lib.compiler_counts_arguments, self.target)
    return options, lambda: None if counts() else capacity

  def compile(self, plan, key, args, kwargs, *, probe=False, low_effort=False,
              meanwhile: Meanwhile | None = None) -> compile_lib.Trial:
    """One compile (or probe) of `plan`; `meanwhile` runs beside the compile itself. A
    lowering made for the plan cache's key (`program_text`) is compiled, not made again."""
    options, capacity = self._options(plan, probe, low_effort)
    staged = None if probe else self._staged.pop((program(plan), key), None)
    if staged is not None:
      return self._compile_staged(plan, key, args, kwargs, staged.result(), options,
                                  capacity, meanwhile, climb=True)
    devices, facts = self.devices(), {}
    jitted, targs, tkw = self.step.on_devices(plan, args, kwargs, devices, facts)
    def compile_fn(dump_options):
      t0 = time.perf_counter()
      with user_shardings.context_on(devices):
        traced = jitted.trace(*targs, **tkw)
        self.step.saw_traced(plan, args, kwargs, traced)
        lowered = traced.lower()
      if probe:
        compile_lib.check_split(plan, facts.get(key))
      if meanwhile is not None:
        meanwhile.start(facts.get(key), t0)
      try:
        return lowered.compile({**options, **dump_options})
      finally:
        if meanwhile is not None:
          meanwhile.stop()
    return self._trial(plan, compile_fn, lambda: facts.get(key), capacity, targs,
                       None if probe else self.target.speed)

  def _compile_staged(self, plan, key, args, kwargs, low: _Lowering, options, capacity,
                      meanwhile: Meanwhile | None = None, *, climb: bool = False,
                      probe: bool = False) -> compile_lib.Trial:
    """Compiles a lowering made earlier (its seconds count both); `meanwhile` runs beside.
    `climb`: the climb's own compile, whose trace a price may read (not a probe's, whose
    trace would replace it from the pool, perhaps after the fit). `probe`: not compiled
    where the trace did not split the batch."""
    def compile_fn(dump_options):
      if low.failed is not None:
        raise low.failed
      if probe:
        compile_lib.check_split(plan, low.facts.get(key))
      if climb:
        self.step.saw_traced(plan, args, kwargs, low.traced)
      if meanwhile is not None:
        meanwhile.start(low.facts.get(key), time.perf_counter())
      try:
        return low.lowered.compile({**options, **dump_options})
      finally:
        if meanwhile is not None:
          meanwhile.stop()
    trial = self._trial(plan, compile_fn, lambda: low.facts.get(key), capacity, low.targs,
                        None if probe else self.target.speed)
    return dataclasses.replace(trial, seconds=trial.seconds + low.seconds)

  def program_text(self, plan, key, args, kwargs) -> str | None:
    """The program of `plan` as lowered for the target (None if it does not lower): what
    the plan cache keys a fit by. The lowering is kept for the compile of that plan: at
    368M parameters a lowering took 2.3-2.6 s, paid twice before on every fit."""
    self.stage(plan, key, args, kwargs)
    low = self._staged[(program(plan), key)].result()
    if low.failed is not None:
      return None
    self.step.learn(low.facts.get(key))
    return low.lowered.as_text()

  def _lower(self, plan, args, kwargs) -> _Lowering:
    t0 = time.perf_counter()
    devices, facts = self.devices(), {}
    jitted, targs, tkw = self.step.on_devices(plan, args, kwargs, devices, facts)
    traced = None
    try:
      with user_shardings.context_on(devices):
        traced = jitted.trace(*targs, **tkw)
        lowered, failed = traced.lower(), None
    except Exception as e:  # pylint: disable=broad-except  (raised again inside the trial)
      lowered, failed = None, e
    return _Lowering(lowered, failed, facts, targs, time.perf_counter() - t0, traced)

  def stage(self, plan, key, args, kwargs) -> None:
    """Lowers a probe of `plan` now (in a thread beside another compile), to be compiled
    when asked for; a probe asked for while this runs waits for it."""
    at = (program(plan), key)
    if at in self._staged:
      return
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_running_or_notify_cancel()
    self._staged[at] = future
    try:
      future.set_result(self._lower(plan, args, kwargs))
    except BaseException as e:  # pylint: disable=broad-except  (read by the probe)
      future.set_exception(e)

  def stage_ahead(self, plan, key, args, kwargs) -> None:
    """Lowers `plan` in a thread of its own, traced as this thread would: for a compile
    that may start once a probe is read. A compile asked for meanwhile waits for it."""
    at = (program(plan), key)
    if at not in self._staged:
      self._staged[at] = thread_context.submit(
          functools.partial(self._lower, plan, args, kwargs), "hbm_guard-lower")

  def unstage(self) -> None:
    """Lets the lowerings not probed go (a fit is over)."""
    self._staged.clear()

  def staged_probe(self, plan, key, args, kwargs, low_effort=False
                   ) -> Callable[[], compile_lib.Trial]:
    """A probe lowered here and now (tracing is Python's: one at a time), or earlier by
    `stage`, whose compile, the compiler's own work, may then run beside others'. Its
    seconds count both."""
    return self._staged_run(plan, key, args, kwargs, probe=True, low_effort=low_effort)

  def staged_compile(self, plan, key, args, kwargs) -> Callable[[], compile_lib.Trial]:
    """A real compile of `plan` (at the capacity), lowered here and now, to run beside the
    probes: where it does not fit, libtpu's early check fails it as fast as a probe (the
    README job: 2.4-3.0 s either way), and where it fits, it is the compile."""
    return self._staged_run(plan, key, args, kwargs, probe=False, low_effort=False)

  def _staged_run(self, plan, key, args, kwargs, *, probe: bool, low_effort: bool
                  ) -> Callable[[], compile_lib.Trial]:
    options, capacity = self._options(plan, probe, low_effort)
    staged = self._staged.pop((program(plan), key), None)
    low = staged.result() if staged is not None else self._lower(plan, args, kwargs)
    return functools.partial(self._compile_staged, plan, key, args, kwargs, low, options,
                             capacity, probe=probe)


@dataclasses.dataclass(frozen=True)
class _Lowering:
  """A plan's program lowered for a target, ready to compile with any options."""
  lowered: Any
  failed: BaseException | None  # what lowering raised, raised again by the compile
  facts: dict  # signature -> TraceFacts, filled by the trace
  targs: Any  # the abstract arguments it was lowered with
  seconds: float
  traced: Any = None  # its trace (the jaxpr a price reads), None where tracing failed


def make(step: steps_lib.StepBuilder, options: options_lib.GuardOptions):
  """The backend a guarded step compiles with, chosen once."""
  if options.target is not None:
    return TargetBackend(step, options)
  return LocalBackend(step, options)
