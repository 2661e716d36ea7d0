"""The Plan: every knob the ladder turns, as a frozen, JSON-serialisable value.

The guard traces the step with its plan installed; plan-aware helpers read it at trace
time through `current_plan()` (or the finer `plan_value`), which also records what the
step reads, so the guard knows which rungs can change it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Iterator, Mapping


@dataclasses.dataclass(frozen=True)
class Plan:
  """How to build and compile a step. The default plan is plain `jax.jit`."""
  donate_argnums: tuple[int, ...] = ()
  compiler_options: tuple[tuple[str, Any], ...] = ()
  shard_state: bool = False
  remat_policy: str | None = None  # a name in jax.checkpoint_policies; None: no remat
  microbatches: int = 1
  compute_dtype: str | None = None  # None: the model's own dtype
  offload_optimizer: bool = False
  rungs: tuple[str, ...] = ()  # the rungs applied, in order

  def with_options(self, options: Mapping[str, Any]) -> "Plan":
    merged = dict(self.compiler_options)
    merged.update(options)
    return dataclasses.replace(self, compiler_options=tuple(sorted(merged.items())))

  def added(self, rung: str, **changes) -> "Plan":
    return dataclasses.replace(self, rungs=self.rungs + (rung,), **changes)

  def field_rungs(self) -> tuple[tuple[str, str], ...]:
    """(rung name, detail) for each plan-field rung the plan applies, in ladder order."""
    parts = []
    if self.donate_argnums:
      parts.append(("donate", "donate"))
    if self.shard_state:
      parts.append(("reshard_fsdp", "reshard_fsdp"))
    if self.remat_policy:
      parts.append(("layer_remat", f"layer_remat({self.remat_policy})"))
    if self.microbatches > 1:
      parts.append(("microbatch", f"microbatch({self.microbatches})"))
    if self.offload_optimizer:
      parts.append(("offload_optimizer", "offload_optimizer"))
    return tuple(parts)

  def describe(self) -> str:
    """What the plan does, by its fields (flag rungs by the names they were applied as)."""
    if self == Plan():
      return "plain jit"
    fields = self.field_rungs()
    parts = [detail for _, detail in fields]
    known = {name for name, _ in fields} | {"donate", "reshard_fsdp", "layer_remat",
                                            "microbatch", "offload_optimizer", "bf16"}
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
  def from_dict(cls, d: Mapping[str, Any]) -> "Plan":
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in d.items() if k in names}
    kw["donate_argnums"] = tuple(kw.get("donate_argnums", ()))
    kw["compiler_options"] = tuple(sorted(dict(kw.get("compiler_options", {})).items()))
    kw["rungs"] = tuple(kw.get("rungs", ()))
    return cls(**kw)


@dataclasses.dataclass
class _Scope:
  plan: Plan
  reads: set[str] = dataclasses.field(default_factory=set)
  facts: dict[str, Any] = dataclasses.field(default_factory=dict)


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


def note_fact(key: str, value: Any) -> None:
  """Lets a helper tell the guard a fact learnt at trace time (e.g. the batch size)."""
  scope = _SCOPE.get()
  if scope is not None:
    scope.facts[key] = value


@contextlib.contextmanager
def plan_scope(plan: Plan) -> Iterator[_Scope]:
  """Installs `plan` for tracing; yields what the traced code read of it."""
  scope = _Scope(plan)
  token = _SCOPE.set(scope)
  try:
    yield scope
  finally:
    _SCOPE.reset(token)
