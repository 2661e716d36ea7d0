"""One spec per kind of rung: everything the guard knows about that kind, in one place.

As optax keeps a transform's `init` and `update` together, a rung kind's spec holds the
plan field it sets, whether it applies to a step and plan, how it applies, the most it can
save, how the probe search opens it, what a plan from outside may ask of it, and why a
step the drop-in saw could not take it. The ladder (`ladder.next_plan`), the search space
(`search/space.py`) and the trust check (`plan_trust`) look the spec up; adding a kind of
rung is one spec here and its tests.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Callable, Sequence

from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.record import diagnose
from hbm_guard._src.record import record as record_lib
from hbm_guard._src.plans.rungs import (CLASSES, HEADROOM, Rung, RungClass, RungKind, SkipKind,
                                  StepFacts)

Plan = plan_lib.Plan
Blocked = tuple[SkipKind, str] | None


class Axis(enum.Enum):
  """How the probe search opens a kind of rung (`search/space.families`)."""
  NONE = "none"  # not searched: walked after the search (XLA flags, a dtype)
  FREE = "free"  # on in every family, costing no compute; folded into the next compile
  POLICY = "policy"  # one family per remat policy
  OFFLOAD = "offload"  # families with it and without
  COUNT = "count"  # the microbatch count, searched within each family


@dataclasses.dataclass(frozen=True)
class Sizing:
  """The figures a rung that sizes itself (the microbatch count) is applied from."""
  rec: record_lib.E1000Record | None = None
  temp_bytes: int | None = None
  measured: Sequence[tuple[int, int]] = ()  # (count, bytes needed) of earlier attempts


@dataclasses.dataclass(frozen=True)
class RungSpec:
  kind: RungKind
  plan_field: str  # the Plan field it sets
  blocked: Callable[[Rung, Plan, StepFacts], Blocked]  # why not, for this kind
  apply: Callable[[Rung, Plan, StepFacts, Sizing], tuple[Plan | None, str]]
  # What a plan from outside asks of this kind: (what, whether the allowed rungs of this
  # kind allow it) for each part it asks for.
  asks: Callable[[Plan, Sequence[Rung]], list[tuple[str, bool]]]
  saving: Callable[[StepFacts], int | None] = lambda facts: None  # most bytes it can save
  plan_aware: bool = False  # the step must read `plan_field` (the drop-in or a helper)
  unseen: str | None = None  # why not, where the drop-in saw the gradient but not this
  axis: Axis = Axis.NONE
  repeatable: bool = False  # climbed more than once (the next policy, the next count)
  splits_batch: bool = False  # only where the drop-in's analysis split the batch


def _donate_blocked(rung: Rung, plan: Plan, facts: StepFacts) -> Blocked:
  if not facts.state_argnums:
    return SkipKind.NOT_APPLICABLE, ("no argument is declared replaced by the step (pass "
                                     "state_argnums=...)")
  if set(facts.state_argnums) <= set(plan.donate_argnums):
    return SkipKind.ALREADY_APPLIED, "already donated"
  return None


_NOT_NAMED = ("in_shardings that are not NamedShardings were given to guarded_jit: the "
              "guard cannot extend them")


def _reshard_blocked(rung: Rung, plan: Plan, facts: StepFacts) -> Blocked:
  if facts.num_devices < 2:
    return SkipKind.NOT_APPLICABLE, f"needs several devices; {facts.num_devices} present"
  if not facts.can_reshard:
    return SkipKind.NOT_APPLICABLE, _NOT_NAMED
  if facts.reshard_refused:
    return SkipKind.NOT_APPLICABLE, facts.reshard_refused
  if not facts.state_argnums:
    return SkipKind.NOT_APPLICABLE, "no state argument to shard (pass state_argnums=...)"
  if plan.shard_state:
    return SkipKind.ALREADY_APPLIED, "state already sharded"
  return None


def _options_blocked(rung: Rung, plan: Plan, facts: StepFacts) -> Blocked:
  if facts.platform != "tpu":
    return SkipKind.NOT_APPLICABLE, f"XLA:TPU flags; compiling for {facts.platform}"
  if all(dict(plan.compiler_options).get(k) == v for k, v in rung.options):
    return SkipKind.ALREADY_APPLIED, "options already set"
  return None


def remat_policies(rung: Rung, facts: StepFacts | None) -> list[str]:
  """A remat rung's policies, in order; offloading ones only where there is host memory."""
  return [p for p in (rung.policies or ("nothing_saveable",))
          if not p.startswith("offload_") or (facts is not None and facts.has_host_memory)]


def _next_policy(rung: Rung, plan: Plan, facts: StepFacts | None = None) -> str | None:
  policies = remat_policies(rung, facts)
  if plan.remat_policy is None:
    return policies[0] if policies else None
  if plan.remat_policy in policies:
    i = policies.index(plan.remat_policy)
    return policies[i + 1] if i + 1 < len(policies) else None
  return None


def _remat_blocked(rung: Rung, plan: Plan, facts: StepFacts) -> Blocked:
  if _next_policy(rung, plan, facts) is None:
    return SkipKind.ALREADY_APPLIED, "every remat policy already tried"
  return None


def _microbatch_blocked(rung: Rung, plan: Plan, facts: StepFacts) -> Blocked:
  return None  # the analysis's refusal is `applies`'s (splits_batch); the count, `apply`'s


def _offload_blocked(rung: Rung, plan: Plan, facts: StepFacts) -> Blocked:
  if facts.platform == "cpu":
    return SkipKind.NOT_APPLICABLE, "on the CPU, device memory is host memory"
  if not facts.has_host_memory:
    return SkipKind.NOT_APPLICABLE, "no host memory space on this backend"
  if not facts.offload_bytes:
    return SkipKind.NOT_APPLICABLE, ("no optimizer state among the state arguments (see "
                                     "offload_filter)")
  if not facts.can_reshard:
    return SkipKind.NOT_APPLICABLE, _NOT_NAMED
  if plan.offload_optimizer:
    return SkipKind.ALREADY_APPLIED, "already offloaded"
  return None


def _dtype_blocked(rung: Rung, plan: Plan, facts: StepFacts) -> Blocked:
  if plan.compute_dtype == rung.dtype:
    return SkipKind.ALREADY_APPLIED, f"already {rung.dtype}"
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
    how = f"fitted to attempts at k={k0} ({_fmt(n0)}) and k={k1} ({_fmt(n1)})"
  else:
    temps = temp_bytes if temp_bytes else (need if rec.kind == "compile_hbm_early" else None)
    if not temps:
      return divisors[0], "no numbers to size the split: the next divisor"
    scaling, fixed = temps * current, max(0, need - temps)
    how = f"temporaries {_fmt(temps)} at k={current}"
  room = HEADROOM * have - fixed
  if room <= 0 or scaling <= 0:
    return None, (f"the part that does not scale with the batch ({_fmt(int(fixed))}) alone "
                  "exceeds the capacity: microbatching cannot close the gap")
  want = math.ceil(scaling / room)
  for k in divisors:
    if k >= want:
      return k, f"{how}: predicted {_fmt(int(fixed + scaling / k))} at k={k}"
  return divisors[-1], f"{how}: even the most microbatches may not fit; trying them"


def _apply_microbatch(rung: Rung, plan: Plan, facts: StepFacts, sizing: Sizing):
  k, why = microbatch_count(facts.batch_size, plan.microbatches, sizing.rec,
                            sizing.temp_bytes, sizing.measured)
  return (None, why) if k is None else (plan.added(rung.name, microbatches=k), why)


def _apply_options(rung: Rung, plan: Plan, facts: StepFacts, sizing: Sizing):
  return dataclasses.replace(plan.with_options(dict(rung.options)),
                             rungs=plan.rungs + (rung.name,)), ""


def _asks_options(plan: Plan, allowed: Sequence[Rung]) -> list[tuple[str, bool]]:
  options = {item for r in allowed for item in r.options}
  return [(f"compiler option {name}={value!r:.60}",
           any(n == name and v == value and type(v) is type(value) for n, v in options))
          for name, value in plan.compiler_options]


def _asks_remat(plan: Plan, allowed: Sequence[Rung]) -> list[tuple[str, bool]]:
  if plan.remat_policy is None:
    return []
  policies = {p for r in allowed for p in (r.policies or ("nothing_saveable",))}
  return [(f"remat policy {plan.remat_policy!r}", plan.remat_policy in policies)]


def _asks_dtype(plan: Plan, allowed: Sequence[Rung]) -> list[tuple[str, bool]]:
  if plan.compute_dtype is None:
    return []
  return [(f"compute dtype {plan.compute_dtype!r}",
           plan.compute_dtype in {r.dtype for r in allowed})]


def _asks(condition: Callable[[Plan], bool], what: Callable[[Plan], str]):
  return lambda plan, allowed: [(what(plan), True)] if condition(plan) else []


# In the order a plan from outside is checked (the first part not allowed is named).
SPECS: dict[RungKind, RungSpec] = {spec.kind: spec for spec in (
    RungSpec(
        RungKind.DONATE, "donate_argnums", _donate_blocked,
        lambda rung, plan, facts, sizing: (plan.added(rung.name, donate_argnums=tuple(
            sorted(set(plan.donate_argnums) | set(facts.state_argnums)))), ""),
        _asks(lambda p: bool(p.donate_argnums),
              lambda p: f"donation of arguments {list(p.donate_argnums)}"),
        saving=lambda facts: facts.state_bytes, axis=Axis.FREE),
    RungSpec(
        RungKind.RESHARD, "shard_state", _reshard_blocked,
        lambda rung, plan, facts, sizing: (plan.added(rung.name, shard_state=True), ""),
        _asks(lambda p: p.shard_state, lambda p: "resharding the state" + (
            " and the batch" if p.shard_batch else "")),
        saving=lambda f: f.state_bytes - f.state_bytes // max(1, f.num_devices),
        axis=Axis.FREE),
    RungSpec(
        RungKind.REMAT, "remat_policy", _remat_blocked,
        lambda rung, plan, facts, sizing: (plan.added(
            rung.name, remat_policy=_next_policy(rung, plan, facts)), ""),
        _asks_remat, plan_aware=True, axis=Axis.POLICY, repeatable=True,
        unseen=("no repeated layers were found in the differentiated loss (no Flax module "
                "names, no repeating pattern of parameter reads, no scan over the "
                "parameters): checkpoint the layers yourself with integrations.flax remat or "
                "jax.checkpoint")),
    RungSpec(
        RungKind.MICROBATCH, "microbatches", _microbatch_blocked, _apply_microbatch,
        _asks(lambda p: p.microbatches > 1, lambda p: f"microbatch({p.microbatches})"),
        plan_aware=True, axis=Axis.COUNT, repeatable=True, splits_batch=True),
    RungSpec(
        RungKind.OFFLOAD, "offload_optimizer", _offload_blocked,
        lambda rung, plan, facts, sizing: (plan.added(rung.name, offload_optimizer=True), ""),
        _asks(lambda p: p.offload_optimizer, lambda p: "offloading the optimizer state"),
        saving=lambda facts: facts.offload_bytes, plan_aware=True, axis=Axis.OFFLOAD,
        unseen=("the step's optimizer update was not seen: the guard follows "
                "TrainState.apply_gradients and nnx.Optimizer.update; for a bare tx.update "
                "call, update with hbm_guard.offload_aware(tx)")),
    RungSpec(
        RungKind.DTYPE, "compute_dtype", _dtype_blocked,
        lambda rung, plan, facts, sizing: (plan.added(rung.name, compute_dtype=rung.dtype), ""),
        _asks_dtype, plan_aware=True),
    RungSpec(RungKind.COMPILER_OPTIONS, "compiler_options", _options_blocked, _apply_options,
             _asks_options),
)}
assert set(SPECS) == set(RungKind), "every kind of rung has its spec"

SEARCHED = tuple(kind for kind, spec in SPECS.items() if spec.axis is not Axis.NONE)


def applies(rung: Rung, plan: Plan, facts: StepFacts, max_class: RungClass) -> Blocked:
  """None if the rung can be applied to `plan`; else (kind, why not)."""
  spec = SPECS[rung.kind]
  if CLASSES.index(rung.semantic_class) > CLASSES.index(max_class):
    return SkipKind.WITHHELD, (f"withheld: class '{rung.semantic_class}' is above the "
                               f"allowed '{max_class}' (allow it with max_class=...)")
  if spec.splits_batch and facts.auto_refused:
    return SkipKind.NOT_PLAN_AWARE, (
        f"the batch was not split automatically: {facts.auto_refused} (split it yourself "
        f"with hbm_guard.value_and_grad where that is what you want)")
  if spec.plan_aware and not facts.reads(spec.plan_field):
    if facts.gradient_seen and spec.unseen:
      return SkipKind.NOT_PLAN_AWARE, spec.unseen
    return SkipKind.NOT_PLAN_AWARE, (
        "the step is not plan-aware for this rung: no jax.value_and_grad / jax.grad / "
        "nnx.value_and_grad call was seen in the traced step (build it with hbm_guard's "
        "helpers, e.g. hbm_guard.value_and_grad / integrations.flax remat)")
  return spec.blocked(rung, plan, facts)


def apply(rung: Rung, plan: Plan, facts: StepFacts, rec: record_lib.E1000Record | None,
          temp_bytes: int | None, measured: Sequence[tuple[int, int]] = ()
          ) -> tuple[Plan | None, str]:
  """The plan one step up this rung, or (None, why not)."""
  return SPECS[rung.kind].apply(rung, plan, facts, Sizing(rec, temp_bytes, tuple(measured)))


def saving_bound(rung: Rung, facts: StepFacts) -> int | None:
  """Most bytes a rung can save, when that is known before compiling."""
  return SPECS[rung.kind].saving(facts)


_fmt = diagnose.format_bytes
