"""The plans a step may take: families (microbatch count aside) from the ladder's rungs,
the counts that divide the batch, and the order a search opens them in."""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.plans import rung_specs
from hbm_guard._src.plans import rungs as rungs_lib
from hbm_guard._src.search import model
from hbm_guard._src.search import tuning
from hbm_guard._src.search.state import program

Plan = plan_lib.Plan
Axis = rung_specs.Axis
PLANNED = rung_specs.SEARCHED  # the kinds the search opens; the rest are walked after it


def divisors(n: int | None, current: int = 1) -> list[int]:
  """The counts to search: those that divide the batch (the current one if unknown)."""
  return plan_lib.microbatch_counts(n, limit=tuning.MAX_MICROBATCHES) if n else [current]


def families(rungs: Sequence[rungs_lib.Rung], plan: Plan, facts: rungs_lib.StepFacts,
             max_class: rungs_lib.RungClass, data_parallel_failed: bool = False
             ) -> tuple[list[Plan], list[int], list[rungs_lib.Skip]]:
  """Candidate families and the counts to search, from the rungs this step can take. Free
  rungs are always on: they cost no compute."""
  base, skips = dataclasses.replace(plan, microbatches=1), []
  policies: list[str | None] = [plan.remat_policy]
  offloads = [plan.offload_optimizer]
  counts = [plan.microbatches]
  bare = dataclasses.replace(base, remat_policy=None, offload_optimizer=False)
  for rung in rungs:
    axis = rung_specs.SPECS[rung.kind].axis
    if axis is Axis.NONE:
      continue
    why = rung_specs.applies(rung, base if axis is Axis.FREE else bare, facts, max_class)
    if why is not None:
      if why[0] is not rungs_lib.SkipKind.ALREADY_APPLIED:
        skips.append(rungs_lib.Skip(rung.name, why[1], why[0]))
      continue
    match axis:
      case Axis.FREE:
        base, _ = rung_specs.apply(rung, base, facts, None, None)
      case Axis.POLICY:
        allowed = rung_specs.remat_policies(rung, facts)
        policies += [p for p in allowed if p not in policies]
      case Axis.OFFLOAD:
        offloads = [False, True]
      case Axis.COUNT:
        counts = divisors(facts.batch_size, plan.microbatches)
        if facts.batch_size and not any(k > plan.microbatches for k in counts):
          skips.append(rungs_lib.Skip(rung.name, (
              f"batch {facts.batch_size} has no divisor from {plan.microbatches + 1} to "
              f"{tuning.MAX_MICROBATCHES}: no microbatch count splits it evenly (a prime "
              "batch)"), rungs_lib.SkipKind.NOT_APPLICABLE))
  return _with_shards(base, policies, offloads, facts, data_parallel_failed), counts, skips


def _with_shards(base: Plan, policies, offloads, facts: rungs_lib.StepFacts,
                 data_parallel_failed: bool) -> list[Plan]:
  """The families: each policy x offload, and with the state sharded, the batch sharded
  too (data parallel) where it divides over the chips. A choice, not a rule: it gathers
  each layer's parameters whole, which a model of few large layers may not afford."""
  batch = facts.batch_size
  shards = [base.shard_batch]
  if (base.shard_state and not base.shard_batch and batch and facts.num_devices > 1
      and batch % facts.num_devices == 0 and not data_parallel_failed
      and not facts.user_layout):
    shards = [False, True]
  return [dataclasses.replace(base, remat_policy=policy, offload_optimizer=offload,
                              shard_batch=shard_batch)
          for policy in policies for offload in dict.fromkeys(offloads) for shard_batch in shards]


def likely_cost(family: Plan) -> tuple[bool, bool, bool]:
  """Orders families before their flops are counted: remat recomputes, offload moves
  bytes, a batch sharded over the chips divides the work."""
  return (family.remat_policy is not None, family.offload_optimizer, not family.shard_batch)


def anchor_count(counts: Sequence[int]) -> int:
  """The count a family's second figure is probed at: the fewest that splits the batch."""
  return counts[1] if len(counts) > 2 and counts[0] == 1 else counts[0]


def first_probes(family: Plan, counts: Sequence[int], dear: bool, anchored: bool
                 ) -> list[Plan]:
  """A family's first two probes: its most microbatches, and where probes are dear the
  count its model is anchored at (unless a failed compile or a probe started already
  anchors it), else the bisection's first midpoint."""
  if len(counts) < 2:
    return [model.at(family, k) for k in counts]
  if not dear:
    return [model.at(family, counts[-1]), model.at(family, counts[(len(counts) - 1) // 2])]
  return [model.at(family, counts[-1])] + (
      [] if anchored else [model.at(family, anchor_count(counts))])


def opening(rungs: Sequence[rungs_lib.Rung], plan: Plan, facts: rungs_lib.StepFacts,
            max_class: rungs_lib.RungClass, dear: bool) -> tuple[list[Plan], list[Plan]]:
  """What a search does first if `plan` (a fit's first) fails: the probes it starts, of
  the likely cheapest family, and the other families it prices. Made while that compile
  runs, they are ready if it fails."""
  fams, counts, _ = families(rungs, plan, facts, max_class)
  if not fams:
    return [], []
  family = min(fams, key=likely_cost)
  anchored = (model.family_of(plan) == program(family) and plan.microbatches < counts[-1])
  others = sorted((f for f in fams if f != family), key=likely_cost)
  return first_probes(family, counts, dear, anchored), others


def race_opening(others: Sequence[Plan], counts: Sequence[int],
                 family_flops: Callable[[Plan], float | None], width: int,
                 offload_bytes: int) -> list[Plan]:
  """The compiles a race would start first that a failure's figure does not bear on: the
  cheapest `width` plans of the families other than the failed plan's own, dearest first
  (the order the race starts them). Lowered while that compile runs, they are ready."""
  plans = [model.at(f, k) for f in others for k in counts]
  price = lambda p: model.plan_cost(family_flops(model.at(p, 1)), p, offload_bytes)  # noqa: E731
  return list(reversed(sorted(plans, key=price)[:width]))
