"""The one owner of the search's side effects: the probes and compiles it starts (threads,
futures), the clock, and the `SearchState` their figures update. Strategies ask it for
figures; it alone waits for them."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Sequence

from absl import logging

from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.search import model
from hbm_guard._src.search import state as state_lib
from hbm_guard._src.search import tuning
from hbm_guard._src.search.state import SearchState, program

Plan = plan_lib.Plan
ProbeReader = Callable[[], tuple[int | None, float]]  # waits for (figure, seconds)
CompileReader = Callable[[], tuple[int | None, float, bool]]  # (figure, seconds, fits)


class Driver:
  """Asks `probe(plan) -> bytes` and `flops(plan) -> float`, started through the optional
  `start_probes` (side by side), `start_compile` (a real compile beside the probes) and
  `stage_ahead` (a lowering ahead of a compile); holds what they say in `state`."""

  def __init__(self, probe: Callable[[Plan], int | None],
               flops: Callable[[Plan], float | None], capacity: int,
               scale: float = 1.0, *, exact: bool = False, headroom: float = tuning.HEADROOM,
               clock: Callable[[], float] = time.perf_counter,
               start_probes: Callable[[Sequence[Plan]], list[ProbeReader]] | None = None,
               side_by_side: bool = False,
               start_compile: Callable[[Plan], CompileReader] | None = None,
               width: int = 2,
               stage_ahead: Callable[[Plan], None] | None = None):
    self.state = SearchState(capacity=capacity, exact=exact, headroom=headroom, scale=scale)
    self._probe, self._flops, self._clock = probe, flops, clock
    self._start = start_probes
    self.side_by_side = side_by_side and start_probes is not None  # probes run in parallel
    self._start_compile = start_compile if self.side_by_side else None
    self._stage_ahead = stage_ahead if self._start_compile is not None else None
    self.width = max(1, width)  # probes, or a race's compiles, run side by side
    self._pending: dict[Plan, ProbeReader] = {}
    self._compiling: dict[Plan, CompileReader] = {}
    self._cost: dict[Plan, float | None] = {}

  # -- what the state says ----------------------------------------------------------------

  @property
  def scale(self) -> float:
    return self.state.scale

  @property
  def probes(self) -> tuple[state_lib.Probe, ...]:
    return self.state.probes

  @property
  def probes_are_dear(self) -> bool:
    """Whether a probe costs about what a compile does (then one per family must do)."""
    return self.state.dear

  @property
  def compiles_beside(self) -> bool:
    """Whether real compiles can start beside the probes (decisive plans, races)."""
    return self._start_compile is not None

  @property
  def can_stage_ahead(self) -> bool:
    return self._stage_ahead is not None

  @property
  def races(self) -> bool:
    """Whether candidates are compiled at the capacity, cheapest first, not probed: where
    a probe costs what a failing compile does and compiles run side by side."""
    return self.compiles_beside and self.state.dear

  def started(self, plan: Plan) -> bool:
    """Whether `plan` was probed or its probe is running."""
    return program(plan) in self.state.needs or program(plan) in self._pending

  def pending(self, plan: Plan) -> bool:
    """Whether `plan`'s probe was started and is not read yet."""
    return program(plan) in self._pending

  def compiling(self, plan: Plan) -> bool:
    return program(plan) in self._compiling

  def busy(self) -> int:
    """Compiles started beside the probes that still hold a core."""
    return sum(1 for read in self._compiling.values() if not _done(read))

  def cost(self, plan: Plan, offload_bytes: int) -> float:
    family = model.family_of(plan)
    if family not in self._cost:
      self._cost[family] = self._flops(family)
    return model.plan_cost(self._cost[family], plan, offload_bytes)

  def family_flops(self, family: Plan) -> float | None:
    self.cost(family, 0)
    return self._cost[model.family_of(family)]

  # -- observations ----------------------------------------------------------------------

  def update(self, fn: Callable[..., SearchState], *args: Any) -> None:
    """Applies a pure update of the state (state_lib's)."""
    self.state = state_lib.settle(fn(self.state, *args))

  def observe(self, plan: Plan, real_bytes: int | None, fits: bool,
              seconds: float | None = None) -> None:
    """A real compile of the climb's."""
    self.update(state_lib.observe_compile, plan, real_bytes, fits, seconds)

  @contextlib.contextmanager
  def unscaled(self):
    """Judges by the probes' own figures for a while; the calibrated scale after."""
    scale = self.state.scale
    self.update(state_lib.rescaled, 1.0)
    try:
      yield
    finally:
      self.update(state_lib.rescaled, scale)

  def known(self, plan: Plan, need: int | None) -> None:
    self.update(state_lib.known, plan, need)

  # -- figures -----------------------------------------------------------------------------

  def need(self, plan: Plan) -> int | None:
    """`plan`'s probe figure: measured once, waited for if started."""
    plan = program(plan)
    if plan not in self.state.needs:
      pending = self._pending.pop(plan, None)
      if pending is not None:
        need, seconds = pending()
      else:
        t0 = self._clock()
        need = self._probe(plan)
        seconds = self._clock() - t0
      logging.debug("hbm_guard: probe %s: %s bytes (%.1f s)", plan.describe(), need, seconds)
      self.update(state_lib.observe_probe, plan, need, seconds)
    return self.state.needs[plan]

  def figure(self, plan: Plan) -> int | None:
    """A plan's need in probe units: measured if it was, else modelled, else probed."""
    known = self.state.figure(plan)
    return known if known is not None or program(plan) in self.state.needs else self.need(plan)

  def prefetch(self, plans: Sequence[Plan]) -> None:
    """Starts probes of the plans not yet measured, to be read later: beside each other and
    beside the pricing, where the fit runs probes side by side. A plan a failure bounds out
    is not probed: nothing would read it."""
    todo = [p for p in dict.fromkeys(program(p) for p in plans)
            if not self.started(p) and not model.bounded_out(self.state, p)]
    if todo and self._start is not None:
      self._pending.update(zip(todo, self._start(todo)))

  def compile_beside(self, plan: Plan) -> bool:
    """Starts a real compile of `plan`, whose probe would only decide whether to compile it
    (where probes are cheap, and run side by side); whether it is compiling."""
    plan = program(plan)
    if (self._start_compile is None or self.state.dear or self.started(plan)
        or plan in self._compiling):
      return plan in self._compiling
    self._compiling[plan] = self._start_compile(plan)
    return True

  def start_compile(self, plan: Plan) -> None:
    """A race's compile at the capacity, unless one of `plan` was made or is running."""
    plan = program(plan)
    if plan not in self._compiling and plan not in self.state.compiled:
      self._compiling[plan] = self._start_compile(plan)

  def stage_ahead(self, plan: Plan) -> None:
    if self._stage_ahead is not None and not self.compiling(plan):
      self._stage_ahead(plan)

  def compiled_fits(self, plan: Plan) -> bool:
    """Waits for the compile started beside the probes: whether `plan` fits (then it is the
    compile the fit uses), recording its figure as real."""
    plan = program(plan)
    reader = self._compiling.pop(plan, None)
    if reader is not None:
      need, seconds, fits = reader()
      self.update(state_lib.observe_beside, plan, need, seconds, fits)
    return plan in self.state.fit_by_compile


def _done(read: Callable[[], Any]) -> bool:
  """Whether a compile started beside the probes has finished (unknown: taken as done)."""
  done = getattr(read, "done", None)
  return True if done is None else bool(done())
