"""Plans from outside are data: each may do only what the guard could have chosen itself.

A plan cache lives in shared checkpoint directories, and `plan=` takes files and reports
other people wrote. Before such a plan is used, every part of it must be something this
guard's own options allow: a rung of its ladder within `max_class` for each field it sets,
donation only of `state_argnums` and the user's own `donate_argnums`, and compiler
options only as the ladder's rungs define them. Anything else is an `UntrustedPlanError`
naming the first part that is not allowed.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from hbm_guard._src import errors
from hbm_guard._src import ladder as ladder_lib
from hbm_guard._src import plan as plan_lib

Kind, Class = ladder_lib.RungKind, ladder_lib.RungClass


def _allowed(rungs: Sequence[ladder_lib.Rung], max_class: Class) -> list[ladder_lib.Rung]:
  top = ladder_lib.CLASSES.index(max_class)
  return [r for r in rungs if ladder_lib.CLASSES.index(r.semantic_class) <= top]


def _refuse(source: str, what: str, kind: Kind, rungs: Sequence[ladder_lib.Rung],
            max_class: Class) -> errors.UntrustedPlanError:
  above = [r for r in rungs if r.kind == kind and r not in _allowed(rungs, max_class)]
  if above:
    why = (f"its rung {above[0].name!r} is of class '{above[0].semantic_class}', above "
           f"max_class='{max_class}'")
  else:
    why = "no rung of this guard's ladder does that"
  return errors.UntrustedPlanError(f"{source} asks for {what}: {why}.")


def check(plan: plan_lib.Plan, *, rungs: Sequence[ladder_lib.Rung], max_class: Class,
          donatable: Iterable[int] | None, source: str = "plan=") -> plan_lib.Plan:
  """`plan` if the options allow all of it (rung names it does not know dropped); else
  an UntrustedPlanError. `donatable`: argument positions that may be donated (None:
  not known yet, checked later against the call's arguments)."""
  allowed = _allowed(rungs, max_class)
  kinds = {r.kind for r in allowed}

  def need(kind: Kind, what: str, ok: bool = True):
    if kind not in kinds or not ok:
      raise _refuse(source, what, kind, rungs, max_class)

  if plan.donate_argnums:
    need(Kind.DONATE, f"donation of arguments {list(plan.donate_argnums)}")
    if donatable is not None:
      extra = sorted(set(plan.donate_argnums) - set(donatable))
      if extra:
        raise errors.UntrustedPlanError(
            f"{source} donates argument(s) {extra}, which are not among state_argnums or "
            f"donate_argnums ({sorted(set(donatable))}): the caller may still hold them.")
  if plan.shard_state:
    need(Kind.RESHARD, "resharding the state" + (" and the batch" if plan.shard_batch else ""))
  if plan.remat_policy is not None:
    policies = {p for r in allowed if r.kind is Kind.REMAT
                for p in (r.policies or ("nothing_saveable",))}
    need(Kind.REMAT, f"remat policy {plan.remat_policy!r}", plan.remat_policy in policies)
  if plan.microbatches > 1:
    need(Kind.MICROBATCH, f"microbatch({plan.microbatches})")
  if plan.offload_optimizer:
    need(Kind.OFFLOAD, "offloading the optimizer state")
  if plan.compute_dtype is not None:
    dtypes = {r.dtype for r in allowed if r.kind is Kind.DTYPE}
    need(Kind.DTYPE, f"compute dtype {plan.compute_dtype!r}", plan.compute_dtype in dtypes)
  options = {item for r in allowed if r.kind is Kind.COMPILER_OPTIONS for item in r.options}
  for name, value in plan.compiler_options:
    if not any(n == name and v == value and type(v) is type(value) for n, v in options):
      raise _refuse(source, f"compiler option {name}={value!r:.60}", Kind.COMPILER_OPTIONS,
                    rungs, max_class)
  names = {r.name for r in rungs}
  return dataclasses.replace(plan, rungs=tuple(r for r in plan.rungs if r in names))


def donatable(state_argnums: Iterable[int], user_donate: Iterable[int],
              nargs: int | None) -> frozenset[int] | None:
  """Positions a plan may donate; negative selectors resolved once `nargs` is known."""
  chosen = set(state_argnums) | set(user_donate)
  if nargs is None:
    return None if any(i < 0 for i in chosen) else frozenset(chosen)
  return frozenset(i % nargs for i in chosen if -nargs <= i < nargs)
