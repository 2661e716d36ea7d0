"""The fallback ladder: rungs as data, and the choice of the next plan to compile.

The measure of a ladder is how few compiles it needs. So the next plan is not simply the
next rung: a rung whose saving has a known bound that cannot close the gap on its own is
folded into the next compile when it is free (donation, resharding) and skipped otherwise;
the microbatch count is computed from the numbers, not found by halving.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib.resources
import json
import math
import os
from typing import Any, Mapping, Sequence

from hbm_guard._src import errors
from hbm_guard._src import plan as plan_lib
from hbm_guard._src import record as record_lib



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
# The plan field a plan-aware rung needs the step to read.
_NEEDS_FIELD = {"remat": "remat_policy", "microbatch": "microbatches", "dtype": "compute_dtype",
                "offload": "offload_optimizer"}
# Why a rung did not apply to a step whose gradient the drop-in analysis did see.
_UNSEEN = {
    "remat": ("no repeated layers were found in the differentiated loss (no Flax module "
              "names, no repeating pattern of parameter reads, no scan over the parameters): "
              "checkpoint the layers yourself with integrations.flax remat or jax.checkpoint"),
    "offload": ("the step's optimizer update was not seen: the guard follows "
                "TrainState.apply_gradients and nnx.Optimizer.update; for a bare tx.update "
                "call, update with hbm_guard.offload_aware(tx)"),
}
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


@functools.cache
def _default_rungs() -> tuple[Rung, ...]:
  text = importlib.resources.files("hbm_guard.configs").joinpath("ladder.json").read_text()
  return tuple(Rung.from_dict(r) for r in json.loads(text)["rungs"])


def load_ladder(ladder: str | os.PathLike | Sequence[Any] | None = None) -> tuple[Rung, ...]:
  """The default ladder, a JSON file of the same shape, or a list of rungs / dicts."""
  if ladder is None:
    return _default_rungs()
  if isinstance(ladder, (str, os.PathLike)):
    try:
      with open(ladder, encoding="utf-8") as f:
        data = json.load(f)
    except (OSError, ValueError) as e:
      raise errors.InvalidLadderError(f"Cannot read ladder {str(ladder)!r}: {e}") from e
    ladder = data.get("rungs") if isinstance(data, dict) else data
  if isinstance(ladder, (str, bytes, Mapping)) or not isinstance(ladder, Sequence):
    raise errors.InvalidLadderError(
        f"A ladder is a list of rungs (or a JSON file with 'rungs'), not {type(ladder).__name__}.")
  rungs = tuple(r if isinstance(r, Rung) else Rung.from_dict(r) for r in ladder)
  names = [r.name for r in rungs]
  if len(set(names)) != len(names):
    raise errors.InvalidLadderError(f"Rung names repeat: {names}.")
  return rungs


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


def applies(rung: Rung, plan: plan_lib.Plan, facts: StepFacts, max_class: RungClass
            ) -> tuple[SkipKind, str] | None:
  """None if the rung can be applied to `plan`; else (kind, why not)."""
  if CLASSES.index(rung.semantic_class) > CLASSES.index(max_class):
    return SkipKind.WITHHELD, (f"withheld: class '{rung.semantic_class}' is above the "
                               f"allowed '{max_class}' (allow it with max_class=...)")
  if rung.kind is RungKind.MICROBATCH and facts.auto_refused:
    return SkipKind.NOT_PLAN_AWARE, (
        f"the batch was not split automatically: {facts.auto_refused} (split it yourself "
        f"with hbm_guard.value_and_grad where that is what you want)")
  if rung.kind in _NEEDS_FIELD and not facts.reads(_NEEDS_FIELD[rung.kind]):
    if facts.gradient_seen and rung.kind in _UNSEEN:
      return SkipKind.NOT_PLAN_AWARE, _UNSEEN[rung.kind]
    return SkipKind.NOT_PLAN_AWARE, ("the step is not plan-aware for this rung: no "
            "jax.value_and_grad / jax.grad / nnx.value_and_grad call was seen in the traced step "
            "(build it with hbm_guard's helpers, e.g. hbm_guard.value_and_grad / integrations.flax remat)")
  if rung.kind is RungKind.DONATE:
    if not facts.state_argnums:
      return SkipKind.NOT_APPLICABLE, "no argument is declared replaced by the step (pass state_argnums=...)"
    if set(facts.state_argnums) <= set(plan.donate_argnums):
      return SkipKind.ALREADY_APPLIED, "already donated"
  if rung.kind is RungKind.RESHARD:
    if facts.num_devices < 2:
      return SkipKind.NOT_APPLICABLE, f"needs several devices; {facts.num_devices} present"
    if not facts.can_reshard:
      return SkipKind.NOT_APPLICABLE, "in_shardings that are not NamedShardings were given to guarded_jit: the guard cannot extend them"
    if facts.reshard_refused:
      return SkipKind.NOT_APPLICABLE, facts.reshard_refused
    if not facts.state_argnums:
      return SkipKind.NOT_APPLICABLE, "no state argument to shard (pass state_argnums=...)"
    if plan.shard_state:
      return SkipKind.ALREADY_APPLIED, "state already sharded"
  if rung.kind is RungKind.COMPILER_OPTIONS:
    if facts.platform != "tpu":
      return SkipKind.NOT_APPLICABLE, f"XLA:TPU flags; compiling for {facts.platform}"
    if all(dict(plan.compiler_options).get(k) == v for k, v in rung.options):
      return SkipKind.ALREADY_APPLIED, "options already set"
  if rung.kind is RungKind.REMAT and _next_policy(rung, plan, facts) is None:
    return SkipKind.ALREADY_APPLIED, "every remat policy already tried"
  if rung.kind is RungKind.OFFLOAD:
    if facts.platform == "cpu":
      return SkipKind.NOT_APPLICABLE, "on the CPU, device memory is host memory"
    if not facts.has_host_memory:
      return SkipKind.NOT_APPLICABLE, "no host memory space on this backend"
    if not facts.offload_bytes:
      return SkipKind.NOT_APPLICABLE, "no optimizer state among the state arguments (see offload_filter)"
    if not facts.can_reshard:
      return SkipKind.NOT_APPLICABLE, "in_shardings that are not NamedShardings were given to guarded_jit: the guard cannot extend them"
    if plan.offload_optimizer:
      return SkipKind.ALREADY_APPLIED, "already offloaded"
  if rung.kind is RungKind.DTYPE and plan.compute_dtype == rung.dtype:
    return SkipKind.ALREADY_APPLIED, f"already {rung.dtype}"
  return None


def remat_policies(rung: Rung, facts: StepFacts | None) -> list[str]:
  """A remat rung's policies, in order; offloading ones only where there is host memory."""
  return [p for p in (rung.policies or ("nothing_saveable",))
          if not p.startswith("offload_") or (facts is not None and facts.has_host_memory)]


def _next_policy(rung: Rung, plan: plan_lib.Plan, facts: StepFacts | None = None
                 ) -> str | None:
  """The next remat policy of the rung."""
  policies = remat_policies(rung, facts)
  if plan.remat_policy is None:
    return policies[0] if policies else None
  if plan.remat_policy in policies:
    i = policies.index(plan.remat_policy)
    return policies[i + 1] if i + 1 < len(policies) else None
  return None


def microbatch_count(batch_size: int | None, current: int, rec: record_lib.E1000Record,
                     temp_bytes: int | None,
                     measured: Sequence[tuple[int, int]] = ()) -> tuple[int | None, str]:
  """The fewest microbatches predicted to fit, dividing the batch; (None, why) if none.

  Memory is modelled as need(k) = F + T / k: T the part that scales with the per-step
  batch (activations), F the rest. With two measured (k, need) points from earlier
  attempts, F and T come from them; otherwise T is the temporaries of this attempt.
  """
  if not batch_size:
    return None, "the batch size is unknown"
  need, have = rec.required_bytes, rec.available_bytes
  divisors = plan_lib.microbatch_counts(batch_size, above=current)
  if not divisors:
    return None, f"batch {batch_size} splits no further than {current} microbatches"
  if need is None or have is None:
    return divisors[0], "no numbers to size the split: the next divisor"
  points = sorted(set(measured) | {(current, need)})
  if len(points) >= 2 and points[0][0] != points[-1][0]:
    (k0, n0), (k1, n1) = points[0], points[-1]
    scaling = (n0 - n1) / (1 / k0 - 1 / k1)  # T
    fixed = n0 - scaling / k0  # F
    how = f"fitted to attempts at k={k0} ({n0} bytes) and k={k1} ({n1} bytes)"
  else:
    temps = temp_bytes if temp_bytes else (need if rec.kind == "compile_hbm_early" else None)
    if not temps:
      return divisors[0], "no numbers to size the split: the next divisor"
    scaling, fixed = temps * current, max(0, need - temps)
    how = f"temporaries {temps} bytes at k={current}"
  room = HEADROOM * have - fixed
  if room <= 0 or scaling <= 0:
    return None, (f"the part that does not scale with the batch ({int(fixed)} bytes) alone "
                  "exceeds the capacity: microbatching cannot close the gap")
  want = math.ceil(scaling / room)
  for k in divisors:
    if k >= want:
      return k, f"{how}: predicted {int(fixed + scaling / k)} bytes at k={k}"
  return divisors[-1], f"{how}: even the most microbatches may not fit; trying them"


def saving_bound(rung: Rung, facts: StepFacts) -> int | None:
  """Most bytes a rung can save, when that is known before compiling."""
  if rung.kind is RungKind.DONATE:
    return facts.state_bytes
  if rung.kind is RungKind.RESHARD:
    return facts.state_bytes - facts.state_bytes // max(1, facts.num_devices)
  if rung.kind is RungKind.OFFLOAD:
    return facts.offload_bytes
  return None


_FOLDABLE = (RungKind.DONATE, RungKind.RESHARD)  # free of compute cost: worth carrying along


def apply(rung: Rung, plan: plan_lib.Plan, facts: StepFacts, rec: record_lib.E1000Record,
          temp_bytes: int | None, measured: Sequence[tuple[int, int]] = ()
          ) -> tuple[plan_lib.Plan | None, str]:
  """The plan one step up this rung, or (None, why not)."""
  if rung.kind is RungKind.DONATE:
    argnums = tuple(sorted(set(plan.donate_argnums) | set(facts.state_argnums)))
    return plan.added(rung.name, donate_argnums=argnums), ""
  if rung.kind is RungKind.RESHARD:
    return plan.added(rung.name, shard_state=True), ""
  if rung.kind is RungKind.COMPILER_OPTIONS:
    return dataclasses.replace(plan.with_options(dict(rung.options)),
                               rungs=plan.rungs + (rung.name,)), ""
  if rung.kind is RungKind.REMAT:
    return plan.added(rung.name, remat_policy=_next_policy(rung, plan, facts)), ""
  if rung.kind is RungKind.MICROBATCH:
    k, why = microbatch_count(facts.batch_size, plan.microbatches, rec, temp_bytes, measured)
    if k is None:
      return None, why
    return plan.added(rung.name, microbatches=k), why
  if rung.kind is RungKind.OFFLOAD:
    return plan.added(rung.name, offload_optimizer=True), ""
  if rung.kind is RungKind.DTYPE:
    return plan.added(rung.name, compute_dtype=rung.dtype), ""
  raise AssertionError(rung.kind)


def next_plan(rungs: Sequence[Rung], plan: plan_lib.Plan, facts: StepFacts,
              rec: record_lib.E1000Record, max_class: RungClass, temp_bytes: int | None = None,
              history: Sequence[tuple[plan_lib.Plan, int | None]] = (),
              ) -> tuple[plan_lib.Plan | None, list[Skip]]:
  """The cheapest plan predicted to fit, from `plan` after it failed with `rec`.

  `history` holds earlier (plan, bytes needed) of this climb: attempts that differ from
  `plan` only in their microbatch count size the next count.
  """
  def same_but_k(p):  # the same step but for the microbatch count (flags aside)
    def core(q):
      return dataclasses.replace(q, microbatches=1, rungs=(), compiler_options=())
    return core(p) == core(plan)
  measured = [(p.microbatches, n) for p, n in history if n is not None and same_but_k(p)]
  gap = rec.shortfall_bytes
  skips: list[Skip] = []
  folded = 0
  candidate = plan
  for rung in rungs:
    if rung.kind not in (RungKind.REMAT, RungKind.MICROBATCH) and rung.name in candidate.rungs:
      continue
    passed = applies(rung, candidate, facts, max_class)
    if passed is not None:
      kind, why = passed
      if not (rung.name in plan.rungs and kind is SkipKind.ALREADY_APPLIED):
        skips.append(Skip(rung.name, why, kind))
      continue
    bound = saving_bound(rung, facts)
    new, why = apply(rung, candidate, facts, rec, temp_bytes, measured)
    if new is None:
      skips.append(Skip(rung.name, why, SkipKind.CANNOT_CLOSE_GAP))
      continue
    if bound is not None and gap is not None and gap > 0 and folded + bound < gap:
      if rung.kind in _FOLDABLE:
        folded += bound
        candidate = new
        skips.append(Skip(rung.name, f"saves at most {bound} bytes of the {gap} needed: "
                                     "carried into the next compile, not compiled alone",
                          SkipKind.FOLDED))
        continue
      skips.append(Skip(rung.name, f"saves at most {bound} bytes of the {gap} needed",
                        SkipKind.CANNOT_CLOSE_GAP))
      continue
    return new, skips
  if candidate != plan:  # only free rungs were left: still worth one compile
    return candidate, skips
  return None, skips
