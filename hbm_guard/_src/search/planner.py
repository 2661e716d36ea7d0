"""Choosing the next plan after one failed: the search's entry point (docs/planner.md).

The planned rungs (donation, resharding, remat, offload, microbatching) are searched as
families priced by compute, each family's fewest fitting microbatches found by probes
(`search.cheapest`); where none is predicted to fit, the ladder's remaining rungs are
walked from the plan that came closest (`search.ladder_walk`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.plans import rungs as rungs_lib
from hbm_guard._src.search import cheapest
from hbm_guard._src.search import hint
from hbm_guard._src.search import ladder_walk
from hbm_guard._src.search import model
from hbm_guard._src.search import space
from hbm_guard._src.search import state as state_lib
from hbm_guard._src.search.driver import Driver
from hbm_guard._src.search.state import Probe, program, with_rungs

Plan = plan_lib.Plan
__all__ = ["Driver", "Planning", "Probe", "next_plan", "program", "with_rungs"]


@dataclasses.dataclass(frozen=True)
class Planning:
  """Why the search chose the next plan: the probes it made for it, at what scale."""
  chosen: str | None  # the next plan, described; None: nothing left to try
  why: str
  probes: tuple[Probe, ...] = ()
  scale: float = 1.0
  predicted_bytes: int | None = None

  def to_dict(self) -> dict[str, Any]:
    d = {"chosen": self.chosen, "why": self.why, "probes": [p.to_dict() for p in self.probes],
         "scale": round(self.scale, 3)}
    if self.predicted_bytes is not None:
      d["predicted_bytes"] = self.predicted_bytes
    return d


def _optimistic(driver: Driver, fams: Sequence[Plan], counts: Sequence[int],
                offload_bytes: int) -> cheapest.Choice | None:
  """Once per fit, before XLA's flags (a last resort): the cheapest plan the probe's own
  figure says fits. Probes run low, but not always by the margin assumed."""
  if driver.state.scale <= 1.0 or driver.state.optimistic_tried or driver.races:
    return None
  driver.update(state_lib.optimistic_tried)  # once: a miss here means the margin is real
  with driver.unscaled():
    choice = cheapest.choose(driver, fams, counts, offload_bytes)
  if choice is None:
    return None
  return dataclasses.replace(choice, why="fits by the probe's own figure (unscaled); "
                             + choice.why)


def next_plan(driver: Driver, rungs: Sequence[rungs_lib.Rung], plan: Plan,
              facts: rungs_lib.StepFacts, rec, max_class: rungs_lib.RungClass
              ) -> tuple[Plan | None, list[rungs_lib.Skip], Planning]:
  """The search's choice after `plan` failed; the ladder's remaining rungs (XLA flags,
  dtype) from the plan that came closest when no planned plan is predicted to fit."""
  n_probes = len(driver.probes)
  driver.update(state_lib.with_state_bytes, facts.state_bytes)
  if plan.shard_batch and driver.state.data_parallel_failed:
    plan = dataclasses.replace(plan, shard_batch=False)  # back to the features split
  fams, counts, skips = space.families(rungs, plan, facts, max_class,
                                       driver.state.data_parallel_failed)
  choice = (cheapest.choose(driver, fams, counts, facts.offload_bytes, race=True)
            or _optimistic(driver, fams, counts, facts.offload_bytes))
  if choice is not None and program(choice.plan) != program(plan):
    nxt = with_rungs(choice.plan, plan)
    chosen, why, predicted = choice.plan.describe(), choice.why, choice.predicted_bytes
  else:
    closest = _closest(driver, fams, plan)
    nxt, more = ladder_walk.walk(driver, rungs, closest, space.PLANNED, facts, rec, max_class)
    skips += more
    chosen, predicted = (nxt.describe() if nxt else None), None
    why = ("no planned plan is predicted to fit; the ladder's remaining rungs from the "
           f"closest plan ({closest.describe()})")
  why = "; ".join([why, *model.remat_notes(driver.state)])
  return nxt, skips, Planning(chosen, why, driver.probes[n_probes:], driver.scale, predicted)


def _closest(driver: Driver, fams: Sequence[Plan], plan: Plan) -> Plan:
  """The measured plan that needs least; else the free rungs on."""
  measured = [(p, n) for p, n in driver.state.needs.items() if n is not None]
  closest = (min(measured, key=lambda pn: pn[1])[0] if measured else
             model.at(fams[0], plan.microbatches) if fams else plan)
  return with_rungs(closest, plan)


def above(driver: Driver, rungs: Sequence[rungs_lib.Rung], plan: Plan,
          facts: rungs_lib.StepFacts, max_class: rungs_lib.RungClass
          ) -> tuple[str, cheapest.Choice] | None:
  """When nothing allowed fits: the first class above `max_class` with a plan predicted to
  fit, by the figures of the search that priced the climb and a few probes more
  (`search.hint`). A class that adds no planned rung is not searched again."""
  classes = rungs_lib.CLASSES
  searched = space.families(rungs, plan, facts, max_class)[:2]
  for klass in classes[classes.index(max_class) + 1:]:
    fams, counts, _ = space.families(rungs, plan, facts, klass)
    if (fams, counts) == searched:
      continue
    choice = hint.wider(driver, fams, counts, facts.offload_bytes)
    if choice is not None:
      return klass, choice
  return None
