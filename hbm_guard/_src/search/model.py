"""Pure judgements of the search: what real figures rule out, need(k) ~ F + P / k, and the
price of a plan. Each reads a `SearchState` and changes nothing."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.record import diagnose as diagnose_lib
from hbm_guard._src.search import tuning
from hbm_guard._src.search.state import SearchState, program

Plan = plan_lib.Plan


def at(family: Plan, k: int) -> Plan:
  return dataclasses.replace(family, microbatches=k)


def family_of(plan: Plan) -> Plan:
  return at(program(plan), 1)


def _bare(plan: Plan) -> Plan:
  """The plan with donation aside: it only lowers the need."""
  return dataclasses.replace(family_of(plan), donate_argnums=())


def lower_bound(state: SearchState, plan: Plan) -> float:
  """What `plan` needs at least by the real compiles of its family (donation aside):
  infinite where one failed at as many microbatches or more (split; unsplit is another
  program), else the state once plus what is left of a figure, divided by the count
  (donation aliases the state's output at most; splitting divides activations). 368M: the
  plain step's 81.19 GiB bounds microbatch(2) at 40.6 (a probe read 62). Not strict
  (BOUND_SLACK): splitting can cut more than activations."""
  k, held = plan.microbatches, state.state_bytes
  if any(family_of(f) == family_of(plan) and (f.microbatches == k or f.microbatches > k > 1)
         for f in state.failed):
    return float("inf")
  bound = 0.0
  for failed, need in state.real.items():
    if _bare(failed) == _bare(plan):
      bound = max(bound, held + max(0, need - 2 * held) * failed.microbatches / k)
  return bound


def bounded_out(state: SearchState, plan: Plan) -> bool:
  """Whether a real failed compile of `plan`'s family bounds it more than BOUND_SLACK over
  the capacity: then it is not probed."""
  return not state.exact and lower_bound(state, plan) > tuning.BOUND_SLACK * state.capacity


def cannot_close(state: SearchState, plan: Plan) -> str | None:
  """Why `plan` cannot fit, judged without a probe from a real compile of a plan it
  differs from only by XLA's flags and donation (FLAGS_FLOOR); None if it may."""
  bare = lambda p: dataclasses.replace(  # noqa: E731
      program(p), donate_argnums=(), compiler_options=())
  figures = [n for p, n in state.real.items() if bare(p) == bare(plan)]
  if not figures or state.exact:
    return None
  floor = tuning.FLAGS_FLOOR * (min(figures) - state.state_bytes)
  if floor <= state.capacity:
    return None
  fmt = diagnose_lib.format_bytes
  return (f"estimated: {plan.describe()} needs at least {fmt(int(floor))} of "
          f"{fmt(state.capacity)} (XLA's flags and donation cut a failed compile's "
          f"{fmt(min(figures))} by a third at most where measured; half is assumed; "
          f"search='ladder' compiles them anyway)")


def remat_no_help(state: SearchState, plan: Plan) -> tuple[Plan, int, int] | None:
  """Where `plan`'s remat policy, on this step, needed no less than the same plan without
  it at one microbatch count, by real compiles: (that plan, its figure, the figure
  without remat). Checkpointing each layer then keeps more live than it frees (saved
  outputs, barriers against XLA's own scheduling), and the family is not searched further:
  a 1B decoder LM needed 25.23 GiB with layer_remat(dots), 20.19 without. None if it may
  help."""
  if plan.remat_policy is None:
    return None
  for measured, need in state.real.items():
    if family_of(measured) != family_of(plan):
      continue
    bare = dataclasses.replace(measured, remat_policy=None)
    # without remat, as compiled, or undonated (donation only lowers the need)
    without = [state.real.get(program(p))
               for p in (bare, dataclasses.replace(bare, donate_argnums=()))]
    without = next((n for n in without if n is not None), None)
    if without is not None and need >= without:
      return measured, need, without
  return None


def ruled_out(state: SearchState, plan: Plan) -> bool:
  """Whether real figures say `plan` cannot fit: it failed, a failure of its family bounds
  it, one that differs only by flags does, or its remat was seen not to help."""
  return (program(plan) in state.failed or bounded_out(state, plan)
          or cannot_close(state, plan) is not None or remat_no_help(state, plan) is not None)


def remat_notes(state: SearchState) -> list[str]:
  """Why a remat family was not searched further, for the report."""
  fmt, notes = diagnose_lib.format_bytes, []
  for measured in sorted(state.real, key=lambda p: p.describe()):
    seen = remat_no_help(state, measured)
    if seen is not None and seen[0] == measured:
      notes.append(f"{measured.describe()} needed {fmt(seen[1])}, not less than "
                   f"{fmt(seen[2])} without remat: its family is not searched further")
  return notes


def anchors(state: SearchState, family: Plan, k1: int) -> list[tuple[int, int]]:
  """This family's failed compiles below `k1` microbatches: (count, real figure)."""
  return sorted((p.microbatches, n) for p, n in state.real.items()
                if family_of(p) == program(family) and p.microbatches < k1)


def says_nothing_of_fewer(state: SearchState, top: Plan, need: int | None) -> bool:
  """Whether a family's most microbatches say nothing of fewer, which are then searched:
  no figure (the trace does not split the batch there), or a figure over the capacity and
  above a real compile of fewer microbatches (a one-example microbatch padded by TPU
  tiling: a ViT read 2.12 GiB at 64 of 64, 671 MiB at 32, 1.66 GiB unsplit)."""
  if top.microbatches < 2:
    return False
  if need is None:
    return True
  bare = lambda p: dataclasses.replace(program(p), donate_argnums=(), microbatches=1)  # noqa: E731
  return not state.fits(need) and any(
      n < need for p, n in state.real.items()
      if bare(p) == bare(top) and p.microbatches < top.microbatches)


def two_point(k0: int, n0: float, k1: int, n1: float) -> tuple[float, float]:
  """(F, P) of need(k) = F + P / k through (k0, n0) and (k1, n1), P at least 0."""
  per = max(0.0, (n0 - n1) / (1 / k0 - 1 / k1))
  return n1 - per / k1, per


def next_likely_fails(state: SearchState, family: Plan, counts: Sequence[int],
                      hi: int) -> bool:
  """Whether the count below a bound the probes found (`hi`) is predicted not to fit, by
  F + P / k through the bound's figure and the nearest measured count below that one
  (between the two: a mixture of experts' 16.60 GiB at 4 and 10.08 at 16 put 8 at 12.2,
  over once scaled), else the family's top (the README job: 67.34 MiB at 8 and 61.15 at
  64 predict 74.4 at 4, over once scaled)."""
  if hi <= 0:
    return False
  figure = lambda i: state.needs.get(program(at(family, counts[i])))  # noqa: E731
  n0 = figure(hi)
  below = next(((counts[i], figure(i)) for i in range(hi - 2, -1, -1)
                if figure(i) is not None), None)
  other = below or ((counts[-1], figure(len(counts) - 1)) if hi < len(counts) - 1 else None)
  if n0 is None or other is None or other[1] is None:
    return False  # the top alone says little of where the answer is
  fixed, per = two_point(counts[hi], n0, *other)
  return not state.fits(int(fixed + per / counts[hi - 1]))


def points(state: SearchState, plan: Plan) -> list[tuple[int, int]]:
  """(count, figure) below `plan`'s count that need(k) ~ F + P / k is drawn through: its
  family's real failures and, at counts without one, where the family donates, the
  undonated family's less the state (all that donation can alias): an encoder-decoder's
  plain step failed at 40.01 GiB with 5.75 of state, so its donated family is put at 34.26
  or more unsplit."""
  family = family_of(plan)
  own = dict(anchors(state, family, plan.microbatches))
  if family.donate_argnums:
    undonated = dataclasses.replace(family, donate_argnums=())
    for k, need in anchors(state, undonated, plan.microbatches):
      own.setdefault(k, max(0, need - state.state_bytes))
  return sorted(own.items())


def line_fits(state: SearchState, plan: Plan) -> bool:
  """Whether F + P / k through the two `points` nearest below `plan`'s count puts it under
  the capacity. A 1B decoder LM: 20.19 GiB at 1 and 17.18 at 2 put
  microbatch(4) at 15.68 of 15.75, and it fit."""
  below = points(state, plan)
  if len(below) < 2 or plan.microbatches < 2:
    return False
  (k0, n0), (k1, n1) = below[-2:]
  fixed, per = two_point(k0, n0, k1, n1)
  return fixed + per / plan.microbatches <= state.capacity


def plan_cost(family_flops: float | None, plan: Plan, offload_bytes: int) -> float:
  """A plan's compute: its family's flops, +1% per extra microbatch, plus the host
  transfers of offload."""
  cost = (family_flops or 1.0) * (1 + tuning.MICROBATCH_OVERHEAD * (plan.microbatches - 1))
  if plan.offload_optimizer:
    cost += 2 * offload_bytes * tuning.FLOPS_PER_HOST_BYTE
  return cost
