"""What the search knows, as one frozen value, and the pure updates that observations make.

Figures are in probe units (a probe's bytes); `scale` turns them into real bytes. Every
field changes only through a function here, each returning a new state."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.search import tuning

Plan = plan_lib.Plan


def program(plan: Plan) -> Plan:
  """`plan.program`: plans compare by what they do, not by their rungs' names."""
  return plan.program


def with_rungs(plan: Plan, base: Plan) -> Plan:
  """Names the rungs a chosen plan applies, for the report."""
  names = [name for name, _ in plan.field_rungs()]
  extra = [r for r in base.rungs if r not in names]
  return dataclasses.replace(plan, rungs=tuple(names + extra))


@dataclasses.dataclass(frozen=True)
class Probe:
  """One figure the search read: a probe, or a real compile made beside the probes."""
  plan: Plan
  need_bytes: int | None  # what the plan needs by it (None: it could not tell)
  seconds: float
  compiled: bool = False  # a real compile at the capacity, made beside the probes

  def to_dict(self) -> dict[str, Any]:
    d = {"plan": self.plan.describe(), "rungs": list(with_rungs(self.plan, self.plan).rungs),
         "need_bytes": self.need_bytes, "seconds": round(self.seconds, 3)}
    if self.compiled:
      d["compiled"] = True
    return d


@dataclasses.dataclass(frozen=True)
class SearchState:
  """Everything one fit's search has measured and concluded."""
  capacity: int
  exact: bool = False  # a probe is a full compile whose peak is held against the capacity
  headroom: float = tuning.HEADROOM
  scale: float = 1.0  # real need / probe figure: the prior, then the largest measured
  ratios: tuple[float, ...] = ()
  needs: Mapping[Plan, int | None] = dataclasses.field(default_factory=dict)  # measured
  predicted: Mapping[Plan, int] = dataclasses.field(default_factory=dict)  # by the model
  real: Mapping[Plan, int] = dataclasses.field(default_factory=dict)  # failed compiles'
  failed: frozenset[Plan] = frozenset()
  compiled: frozenset[Plan] = frozenset()  # compiled beside the probes
  fit_by_compile: frozenset[Plan] = frozenset()  # of those, the ones that fit
  probes: tuple[Probe, ...] = ()
  compile_seconds: tuple[float, ...] = ()
  dear: bool = False  # probes cost about what a compile does; once so, so for the fit
  data_parallel_failed: bool = False  # a data-parallel plan its probe said fits did not
  unmeasured: frozenset[int] = frozenset()  # microbatch counts a probe could not measure
  state_bytes: int = 0  # what donation could alias away (the step's facts)
  optimistic_tried: bool = False  # the probe's own figure, unscaled, was tried once

  def fits(self, need: int | None) -> bool:
    """Whether a figure in probe units fits: exactly, or scaled below the headroom."""
    if need is None:
      return False
    if self.exact:
      return need <= self.capacity
    return need * self.scale <= self.headroom * self.capacity

  def figure(self, plan: Plan) -> int | None:
    """A plan's measured or modelled figure, if there is one."""
    plan = program(plan)
    return self.needs[plan] if plan in self.needs else self.predicted.get(plan)


def _dear(state: SearchState) -> bool:
  """Whether probes are dear: latched once true (a fit's probes were made at one effort,
  and compare). Before any probe, a failed compile this slow says its probes will be."""
  if state.dear or not state.compile_seconds:
    return state.dear
  if not state.probes:
    return max(state.compile_seconds) >= tuning.DEAR_COMPILE_SECONDS
  mean = sum(p.seconds for p in state.probes) / len(state.probes)
  return mean >= max(tuning.DEAR_PROBE_MIN_SECONDS,
                     tuning.DEAR_PROBE_RATIO * max(state.compile_seconds))


def observe_probe(state: SearchState, plan: Plan, need: int | None,
                  seconds: float) -> SearchState:
  plan = program(plan)
  return dataclasses.replace(state, needs={**state.needs, plan: need},
                             probes=state.probes + (Probe(plan, need, seconds),))


def observe_beside(state: SearchState, plan: Plan, need: int | None, seconds: float,
                   fits: bool) -> SearchState:
  """A real compile made beside the probes: its figure is the plan's own."""
  plan = program(plan)
  state = dataclasses.replace(
      state, needs={**state.needs, plan: need}, compiled=state.compiled | {plan},
      probes=state.probes + (Probe(plan, need, seconds, compiled=True),))
  if fits:
    return dataclasses.replace(state, fit_by_compile=state.fit_by_compile | {plan})
  return _failed(state, plan, need)


def _failed(state: SearchState, plan: Plan, real_bytes: int | None) -> SearchState:
  real = {**state.real, plan: real_bytes} if real_bytes else state.real
  return dataclasses.replace(state, failed=state.failed | {plan}, real=real)


def observe_compile(state: SearchState, plan: Plan, real_bytes: int | None, fits: bool,
                    seconds: float | None = None) -> SearchState:
  """A climb's compile: its seconds say whether probes will be dear, and its figure
  recalibrates the scale from probe to real."""
  plan = program(plan)
  if seconds:
    state = dataclasses.replace(state, compile_seconds=state.compile_seconds + (seconds,))
    if seconds >= tuning.DEAR_COMPILE_SECONDS and not state.ratios:
      state = dataclasses.replace(state,
                                  scale=min(state.scale, tuning.LARGE_PROGRAM_PROBE_SCALE))
  if not fits:
    state = _failed(state, plan, real_bytes)
  probe = state.needs.get(plan)
  if plan in state.compiled:
    return settle(state)  # its figure is the compile's own: no probe to calibrate
  if plan.shard_batch and not fits:
    # Gathering each layer's parameters whole is what libtpu's early check sees least of
    # (a probe read 1.15 MiB where the compile needed 3.07): its ratio would condemn every
    # other plan. Kept out, and the batch is sharded no more in this fit.
    return settle(dataclasses.replace(state, data_parallel_failed=True))
  if real_bytes and probe and not (fits and real_bytes / probe < 1.0):
    # A fit's ratio below 1 says nothing about how low probes run: kept out.
    ratios = state.ratios + (real_bytes / probe,)
    state = dataclasses.replace(state, ratios=ratios, scale=max(ratios))
  return settle(state)


def settle(state: SearchState) -> SearchState:
  """The state with `dear` decided from what it holds now."""
  dear = _dear(state)
  return state if dear == state.dear else dataclasses.replace(state, dear=dear)


def known(state: SearchState, plan: Plan, need: int | None) -> SearchState:
  """A figure measured already (the failed attempt's own), so it is not probed again."""
  plan = program(plan)
  if plan in state.needs:
    return state
  return dataclasses.replace(state, needs={**state.needs, plan: need})


def predicted(state: SearchState, plan: Plan, need: int) -> SearchState:
  return dataclasses.replace(state, predicted={**state.predicted, program(plan): need})


def unmeasured(state: SearchState, count: int) -> SearchState:
  return dataclasses.replace(state, unmeasured=state.unmeasured | {count})


def with_state_bytes(state: SearchState, state_bytes: int) -> SearchState:
  return dataclasses.replace(state, state_bytes=state_bytes)


def rescaled(state: SearchState, scale: float) -> SearchState:
  return dataclasses.replace(state, scale=scale)


def optimistic_tried(state: SearchState) -> SearchState:
  return dataclasses.replace(state, optimistic_tried=True)
