"""The ladder's vocabulary: what a rung is (its kind and class), what the guard knows about
a step when it decides which rungs apply, and why a rung was passed over. What each kind
of rung does is its spec (`rung_specs`); the ladder's order and walk are `ladder`."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping

from hbm_guard._src.record import errors


class RungClass(enum.StrEnum):
  """How far a rung may change what the step computes (the ladder's `class`), in order."""
  EXACT = "exact"  # the same math
  NUMERICS = "numerics"  # the same math, other rounding (microbatching)
  BEHAVIOUR = "behaviour"  # may change training (bf16)


class RungKind(enum.StrEnum):
  """What a rung changes: the plan field (or XLA's options) it sets."""
  DONATE = "donate"
  RESHARD = "reshard"
  COMPILER_OPTIONS = "compiler_options"
  REMAT = "remat"
  MICROBATCH = "microbatch"
  OFFLOAD = "offload"
  DTYPE = "dtype"


CLASSES = tuple(RungClass)
KINDS = tuple(RungKind)
HEADROOM = 0.95  # aim below the capacity: estimates are estimates


_RUNG_KEYS = frozenset({"name", "kind", "class", "section", "options", "policies", "dtype"})


@dataclasses.dataclass(frozen=True)
class Rung:
  name: str
  kind: RungKind
  semantic_class: RungClass
  section: str
  options: tuple[tuple[str, Any], ...] = ()
  policies: tuple[str, ...] = ()
  dtype: str | None = None

  def __post_init__(self):
    # A rung built in code, not read from JSON, names its kind and class as strings too.
    object.__setattr__(self, "kind", RungKind(self.kind))
    object.__setattr__(self, "semantic_class", RungClass(self.semantic_class))

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "Rung":
    """A rung from its JSON form; anything malformed is an InvalidLadderError."""
    if not isinstance(d, Mapping):
      raise errors.InvalidLadderError(f"A rung must be an object, not {d!r}.")
    name = d.get("name")
    if not isinstance(name, str) or not name:
      raise errors.InvalidLadderError(f"Rung {dict(d)!r} has no 'name'.")
    unknown = sorted(set(d) - _RUNG_KEYS)
    if unknown:
      raise errors.InvalidLadderError(
          f"Rung {name!r}: unknown key(s) {unknown}; keys are {sorted(_RUNG_KEYS)}.")
    kind, klass = d.get("kind"), d.get("class", "exact")
    if kind not in KINDS:
      raise errors.InvalidLadderError(f"Rung {name!r}: unknown kind {kind!r}; "
                                      f"kinds are {', '.join(KINDS)}.")
    if klass not in CLASSES:
      raise errors.InvalidLadderError(f"Rung {name!r}: unknown class {klass!r}; "
                                      f"classes are {', '.join(CLASSES)}.")
    options, policies, dtype = d.get("options", {}), d.get("policies", ()), d.get("dtype")
    if not isinstance(options, Mapping):
      raise errors.InvalidLadderError(f"Rung {name!r}: 'options' must be an object.")
    if isinstance(policies, str) or not all(isinstance(p, str) for p in policies):
      raise errors.InvalidLadderError(f"Rung {name!r}: 'policies' must be a list of names.")
    bad = [p for p in policies if not hasattr(_checkpoint_policies(), p)]
    if bad:
      raise errors.InvalidLadderError(
          f"Rung {name!r}: {bad} are not in jax.checkpoint_policies.")
    if kind == RungKind.DTYPE and not isinstance(dtype, str):
      raise errors.InvalidLadderError(f"Rung {name!r}: a dtype rung needs 'dtype'.")
    return cls(name=name, kind=kind, semantic_class=klass, section=str(d.get("section", "")),
               options=tuple(sorted(dict(options).items())), policies=tuple(policies),
               dtype=dtype)

  def to_dict(self) -> dict[str, Any]:
    d = {"name": self.name, "kind": self.kind.value, "class": self.semantic_class.value,
         "section": self.section}
    if self.options:
      d["options"] = dict(self.options)
    if self.policies:
      d["policies"] = list(self.policies)
    if self.dtype:
      d["dtype"] = self.dtype
    return d


def _checkpoint_policies():
  import jax  # pylint: disable=g-import-not-at-top
  return jax.checkpoint_policies


@dataclasses.dataclass(frozen=True)
class StepFacts:
  """What the guard knows about the step, for deciding which rungs apply."""
  platform: str  # the platform compiled for: "tpu", "cpu", "gpu"
  num_devices: int
  plan_reads: frozenset[str]  # plan fields the step read when traced ("*": all)
  state_argnums: tuple[int, ...]  # arguments the step replaces (state in, state out)
  state_bytes: int  # bytes of those arguments
  batch_size: int | None  # as a plan-aware helper saw it
  has_host_memory: bool = False
  can_reshard: bool = True  # False when the user's in_shardings are not NamedShardings
  reshard_refused: str | None = None  # why the step's explicit sharding types refuse it
  user_layout: bool = False  # the user gave in_shardings: resharding extends them
  offload_bytes: int = 0  # state bytes the offload filter selects (optimizer state)
  auto_refused: str | None = None  # why the drop-in analysis did not split the batch
  gradient_seen: bool = False  # the drop-in analysis saw the step's gradient

  def reads(self, field: str) -> bool:
    return "*" in self.plan_reads or field in self.plan_reads


class SkipKind(enum.Enum):
  """Why a rung was passed over, as a value the report and advice can act on."""
  WITHHELD = "withheld"  # its class is above max_class
  NOT_PLAN_AWARE = "not_plan_aware"  # the step does not read the plan field it changes
  NOT_APPLICABLE = "not_applicable"  # backend, devices, arguments rule it out
  ALREADY_APPLIED = "already_applied"
  CANNOT_CLOSE_GAP = "cannot_close_gap"  # its known saving is smaller than the shortfall
  FOLDED = "folded"  # free: carried into the next compile instead of compiled alone


@dataclasses.dataclass(frozen=True)
class Skip:
  rung: str
  reason: str
  kind: SkipKind = SkipKind.NOT_APPLICABLE

  def to_dict(self) -> dict[str, str]:
    return {"rung": self.rung, "reason": self.reason, "kind": self.kind.value}
