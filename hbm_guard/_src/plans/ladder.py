"""The fallback ladder: its rungs in order, read from JSON, and the choice of the next plan.

The measure of a ladder is how few compiles it needs. So the next plan is not simply the
next rung: a rung whose saving has a known bound that cannot close the gap on its own is
folded into the next compile when it is free (donation, resharding) and skipped otherwise;
the microbatch count is computed from the numbers, not found by halving. What each kind of
rung does is its spec (`rung_specs`); this module only orders and walks them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import json
import os
from typing import Any, Mapping, Sequence

from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.plans.rung_specs import SPECS, Axis, applies, apply, saving_bound
from hbm_guard._src.plans.rungs import Rung, RungClass, Skip, SkipKind, StepFacts
from hbm_guard._src.record import diagnose
from hbm_guard._src.record import errors
from hbm_guard._src.record import record as record_lib


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
    spec = SPECS[rung.kind]
    if not spec.repeatable and rung.name in candidate.rungs:
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
      if spec.axis is Axis.FREE:  # costs no compute: worth carrying along
        folded += bound
        candidate = new
        skips.append(Skip(rung.name, f"saves at most {_fmt(bound)} of the {_fmt(gap)} "
                                     "needed: carried into the next compile, not compiled "
                                     "alone", SkipKind.FOLDED))
        continue
      skips.append(Skip(rung.name, f"saves at most {_fmt(bound)} of the {_fmt(gap)} needed",
                        SkipKind.CANNOT_CLOSE_GAP))
      continue
    return new, skips
  if candidate != plan:  # only free rungs were left: still worth one compile
    return candidate, skips
  return None, skips


_fmt = diagnose.format_bytes
