"""The Plan: every knob the ladder turns, as a frozen, JSON-serialisable value.

The guard traces the step with its plan installed; plan-aware helpers read it at trace
time through `current_plan()` (or the finer `plan_value`), which also records what the
step reads, so the guard knows which rungs can change it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import numbers
import re
from typing import Any, Iterator, Mapping

from hbm_guard._src.record import errors

MAX_MICROBATCHES = 1 << 16
_MAX_ARGNUM = 1 << 12
_OPTION_NAME = re.compile(r"[a-z][a-z0-9_]{0,127}")
_RUNG_NAME = re.compile(r"[\w.\-]{1,128}")


# The plan field each default rung sets, and how a plan names it: the one table from rung
# to field (describe, the planner's rung names, the report's "already applied").
FIELD_RUNGS = (
    ("donate_argnums", "donate", lambda v: "donate"),
    ("shard_state", "reshard_fsdp", lambda v: "reshard_fsdp"),
    ("shard_batch", "reshard_fsdp", lambda v: "data_parallel"),
    ("remat_policy", "layer_remat", lambda v: f"layer_remat({v})"),
    ("microbatches", "microbatch", lambda v: f"microbatch({v})"),
    ("offload_optimizer", "offload_optimizer", lambda v: "offload_optimizer"),
    ("compute_dtype", "bf16", lambda v: f"dtype({v})"),
)


@dataclasses.dataclass(frozen=True)
class Plan:
  """How to build and compile a step. The default plan is plain `jax.jit`."""
  donate_argnums: tuple[int, ...] = ()
  compiler_options: tuple[tuple[str, Any], ...] = ()
  shard_state: bool = False
  shard_batch: bool = False  # with shard_state: the batch too (data parallel, FSDP proper)
  remat_policy: str | None = None  # a name in jax.checkpoint_policies; None: no remat
  microbatches: int = 1
  compute_dtype: str | None = None  # None: the model's own dtype
  offload_optimizer: bool = False
  rungs: tuple[str, ...] = ()  # the rungs applied, in order

  def __post_init__(self):
    _check_fields(self)

  @property
  def program(self) -> "Plan":
    """The plan without its rung names: what it lowers to. Plans that do the same compare
    equal by it, whatever the order their rungs were named in (the search's figures and a
    backend's lowerings are keyed by it)."""
    return dataclasses.replace(self, rungs=())

  def with_options(self, options: Mapping[str, Any]) -> "Plan":
    merged = dict(self.compiler_options)
    merged.update(options)
    return dataclasses.replace(self, compiler_options=tuple(sorted(merged.items())))

  def added(self, rung: str, **changes) -> "Plan":
    return dataclasses.replace(self, rungs=self.rungs + (rung,), **changes)

  def field_rungs(self, *, dtype: bool = False) -> tuple[tuple[str, str], ...]:
    """(rung name, detail) for each plan-field rung the plan applies, in ladder order
    (the compute dtype too, with `dtype=True`). The one rung <-> field table is FIELD_RUNGS."""
    out = []
    for field, rung, detail in FIELD_RUNGS:
      value = getattr(self, field)
      if (value > 1 if field == "microbatches" else bool(value)) and (
          dtype or field != "compute_dtype"):
        out.append((rung, detail(value)))
    return tuple(out)

  def describe(self) -> str:
    """What the plan does, by its fields (flag rungs by the names they were applied as)."""
    if self == Plan():
      return "plain jit"
    fields = self.field_rungs()
    parts = [detail for _, detail in fields]
    known = {rung for _, rung, _ in FIELD_RUNGS}
    flags = [r for r in dict.fromkeys(self.rungs) if r not in known]
    if self.compiler_options:
      parts += flags or [",".join(f"{k}={v}" for k, v in self.compiler_options)]
    if self.compute_dtype:
      parts.append(f"dtype({self.compute_dtype})")
    return " + ".join(parts) or "plain jit"

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["donate_argnums"] = list(self.donate_argnums)
    d["compiler_options"] = dict(self.compiler_options)
    d["rungs"] = list(self.rungs)
    return d

  @classmethod
  def from_dict(cls, d: Any) -> "Plan":
    """A plan from its JSON form. Anything malformed is an InvalidPlanError, never applied:
    an unknown key (a typo such as `microbatch`), a wrong type, a value out of range."""
    if not isinstance(d, Mapping):
      raise errors.InvalidPlanError(f"A plan is a JSON object, not {type(d).__name__}.")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(str(k)[:40] for k in d if k not in names)
    if unknown:
      raise errors.InvalidPlanError(
          f"Unknown plan field(s) {unknown}; fields are {sorted(names)}.")
    kw = dict(d)
    for key in ("donate_argnums", "rungs"):
      if key in kw:
        kw[key] = _as_tuple(kw[key], key)
    if "compiler_options" in kw:
      options = kw["compiler_options"]
      if not isinstance(options, Mapping):
        raise errors.InvalidPlanError("Plan field 'compiler_options' must be an object.")
      kw["compiler_options"] = tuple(sorted(options.items(), key=lambda kv: str(kv[0])))
    return cls(**kw)


def microbatch_counts(batch_size: int, above: int = 0, limit: int = MAX_MICROBATCHES
                      ) -> list[int]:
  """The microbatch counts a batch splits into evenly (its divisors), above `above`."""
  return [k for k in range(above + 1, min(batch_size, limit) + 1) if batch_size % k == 0]


def _as_tuple(value: Any, key: str) -> tuple:
  if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, (list, tuple)):
    raise errors.InvalidPlanError(f"Plan field {key!r} must be a list, not {value!r:.60}.")
  return tuple(value)


def _is_int(x: Any) -> bool:
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_fields(plan: Plan) -> None:
  """Types and ranges of every field: what a plan read from a file must satisfy."""
  def bad(field, want):
    value = getattr(plan, field)
    raise errors.InvalidPlanError(f"Plan field {field!r} must be {want}, not {value!r:.80}.")

  if not isinstance(plan.donate_argnums, tuple) or not all(
      _is_int(i) and -_MAX_ARGNUM <= i < _MAX_ARGNUM for i in plan.donate_argnums):
    bad("donate_argnums", "a tuple of argument positions")
  if not isinstance(plan.compiler_options, tuple) or len(plan.compiler_options) > 64:
    bad("compiler_options", "at most 64 (name, value) pairs")
  for item in plan.compiler_options:
    if (not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str)
        or not _OPTION_NAME.fullmatch(item[0])
        or not isinstance(item[1], (bool, int, float, str))
        or (isinstance(item[1], str) and len(item[1]) > 256)):
      bad("compiler_options", "XLA option names with a bool, number or short string each")
  for field in ("shard_state", "shard_batch", "offload_optimizer"):
    if not isinstance(getattr(plan, field), bool):
      bad(field, "true or false")
  if plan.shard_batch and not plan.shard_state:
    bad("shard_batch", "only with shard_state (the batch is sharded over the state's devices)")
  if not _is_int(plan.microbatches) or not 1 <= plan.microbatches <= MAX_MICROBATCHES:
    bad("microbatches", f"an int from 1 to {MAX_MICROBATCHES}")
  if plan.remat_policy is not None and (
      not isinstance(plan.remat_policy, str) or not _RUNG_NAME.fullmatch(plan.remat_policy)):
    bad("remat_policy", "null or a name in jax.checkpoint_policies")
  if plan.compute_dtype is not None and (
      not isinstance(plan.compute_dtype, str) or not _RUNG_NAME.fullmatch(plan.compute_dtype)):
    bad("compute_dtype", "null or a dtype name")
  if not isinstance(plan.rungs, tuple) or len(plan.rungs) > 64 or not all(
      isinstance(r, str) and _RUNG_NAME.fullmatch(r) for r in plan.rungs):
    bad("rungs", "at most 64 rung names")


@dataclasses.dataclass
class TraceNotes:
  """What plan-aware helpers tell the guard at trace time, as typed fields."""
  batch_size: int | None = None  # the batch the step's value_and_grad split
  loss_form: str | None = None  # "weighted_sum" | "mean": how it reduced the loss
  optimizer_streaming: str | None = None  # "streamed" | "whole": how offload brought it in
  auto: str | None = None  # what the drop-in analysis found in the step's gradient
  auto_refused: str | None = None  # why it did not split the batch, when it did not
  gradients: tuple = ()  # each gradient the analysis met, in the order of the calls


@dataclasses.dataclass
class _Scope:
  plan: Plan
  reads: set[str] = dataclasses.field(default_factory=set)
  notes: TraceNotes = dataclasses.field(default_factory=TraceNotes)

  @property
  def facts(self) -> dict[str, Any]:
    """The notes that were made, by name."""
    return {k: v for k, v in dataclasses.asdict(self.notes).items() if v is not None}


_SCOPE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar(
    "hbm_guard_plan", default=None)


def current_plan() -> Plan:
  """The plan the step is being traced under (the default plan outside a guard)."""
  scope = _SCOPE.get()
  if scope is None:
    return Plan()
  scope.reads.add("*")
  return scope.plan


def plan_value(field: str) -> Any:
  """One field of the current plan, recording that the step follows it."""
  scope = _SCOPE.get()
  if scope is None:
    return getattr(Plan(), field)
  scope.reads.add(field)
  return getattr(scope.plan, field)


def peek(field: str) -> Any:
  """A field of the plan in force, not recorded as read: for the guard's own bookkeeping
  (a step reads the plan; the guard looking at it makes the step no more plan-aware)."""
  scope = _SCOPE.get()
  return getattr(Plan() if scope is None else scope.plan, field)


def peek_plan() -> Plan:
  """The plan in force, not recorded as read (the guard's own bookkeeping, as `peek`)."""
  scope = _SCOPE.get()
  return Plan() if scope is None else scope.plan


def reads_now() -> frozenset[str]:
  """The plan fields read so far in this trace (empty outside a guard)."""
  scope = _SCOPE.get()
  return frozenset(scope.reads) if scope is not None else frozenset()


def noted(name: str) -> Any:
  """What was noted so far in this trace under `name` (a TraceNotes field)."""
  scope = _SCOPE.get()
  return getattr(scope.notes if scope is not None else TraceNotes(), name)


def note(**notes: Any) -> None:
  """Lets a helper tell the guard what it learnt at trace time (fields of TraceNotes)."""
  scope = _SCOPE.get()
  if scope is not None:
    for name, value in notes.items():
      if not hasattr(scope.notes, name):
        raise TypeError(f"hbm_guard: no trace note {name!r}")
      setattr(scope.notes, name, value)


@contextlib.contextmanager
def plan_scope(plan: Plan) -> Iterator[_Scope]:
  """Installs `plan` for tracing; yields what the traced code read of it."""
  scope = _Scope(plan)
  token = _SCOPE.set(scope)
  try:
    yield scope
  finally:
    _SCOPE.reset(token)


@functools.cache
def checkpoint_policy(name: str):
  """jax's checkpoint policy of a plan's `remat_policy` name (an offloading one saves to
  pinned host memory)."""
  import jax  # pylint: disable=g-import-not-at-top  (plans are data: jax only when used)
  policy = getattr(jax.checkpoint_policies, name)
  if name.startswith("offload_"):
    return policy("device", "pinned_host")
  return policy
