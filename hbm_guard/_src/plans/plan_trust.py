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

from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.plans import rung_specs
from hbm_guard._src.plans import rungs as rungs_lib
from hbm_guard._src.record import errors

Kind, Class = rungs_lib.RungKind, rungs_lib.RungClass


def _allowed(rungs: Sequence[rungs_lib.Rung], max_class: Class) -> list[rungs_lib.Rung]:
  top = rungs_lib.CLASSES.index(max_class)
  return [r for r in rungs if rungs_lib.CLASSES.index(r.semantic_class) <= top]


def _refuse(source: str, what: str, kind: Kind, rungs: Sequence[rungs_lib.Rung],
            max_class: Class) -> errors.UntrustedPlanError:
  above = [r for r in rungs if r.kind == kind and r not in _allowed(rungs, max_class)]
  if above:
    why = (f"its rung {above[0].name!r} is of class '{above[0].semantic_class}', above "
           f"max_class='{max_class}'")
  else:
    why = "no rung of this guard's ladder does that"
  return errors.UntrustedPlanError(f"{source} asks for {what}: {why}.")


def check(plan: plan_lib.Plan, *, rungs: Sequence[rungs_lib.Rung], max_class: Class,
          donatable: Iterable[int] | None, source: str = "plan=") -> plan_lib.Plan:
  """`plan` if the options allow all of it (rung names it does not know dropped); else
  an UntrustedPlanError. `donatable`: argument positions that may be donated (None:
  not known yet, checked later against the call's arguments)."""
  allowed = _allowed(rungs, max_class)
  kinds = {r.kind for r in allowed}

  for kind, spec in rung_specs.SPECS.items():
    for what, ok in spec.asks(plan, [r for r in allowed if r.kind is kind]):
      if kind not in kinds or not ok:
        raise _refuse(source, what, kind, rungs, max_class)
  if plan.donate_argnums and donatable is not None:
    extra = sorted(set(plan.donate_argnums) - set(donatable))
    if extra:
      raise errors.UntrustedPlanError(
          f"{source} donates argument(s) {extra}, which are not among state_argnums or "
          f"donate_argnums ({sorted(set(donatable))}): the caller may still hold them.")
  names = {r.name for r in rungs}
  return dataclasses.replace(plan, rungs=tuple(r for r in plan.rungs if r in names))


def donatable(state_argnums: Iterable[int], user_donate: Iterable[int],
              nargs: int | None) -> frozenset[int] | None:
  """Positions a plan may donate; negative selectors resolved once `nargs` is known."""
  chosen = set(state_argnums) | set(user_donate)
  if nargs is None:
    return None if any(i < 0 for i in chosen) else frozenset(chosen)
  return frozenset(i % nargs for i in chosen if -nargs <= i < nargs)
