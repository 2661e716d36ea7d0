"""Choosing the next plan by cheap probes, not by walking the ladder.

After a plan fails, the planner prices candidate plans: the free rungs (donation,
resharding) always on; a remat policy; host offload of the optimizer state; a microbatch
count that divides the batch. A probe is a compile given a tiny HBM limit: libtpu's early
check fails it in seconds and prints what the program needs (arguments included). On a
backend without that check (capacity= on CPU) a probe is a full compile, which is cheap
there. Need falls with the microbatch count, so the smallest count predicted to fit is
found by bisection over the divisors of the batch, per family (remat policy x offload),
or where probes are dear by two figures of `F + P / k`; a family's first two probes are
started together, beside the pricing. Where a failure's figure rules out the lower half
of the counts, the fewest it leaves is probed first (the top beside it only where a core
is left over): if it fits, it is the answer, and the compile that answer makes decisive in
the next family is lowered while it is probed. Compute cost (the step's flop count, +1% per extra
microbatch, plus the host transfers of offload) orders the families; the cheapest plan
predicted to fit is compiled for real, and every real figure recalibrates the probe's scale.
Where probes are dear and compiles run side by side, nothing is probed: the cheapest
candidates are compiled at the capacity, two at a time (a race; `Planner._race`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

from absl import logging

from hbm_guard._src import diagnose as diagnose_lib
from hbm_guard._src import ladder as ladder_lib
from hbm_guard._src import plan as plan_lib

HEADROOM = ladder_lib.HEADROOM
FLOPS_PER_HOST_BYTE = 4000.0  # host link vs compute on a TPU: ~25 GB/s against ~100 TFLOP/s
MICROBATCH_OVERHEAD = 0.01  # per extra microbatch: a sequential loop, weights read again
MAX_MICROBATCHES = 256
PROBE_SCALE = 1.3  # before any real compile: libtpu's early figure ran 0.67-0.95 of the real need
# At real sizes libtpu's early check comes after the HLO passes, so a probe costs about what a
# compile does (95-336 s against 44-110 s for a 368M-parameter LM on v5e:1x1). Probes this
# dear are spent sparingly: two figures per family predict the count (need ~ F + P / k).
# A program whose failed compile took this long is large, and there libtpu's early figure
# runs closer to the real need: 1.125 of it at 937M parameters (v5e:2x2, 9.11 -> 10.25 GiB),
# and above it at 368M (#17: 1.15-1.20 x the need). The prior 1.3 there ruled out plans
# that fit (data parallel without microbatching at 937M: probed 12.78 GiB, 14.38 real).
LARGE_PROGRAM_PROBE_SCALE = 1.15
DEAR_PROBE_RATIO = 0.5  # a probe costing this much of a compile, or more, is dear
DEAR_PROBE_MIN_SECONDS = 10.0  # below this, probing is cheap whatever a compile costs
DEAR_COMPILE_SECONDS = 10.0  # a failed compile this slow: its probes will be dear too
# XLA's remat flags (all of them, donated) cut a failed compile's own figure to 0.67-1.0 of
# it in every program measured: transformers and an MLP of 18-192 MiB of state at 56-531 MiB
# (libtpu, v5e), and 0.74-0.78 for a 368M-parameter LM (19.52 -> 15.26 GiB at batch 16,
# 42.36 -> 31.15 at 64). A plan that differs from a failed one only by flags and donation is
# taken to need at least half of its figure (less the state, which donation may alias):
# where that is over the capacity, it is not probed (at 368M a probe of the flags took
# 87-168 s, a failing compile 20).
FLAGS_FLOOR = 0.5
# A failed unsplit compile's figure can overstate what a split leaves: the README job's
# plain step failed at 682.37 MiB, which "bounds" microbatch(8) at 113 MiB, and that plan
# fits in 96 (1.18x). At 368M every such bound held (5 of 5, at 0.43-0.75 of the need).
# A race believes a bound only this far over the capacity: microbatch(4) of the 368M plain
# step, bounded at 22.4 GiB of 15.75 (1.42x), is not compiled; it needs ~33.
BOUND_SLACK = 1.3
# A family's top counts that say nothing of fewer (Planner._passed_over), searched below
# before the family is given up: a microbatch of one example is the case seen.
MAX_PASSED_OVER = 2
# (bound, this family's unresolved plans) -> whether a later family's compile was started
_Ahead = Callable[[plan_lib.Plan, Sequence[plan_lib.Plan]], bool]


@dataclasses.dataclass(frozen=True)
class Probe:
  plan: plan_lib.Plan
  need_bytes: int | None  # what the probe says the plan needs (None: it could not tell)
  seconds: float
  compiled: bool = False  # a real compile at the capacity, made beside the probes

  def to_dict(self):
    d = {"plan": self.plan.describe(), "rungs": list(with_rungs(self.plan, self.plan).rungs),
         "need_bytes": self.need_bytes, "seconds": round(self.seconds, 3)}
    if self.compiled:
      d["compiled"] = True
    return d


@dataclasses.dataclass(frozen=True)
class Planning:
  """Why the planner chose the next plan: the probes it made for it, at what scale."""
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


@dataclasses.dataclass(frozen=True)
class Choice:
  plan: plan_lib.Plan
  predicted_bytes: int
  cost: float
  why: str


class Planner:
  """Prices plans with `probe(plan) -> bytes` and `flops(plan) -> float`, remembering both."""

  def __init__(self, probe: Callable[[plan_lib.Plan], int | None],
               flops: Callable[[plan_lib.Plan], float | None], capacity: int,
               scale: float = 1.0, *, exact: bool = False, headroom: float = HEADROOM,
               clock: Callable[[], float] = time.perf_counter,
               start_probes: Callable[[Sequence[plan_lib.Plan]],
                                      list[Callable[[], tuple[int | None, float]]]] | None = None,
               side_by_side: bool = False,
               start_compile: Callable[[plan_lib.Plan],
                                       Callable[[], tuple[int | None, float, bool]]] | None = None,
               width: int = 2,
               stage_ahead: Callable[[plan_lib.Plan], None] | None = None):
    self._probe, self._flops, self._capacity = probe, flops, capacity
    self._start = start_probes  # probes started at once; each waited for when read
    self.side_by_side = side_by_side and start_probes is not None  # they run in parallel
    # A real compile started beside the probes (decisive plans): read as (figure, s, fits)
    self._start_compile = start_compile if self.side_by_side else None
    self._compiling: dict[plan_lib.Plan, Callable[[], tuple[int | None, float, bool]]] = {}
    # Lowers a plan in the background, for a compile that may start beside the probes
    self._stage_ahead = stage_ahead if self._start_compile is not None else None
    self.width = max(1, width)  # probes, or a race's compiles, run side by side
    self.fit_by_compile: set[plan_lib.Plan] = set()  # plans a real compile here said fit
    self._compiled: set[plan_lib.Plan] = set()  # every plan compiled beside the probes
    self._pending: dict[plan_lib.Plan, Callable[[], tuple[int | None, float]]] = {}
    self._clock = clock
    self.compile_seconds: list[float] = []  # of the real compiles this planner observed
    self._predicted: dict[plan_lib.Plan, int] = {}  # modelled needs, in probe units
    self._real: dict[plan_lib.Plan, int] = {}  # real compiles' figures of failed plans
    # exact: a probe is a full compile whose peak is the very figure held against the
    # capacity (capacity= off a TPU target); the headroom is for estimates only.
    self.exact, self.headroom = exact, headroom
    self.scale = scale  # real need / probe figure: the prior, then the largest measured
    self._ratios: list[float] = []
    self.probes: list[Probe] = []
    self._need: dict[plan_lib.Plan, int | None] = {}
    self._cost: dict[plan_lib.Plan, float | None] = {}
    self.failed: set[plan_lib.Plan] = set()
    self.optimistic_tried = False
    self._dear = False  # once probes were dear, they stay so for this fit (they compare)
    self.data_parallel_failed = False  # a data-parallel plan its probe said fits did not
    self.unmeasured: set[int] = set()  # microbatch counts a probe could not measure
    self.state_bytes = 0  # what donation could alias away (the step's facts, set per choice)

  # -- figures --------------------------------------------------------------------------

  def need(self, plan: plan_lib.Plan) -> int | None:
    plan = program(plan)
    if plan not in self._need:
      pending = self._pending.pop(plan, None)
      if pending is not None:
        need, seconds = pending()
      else:
        t0 = self._clock()
        need = self._probe(plan)
        seconds = self._clock() - t0
      self.probes.append(Probe(plan, need, seconds))
      logging.info("hbm_guard: probe %s: %s bytes (%.1f s)", plan.describe(), need, seconds)
      self._need[plan] = need
    return self._need[plan]

  def prefetch(self, plans: Sequence[plan_lib.Plan]) -> None:
    """Starts probes of the plans not yet measured, to be read later: beside each other
    and beside the pricing, where the fit runs probes side by side. A plan a failure
    bounds out is not probed: nothing would read it."""
    todo = [p for p in dict.fromkeys(program(p) for p in plans)
            if p not in self._need and p not in self._pending and not self.bounded_out(p)]
    if todo and self._start is not None:
      self._pending.update(zip(todo, self._start(todo)))

  def _prefetch_family(self, family: plan_lib.Plan, counts: Sequence[int]
                       ) -> plan_lib.Plan | None:
    """The first figures a family's search reads, started together (and before the
    pricing): its top count, and where probes are dear the other count its model needs,
    else the bisection's first midpoint; or its floor (`_floor`), which it returns."""
    most = dataclasses.replace(family, microbatches=counts[-1]) if counts else None
    if most is None or self.ruled_out(most):
      return None  # (the 368M step's exhaustion: a 2-s lowering and a dear probe, never read)
    floor = self._floor(family, counts)
    if floor is not None:
      # The answer if it fits. The top is read only if it does not: started beside it where
      # a core is left over (on two, it slowed the README job's fit by 0.3 s: 10.25 s, not
      # 9.96, the median of four each).
      self.prefetch([floor, most] if self.width > 2 else [floor])
      return floor
    self.prefetch(first_probes(family, counts, self.probes_are_dear,
                               bool(self._anchors(family, counts[-1]))))
    return None

  def _floor(self, family: plan_lib.Plan, counts: Sequence[int]) -> plan_lib.Plan | None:
    """Where probes are cheap: the family's fewest microbatches that real figures leave
    possible, where they rule out the lower half of the counts (up to the bisection's first
    midpoint) and it is not the most. Need falls with the count, so if it fits it is the
    bisection's answer and the top's probe is not needed (the README job: its failed
    compile rules out 4 and fewer, and 8 fits; one probe, not two, on two cores). Where
    fewer are ruled out the floor is a long shot (t5 of bench_models: its floor, 2 of up to
    64 microbatches, needs 2.5 GiB of 2): the bisection starts at the top and the
    midpoint, as without."""
    if self.probes_are_dear or len(counts) < 2:
      return None
    plans = [dataclasses.replace(family, microbatches=k) for k in counts
             if k not in self.unmeasured]
    middle = counts[(len(counts) - 1) // 2]
    for i, plan in enumerate(plans[:-1]):
      if not self.ruled_out(plan):
        return plan if i > 0 and plan.microbatches >= middle else None
    return None

  def observe(self, plan: plan_lib.Plan, real_bytes: int | None, fits: bool,
              seconds: float | None = None):
    """A real compile's figure: recalibrates the scale from probe to real."""
    if seconds:
      self.compile_seconds.append(seconds)
      if seconds >= DEAR_COMPILE_SECONDS and not self._ratios:
        self.scale = min(self.scale, LARGE_PROGRAM_PROBE_SCALE)
    if not fits:
      self.failed.add(program(plan))
      if real_bytes:
        self._real[program(plan)] = real_bytes
    probe = self._need.get(program(plan))
    if program(plan) in self._compiled:
      return  # its figure is the compile's own: no probe to calibrate
    if plan.shard_batch and not fits:
      # Gathering each layer's parameters whole is what libtpu's early check sees least
      # of (a probe read 1.15 MiB where the compile needed 3.07): its ratio would condemn
      # every other plan. Keep it out, and offer the batch sharded no more in this fit.
      self.data_parallel_failed = True
      return
    if real_bytes and probe and not (fits and real_bytes / probe < 1.0):
      # A fit's ratio below 1 says nothing about how low probes run: keep it out.
      self._ratios.append(real_bytes / probe)
      self.scale = max(self._ratios)

  def known(self, plan: plan_lib.Plan, need: int | None):
    """A figure already measured (the failed attempt's own), so it is not probed again."""
    self._need.setdefault(program(plan), need)

  def cost(self, plan: plan_lib.Plan, offload_bytes: int) -> float:
    family = program(dataclasses.replace(plan, microbatches=1))
    if family not in self._cost:
      self._cost[family] = self._flops(family)
    return plan_cost(self._cost[family], plan, offload_bytes)

  def fits(self, need: int | None) -> bool:
    if need is None:
      return False
    if self.exact:
      return need <= self._capacity
    return need * self.scale <= self.headroom * self._capacity

  @property
  def probes_are_dear(self) -> bool:
    """Whether a probe costs about what a compile does (then one per family must do).
    Before any probe, a failed compile this slow says its probes will be too. Once dear,
    dear for the fit: its probes were made at one effort, and compare."""
    if self._dear or not self.compile_seconds:
      return self._dear
    if not self.probes:
      self._dear = max(self.compile_seconds) >= DEAR_COMPILE_SECONDS
    else:
      mean = sum(p.seconds for p in self.probes) / len(self.probes)
      self._dear = mean >= max(DEAR_PROBE_MIN_SECONDS,
                               DEAR_PROBE_RATIO * max(self.compile_seconds))
    return self._dear

  @property
  def races(self) -> bool:
    """Whether candidates are compiled at the capacity, cheapest first, not probed: where
    a probe costs what a failing compile does (dear probes) and compiles run side by side.
    A plan that does not fit then costs what its probe would (libtpu's early check fails
    it), and one that fits is the compile the fit needs, made already."""
    return self._start_compile is not None and self.probes_are_dear

  def figure(self, plan: plan_lib.Plan) -> int | None:
    """A plan's need in probe units: measured if it was, else modelled, else probed."""
    plan = program(plan)
    if plan in self._need:
      return self._need[plan]
    if plan in self._predicted:
      return self._predicted[plan]
    return self.need(plan)

  # -- the choice -----------------------------------------------------------------------

  def _anchors(self, family: plan_lib.Plan, k1: int) -> list[tuple[int, int]]:
    """This family's failed compiles below `k1` microbatches: (count, real figure)."""
    return sorted((p.microbatches, n) for p, n in self._real.items()
                  if program(dataclasses.replace(p, microbatches=1)) == program(family)
                  and p.microbatches < k1)

  def smallest_count(self, family: plan_lib.Plan, counts: Sequence[int],
                     decisive: bool = False, ahead: _Ahead | None = None) -> int | None:
    """The fewest microbatches predicted to fit in this family, by bisection (by the
    two-point model when probes are dear). `decisive`: the most microbatches would be the
    choice if no fewer fit, so where probes are cheap it is compiled, not probed. `ahead`:
    may start a later family's decisive compile once this family has one round left."""
    if not counts:
      return None
    most = dataclasses.replace(family, microbatches=counts[-1])
    if self.ruled_out(most):
      return None
    if decisive and self._compile_beside(most):
      return _bisect_below_compiled(self, family, counts)
    floor = self._prefetch_family(family, counts)
    if floor is not None:
      floor_need = self.need(floor)
      if self.fits(floor_need):
        return floor.microbatches
      if floor_need is None:
        self.unmeasured.add(floor.microbatches)
      counts = [k for k in counts if k > floor.microbatches]  # the floor and all below: out
      self._prefetch_family(family, counts)  # the top, and the midpoint above the floor
    need = self.need(most)
    for _ in range(MAX_PASSED_OVER):
      if len(counts) < 2 or not self._passed_over(most, need):
        break
      counts = counts[:-1]
      most = dataclasses.replace(family, microbatches=counts[-1])
      if self.ruled_out(most):
        return None
      self._prefetch_family(family, counts)
      need = self.need(most)
    if not self.fits(need):
      return None
    if self.probes_are_dear and len(counts) > 1:
      return _modelled_count(self, family, counts)
    return counts[_bisect(self, family, counts, thirds=self.side_by_side, ahead=ahead)]

  def _passed_over(self, top: plan_lib.Plan, need: int | None) -> bool:
    """Whether a family's most microbatches say nothing of fewer, which are then searched:
    - no figure: the trace does not split the batch there (a microbatch of one example,
      where `jnp.take_along_axis` traces otherwise, as in optax's integer-label
      cross-entropy); that count is left out of every family's search;
    - a figure over the capacity and above a real compile of fewer microbatches (donation
      aside: it only lowers the need), so need does not fall with the count up there: a
      one-example microbatch padded by TPU tiling (a ViT: 2.12 GiB at 64 of 64, 671 MiB at
      32, its unsplit compile 1.66 GiB)."""
    if top.microbatches < 2:
      return False
    if need is None:
      self.unmeasured.add(top.microbatches)
      return True
    bare = lambda p: dataclasses.replace(program(p), donate_argnums=(), microbatches=1)  # noqa: E731
    return not self.fits(need) and any(
        n < need for p, n in self._real.items()
        if bare(p) == bare(top) and p.microbatches < top.microbatches)

  def _compile_beside(self, plan: plan_lib.Plan) -> bool:
    """Starts a real compile of `plan`, whose probe would only decide whether to compile
    it (where probes are cheap, and run side by side): the probe and the compile's lowering
    are saved, and the compile runs beside the probes of the fewer counts."""
    plan = program(plan)
    if (self._start_compile is None or self.probes_are_dear or plan in self._need
        or plan in self._pending or plan in self._compiling):
      return plan in self._compiling
    self._compiling[plan] = self._start_compile(plan)
    return True

  def _compile_ahead(self, later: Sequence[plan_lib.Plan], counts: Sequence[int],
                     offload_bytes: int, bound: plan_lib.Plan,
                     unresolved: Sequence[plan_lib.Plan]) -> bool:
    """Starts the compile of the dearest plan cheaper than `bound` (which fits), where that
    plan is a later family's and this family has one round left (`unresolved`): it is the
    choice if nothing cheaper fits, and compiled now, beside this family's last probe and
    the later families' own, it saves the rounds before it (the README job: 4 probes
    after its failed compile, not 5; the compile started one round sooner)."""
    if self._start_compile is None or self.probes_are_dear:
      return False
    limit = self.cost(bound, offload_bytes)
    candidates = [p for p in list(unresolved) + [dataclasses.replace(f, microbatches=k)
                                                 for f in later for k in counts]
                  if self.cost(p, offload_bytes) < limit and not self.ruled_out(p)
                  and p.microbatches not in self.unmeasured]
    if not candidates:
      return False
    dearest = max(candidates, key=lambda p: self.cost(p, offload_bytes))
    if program(dearest) in {program(p) for p in unresolved}:
      return False  # this family's own: its bisection decides it
    return self._compile_beside(dearest)

  def compiled_fits(self, plan: plan_lib.Plan) -> bool:
    """Waits for the compile started beside the probes: whether `plan` fits (then it is
    the compile the fit uses), recording its figure as real."""
    plan = program(plan)
    reader = self._compiling.pop(plan, None)
    if reader is not None:
      need, seconds, fits = reader()
      self.probes.append(Probe(plan, need, seconds, compiled=True))
      self._need[plan] = need
      self._compiled.add(plan)
      if fits:
        self.fit_by_compile.add(plan)
      else:
        self.failed.add(plan)
        if need:
          self._real[plan] = need
    return plan in self.fit_by_compile

  def choose(self, families: Sequence[plan_lib.Plan], counts: Sequence[int],
             offload_bytes: int, *, race: bool = False) -> Choice | None:
    """The cheapest plan predicted to fit, over families priced cheapest first. The likely
    cheapest family's first probes are started before the pricing. A later
    family searches only the counts that would cost less than the best so far: its top
    probe is then at fewer microbatches (the README job: 6 probes, not 8). `race`: where
    the planner races (`races`), the cheapest that fits, by compiles at the capacity."""
    if race and self.races:
      return self._race(families, counts, offload_bytes)
    if families:
      self._prefetch_family(min(families, key=_likely_cost), counts)
    priced = sorted(families, key=lambda f: self.cost(f, offload_bytes))
    best: Choice | None = None
    for i, family in enumerate(priced):
      if best is not None and self.cost(family, offload_bytes) >= best.cost:
        break  # every plan of this family costs more than the best already found
      worth = self._worth(family, counts, best and best.cost, offload_bytes)
      if best is None:
        self._lower_ahead(family, worth, priced[i + 1:], counts, offload_bytes)
      # Its most microbatches is the choice if no fewer fit: where a fitting plan bounds
      # the counts (the likeliest to fit is then just cheaper than it), and no later family
      # offers anything cheaper.
      decisive = bool(worth) and (
          best is not None and self._undercuts(family, worth, priced[i + 1:], counts,
                                               offload_bytes)
          or program(  # or its compile was started ahead
              dataclasses.replace(family, microbatches=worth[-1])) in self._compiling)
      ahead = functools.partial(self._compile_ahead, priced[i + 1:], counts, offload_bytes)
      k = self.smallest_count(family, worth, decisive, ahead)
      if k is None:
        continue
      plan = dataclasses.replace(family, microbatches=k)
      cost = self.cost(plan, offload_bytes)
      if best is None or cost < best.cost:
        need = self.figure(plan)
        compiled = program(plan) in self.fit_by_compile
        best = Choice(plan, need if compiled else int(need * self.scale), cost,
                      (f"cheapest that fits: compiled beside the probes of fewer "
                       f"microbatches, {need} bytes; " if compiled else
                       f"cheapest that fits: compiled at {need} bytes <= {self._capacity}; "
                       if self.exact else
                       f"cheapest predicted to fit: probe {need} bytes x {self.scale:.2f} <= "
                       f"{self.headroom} x {self._capacity}; ") + f"cost {cost:.3g} flops")
    return best

  def _worth(self, family: plan_lib.Plan, counts: Sequence[int], best_cost: float | None,
             offload_bytes: int) -> list[int]:
    """The counts of `family` worth searching: measurable, and cheaper than the best."""
    return [k for k in counts if k not in self.unmeasured and (best_cost is None or self.cost(
        dataclasses.replace(family, microbatches=k), offload_bytes) < best_cost)]

  def _undercuts(self, family: plan_lib.Plan, worth: Sequence[int],
                 later: Sequence[plan_lib.Plan], counts: Sequence[int],
                 offload_bytes: int) -> bool:
    """Whether `family` at its most worthwhile count costs no more than any plan of the
    later families: then, if no fewer fit, that plan is the choice."""
    top = self.cost(dataclasses.replace(family, microbatches=worth[-1]), offload_bytes)
    return all(self.cost(dataclasses.replace(f, microbatches=counts[0]), offload_bytes) >= top
               for f in later)

  def _lower_ahead(self, family: plan_lib.Plan, counts: Sequence[int],
                   later: Sequence[plan_lib.Plan], all_counts: Sequence[int],
                   offload_bytes: int) -> None:
    """While the first family's floor is probed: lowers the compile the next family would
    start beside its probes if the floor fits (it then bounds that family's counts, and
    the plan at the most of them is decisive). The README job: the floor, donate +
    microbatch(8), was read after 1.2 s of an idle core, and the remat family's
    microbatch(4) was then lowered for 0.5 s before its compile began."""
    floor = self._floor(family, counts) if self._stage_ahead and later else None
    if floor is None or program(floor) not in self._pending:
      return  # no floor, or its figure is in: the choice follows at once
    nxt, rest = later[0], later[1:]
    worth = self._worth(nxt, all_counts, self.cost(floor, offload_bytes), offload_bytes)
    if not worth or not self._undercuts(nxt, worth, rest, all_counts, offload_bytes):
      return
    plan = dataclasses.replace(nxt, microbatches=worth[-1])
    if not self.ruled_out(plan) and program(plan) not in self._compiling:
      self._stage_ahead(plan)

  # -- the race (dear probes, compiles side by side) ----------------------------------------

  def _race(self, families: Sequence[plan_lib.Plan], counts: Sequence[int],
            offload_bytes: int) -> Choice | None:
    """The cheapest plan that fits, by compiling the cheapest candidates at the capacity,
    `width` at a time: the first in cost order whose compile fits is the choice; each that
    fails rules out what its figure does (need falls with the count). At 368M parameters
    on v5e:1x1 a failing compile took 12-17 s and a probe 12-16 s: a round of probes to
    decide what to compile cost as much as compiling the candidates."""
    price = lambda p: self.cost(p, offload_bytes)  # noqa: E731
    while True:
      ranked = sorted(self._contenders(families, counts), key=price)
      if not ranked:
        return None
      first = ranked[0]
      if program(first) not in self._compiling:
        # A round: the cheapest, as many as the compiles still running leave room for
        # (one ruled out as it ran is not waited for, but holds its core), the dearest
        # first: the likeliest to fit, its longer compile started while the others are
        # lowered. While the cheapest runs no more are started: at 368M a third compile
        # beside the one that fit (started as a cheaper one failed) made it take 73 s, not 49.
        busy = sum(1 for read in self._compiling.values() if not _done(read))
        for plan in reversed(ranked[:max(1, self.width - busy)]):
          if program(plan) not in self._compiling and program(plan) not in self._compiled:
            self._compiling[program(plan)] = self._start_compile(plan)
      if self.compiled_fits(first):
        need = self._need.get(program(first)) or 0
        return Choice(first, need, price(first),
                      f"cheapest that fits: compiled at the capacity, {need} bytes, the "
                      f"cheapest candidates compiled first, two at a time; "
                      f"cost {price(first):.3g} flops")

  def _contenders(self, families: Sequence[plan_lib.Plan], counts: Sequence[int]
                  ) -> list[plan_lib.Plan]:
    """The plans a race may compile: not failed, and not ruled out by a real figure."""
    out = []
    for family in families:
      for k in counts:
        plan = dataclasses.replace(family, microbatches=k)
        if not self.ruled_out(plan) and k not in self.unmeasured:
          out.append(plan)
    return out

  def ruled_out(self, plan: plan_lib.Plan) -> bool:
    """Whether real figures say `plan` cannot fit: it failed, a failure of its family
    bounds it (bounded_out), or one that differs only by flags does (cannot_close)."""
    return (program(plan) in self.failed or self.bounded_out(plan)
            or cannot_close(self, plan) is not None)

  def bounded_out(self, plan: plan_lib.Plan) -> bool:
    """Whether a real failed compile of `plan`'s family bounds it more than BOUND_SLACK
    over the capacity: then it is not probed (the README job's donate + microbatch(4),
    bounded at 189 MiB of 96 by its plain step's failure, probed 162)."""
    return not self.exact and self.lower_bound(plan) > BOUND_SLACK * self._capacity

  def lower_bound(self, plan: plan_lib.Plan) -> float:
    """What `plan` needs at least by the real compiles of its family (donation aside):
    infinite where one failed at as many microbatches or more (split; unsplit is another
    program), else the state once plus what is left of a figure, divided by the count
    (donation aliases the state's output at most; splitting divides activations). 368M:
    the plain step's 81.19 GiB bounds microbatch(2) at 40.6 (a probe read 62) and
    microbatch(16) at 8.7 (11.6); the unmodified step's 19.37 bounds microbatch(2) at 9.7
    (21.06). Not a strict bound (BOUND_SLACK): splitting can cut more than activations."""
    family = lambda p: dataclasses.replace(program(p), microbatches=1)  # noqa: E731
    bare = lambda p: dataclasses.replace(family(p), donate_argnums=())  # noqa: E731
    k, state = plan.microbatches, self.state_bytes
    if any(family(f) == family(plan) and (f.microbatches == k or f.microbatches > k > 1)
           for f in self.failed):
      return float("inf")
    bound = 0.0
    for failed, need in self._real.items():
      if bare(failed) == bare(plan):
        bound = max(bound, state + max(0, need - 2 * state) * failed.microbatches / k)
    return bound


def _done(read: Callable[[], Any]) -> bool:
  """Whether a compile started beside the probes has finished (unknown: taken as done)."""
  done = getattr(read, "done", None)
  return True if done is None else bool(done())


def plan_cost(family_flops: float | None, plan: plan_lib.Plan, offload_bytes: int) -> float:
  """A plan's compute: its family's flops, +1% per extra microbatch, plus the host
  transfers of offload."""
  cost = (family_flops or 1.0) * (1 + MICROBATCH_OVERHEAD * (plan.microbatches - 1))
  if plan.offload_optimizer:
    cost += 2 * offload_bytes * FLOPS_PER_HOST_BYTE
  return cost


def race_opening(others: Sequence[plan_lib.Plan], counts: Sequence[int],
                 family_flops: Callable[[plan_lib.Plan], float | None], width: int,
                 offload_bytes: int) -> list[plan_lib.Plan]:
  """The compiles a race would start first that a failure's figure does not bear on: the
  cheapest `width` plans of the families other than the failed plan's own, dearest first
  (the order the race starts them). Lowered while that compile runs, they are ready."""
  plans = [dataclasses.replace(f, microbatches=k) for f in others for k in counts]
  price = lambda p: plan_cost(family_flops(dataclasses.replace(p, microbatches=1)), p,  # noqa: E731
                              offload_bytes)
  return list(reversed(sorted(plans, key=price)[:width]))


def cannot_close(planner: Planner, plan: plan_lib.Plan) -> str | None:
  """Why `plan` cannot fit, judged without a probe from a real compile of a plan it
  differs from only by XLA's flags and donation (FLAGS_FLOOR); None if it may."""
  bare = lambda p: dataclasses.replace(program(p), donate_argnums=(), compiler_options=())  # noqa: E731
  # pylint: disable=protected-access  (the planner's own figures: kept here for its size)
  figures = [n for p, n in planner._real.items() if bare(p) == bare(plan)]
  if not figures or planner.exact:
    return None
  floor = FLAGS_FLOOR * (min(figures) - planner.state_bytes)
  if floor <= planner._capacity:
    return None
  fmt = diagnose_lib.format_bytes
  return (f"estimated: {plan.describe()} needs at least {fmt(int(floor))} of "
          f"{fmt(planner._capacity)} (XLA's flags and donation cut a failed compile's "
          f"{fmt(min(figures))} by a third at most where measured; half is assumed; "
          f"search='ladder' compiles them anyway)")


def _bisect_below_compiled(planner: Planner, family: plan_lib.Plan, counts: Sequence[int]
                           ) -> int | None:
  """The fewest microbatches that fit, where the most is being compiled: the fewer counts
  are bisected by probes meanwhile, one at a time (the compile has the other core), and
  the compile is waited for only if none of them fits."""
  lo = _bisect(planner, family, counts, thirds=False)  # counts[-1]: compiling, taken to fit
  if lo < len(counts) - 1:
    return counts[lo]
  most = dataclasses.replace(family, microbatches=counts[-1])
  return counts[-1] if planner.compiled_fits(most) else None


def _bisect(planner: Planner, family: plan_lib.Plan, counts: Sequence[int], thirds: bool,
            ahead: _Ahead | None = None) -> int:
  """The index of the fewest microbatches predicted to fit, the most taken to fit. One
  probe a round, or with `thirds` two side by side: the thirds of what is left. Once one
  round of two is left, `ahead` may start a later family's compile: then one at a time."""
  at = lambda i: dataclasses.replace(family, microbatches=counts[i])  # noqa: E731
  def ok(i):
    return (program(at(i)) not in planner.failed and not planner.bounded_out(at(i))
            and planner.fits(planner.need(at(i))))
  lo, hi, downward = 0, len(counts) - 1, False
  while lo < hi:
    if (thirds and ahead is not None and hi - lo <= 3 and _next_likely_fails(
        planner, family, counts, hi) and ahead(
            at(hi), [at(i) for i in range(lo, hi) if program(at(i)) not in planner.failed])):
      # The compile started ahead is the choice if none of these fits, as is likeliest.
      # From the top down, one at a time: the first that does not fit ends the search.
      thirds, downward = False, True
    mid = hi - 1 if downward else (lo + hi) // 2
    if thirds and hi - lo >= 2 and not _started(planner, at(mid)):
      a, b = lo + (hi - lo) // 3, lo + 2 * (hi - lo) // 3
      planner.prefetch([at(a), at(b)])
      lo, hi = (lo, a) if ok(a) else (a + 1, b) if ok(b) else (b + 1, hi)
    elif ok(mid):
      hi = mid
    else:
      lo = mid + 1
  return lo


def _next_likely_fails(planner: Planner, family: plan_lib.Plan, counts: Sequence[int],
                       hi: int) -> bool:
  """Whether the count below a bound the probes found (`hi`, under the family's top) is
  predicted not to fit, by `F + P / k` through the figures at the bound and at the top.
  The README job: 67.34 MiB at 8 and 61.15 at 64 predict 74.4 at 4, over the capacity
  once scaled; a flat family (15.61 and 15.40 MiB) predicts that 4 fits, and a compile
  started ahead of it would only be beaten (and contend with the compile that follows)."""
  if hi <= 0 or hi >= len(counts) - 1:
    return False  # the top alone says little of where the answer is
  k0, k1 = counts[hi], counts[-1]
  # pylint: disable-next=protected-access  (the planner's own figures)
  n0, n1 = (planner._need.get(program(dataclasses.replace(family, microbatches=k)))
            for k in (k0, k1))
  if n0 is None or n1 is None:
    return False
  per = max(0.0, (n0 - n1) / (1 / k0 - 1 / k1))
  return not planner.fits(int(n1 - per / k1 + per / counts[hi - 1]))


def _started(planner: Planner, plan: plan_lib.Plan) -> bool:
  """Whether `plan` was probed or its probe is running."""
  return program(plan) in planner._need or program(plan) in planner._pending  # pylint: disable=protected-access


def _modelled_count(planner: Planner, family: plan_lib.Plan, counts: Sequence[int]
                    ) -> int | None:
  """The fewest microbatches predicted to fit from need(k) ~ F + P / k through two
  figures of this family: its probe at the most microbatches, and at fewer its latest
  failed compile, else a probe at the fewest split. Another family's figure is no anchor:
  a split step holds accumulators an unsplit one does not, and libtpu's early check of
  the unsplit step read below its split at 368M (19.37 GiB, then 20.47 at k = 2)."""
  # pylint: disable=protected-access  (the planner's own figures: kept here for its size)
  at = lambda k: dataclasses.replace(family, microbatches=k)  # noqa: E731
  k1 = counts[-1]
  n1 = planner.need(at(k1))
  anchors = planner._anchors(family, k1)
  scale = planner.scale if planner._ratios else 1.0  # probes against real: no prior to inflate
  if not anchors:
    k0 = _anchor_count(counts)
    n0 = planner.need(at(k0))
    if n0 is None:
      return k1  # no second figure: the most microbatches, which its probe said fit
    if n0 * scale <= planner.headroom * planner._capacity:
      # the anchor itself fits: the one count below it (unsplit: another program, so
      # probed, not extrapolated) may too
      below = [k for k in counts if k < k0 and program(at(k)) not in planner.failed]
      n_below = planner.need(at(below[-1])) if below else None
      if n_below is not None and n_below * scale <= planner.headroom * planner._capacity:
        return below[-1]
      return k0
    anchors = [(k0, n0)]
  k0, n0 = anchors[-1]
  per = max(0.0, (n0 - n1 * scale) / (1 / k0 - 1 / k1))
  fixed = n1 * scale - per / k1
  for k in counts:
    plan = program(at(k))
    predicted = int((fixed + per / k) / scale)  # in probe units, as the planner keeps them
    if (plan not in planner.failed and k > k0 and not planner.bounded_out(plan)
        and predicted * scale <= planner.headroom * planner._capacity):
      planner._predicted[plan] = predicted
      return k
  return None


def first_probes(family: plan_lib.Plan, counts: Sequence[int], dear: bool, anchored: bool
                 ) -> list[plan_lib.Plan]:
  """A family's first two probes: its most microbatches, and where probes are dear the
  count its model is anchored at (unless a failed compile anchors it), else the
  bisection's first midpoint."""
  at = lambda k: dataclasses.replace(family, microbatches=k)  # noqa: E731
  if len(counts) < 2:
    return [at(k) for k in counts]
  if not dear:
    return [at(counts[-1]), at(counts[(len(counts) - 1) // 2])]
  return [at(counts[-1])] + ([] if anchored else [at(_anchor_count(counts))])


def opening(rungs: Sequence[ladder_lib.Rung], plan: plan_lib.Plan,
            facts: ladder_lib.StepFacts, max_class: str, dear: bool
            ) -> tuple[list[plan_lib.Plan], list[plan_lib.Plan]]:
  """What a planner does first if `plan` (a fit's first) fails: the probes it starts, of
  the likely cheapest family, and the other families it prices. Made while that compile
  runs, they are ready if it fails."""
  fams, counts, _ = families(rungs, plan, facts, max_class)
  if not fams:
    return [], []
  family = min(fams, key=_likely_cost)
  anchored = (program(dataclasses.replace(plan, microbatches=1)) == program(family)
              and plan.microbatches < counts[-1])
  others = sorted((f for f in fams if f != family), key=_likely_cost)
  return first_probes(family, counts, dear, anchored), others


def _likely_cost(family: plan_lib.Plan) -> tuple[bool, bool, bool]:
  """Orders families before their flops are counted: remat recomputes, offload moves
  bytes, a batch sharded over the chips divides the work."""
  return (family.remat_policy is not None, family.offload_optimizer, not family.shard_batch)


def _anchor_count(counts: Sequence[int]) -> int:
  """The count a family's second figure is probed at: the fewest that splits the batch."""
  return counts[1] if len(counts) > 2 and counts[0] == 1 else counts[0]


def program(plan: plan_lib.Plan) -> plan_lib.Plan:
  """Plans compare by what they do, not by the order their rungs were named in: the
  program a plan lowers to (a backend's staged lowerings are keyed by it too)."""
  return dataclasses.replace(plan, rungs=())


def with_rungs(plan: plan_lib.Plan, base: plan_lib.Plan) -> plan_lib.Plan:
  """Names the rungs a chosen plan applies, for the report."""
  names = [name for name, _ in plan.field_rungs()]
  extra = [r for r in base.rungs if r not in names]
  return dataclasses.replace(plan, rungs=tuple(names + extra))


_PLANNED = ("donate", "reshard", "remat", "microbatch", "offload")


def divisors(n: int | None, current: int = 1) -> list[int]:
  """The counts to search: those that divide the batch (the current one if unknown)."""
  return plan_lib.microbatch_counts(n, limit=MAX_MICROBATCHES) if n else [current]


def families(rungs: Sequence[ladder_lib.Rung], plan: plan_lib.Plan,
             facts: ladder_lib.StepFacts, max_class: str, data_parallel_failed: bool = False
             ) -> tuple[list[plan_lib.Plan], list[int], list[ladder_lib.Skip]]:
  """Candidate families (microbatch count aside) and the counts to search, from the rungs
  this step can take. Free rungs are always on: they cost no compute."""
  base, skips = dataclasses.replace(plan, microbatches=1), []
  policies: list[str | None] = [plan.remat_policy]
  offloads = [plan.offload_optimizer]
  counts = [plan.microbatches]
  bare = dataclasses.replace(base, remat_policy=None, offload_optimizer=False)
  for rung in rungs:
    if rung.kind not in _PLANNED:
      continue
    why = ladder_lib.applies(rung, base if rung.kind in ("donate", "reshard") else bare,
                             facts, max_class)
    if why is not None:
      if why[0] is not ladder_lib.SkipKind.ALREADY_APPLIED:
        skips.append(ladder_lib.Skip(rung.name, why[1], why[0]))
      continue
    if rung.kind in ("donate", "reshard"):
      base, _ = ladder_lib.apply(rung, base, facts, None, None)
    elif rung.kind == "remat":
      allowed = ladder_lib.remat_policies(rung, facts)
      policies += [p for p in allowed if p not in policies]
    elif rung.kind == "offload":
      offloads = [False, True]
    elif rung.kind == "microbatch":
      counts = divisors(facts.batch_size, plan.microbatches)
      if facts.batch_size and not any(k > plan.microbatches for k in counts):
        skips.append(ladder_lib.Skip(rung.name, (
            f"batch {facts.batch_size} has no divisor from {plan.microbatches + 1} to "
            f"{MAX_MICROBATCHES}: no microbatch count splits it evenly (a prime batch)"),
            ladder_lib.SkipKind.NOT_APPLICABLE))
  # With the state sharded, the batch can be too (data parallel: a quarter of the work per
  # chip on four). It is a choice, not a rule: it gathers each layer's parameters whole,
  # which a model of few large layers may not afford where splitting the features does.
  batch = facts.batch_size
  shards = [base.shard_batch]
  if (base.shard_state and not base.shard_batch and batch and facts.num_devices > 1
      and batch % facts.num_devices == 0 and not data_parallel_failed
      and not facts.user_layout):
    shards = [False, True]
  out = []
  for policy in policies:
    for offload in dict.fromkeys(offloads):
      for shard_batch in shards:
        out.append(dataclasses.replace(base, remat_policy=policy, offload_optimizer=offload,
                                       shard_batch=shard_batch))
  return out, counts, skips


def _probe_may_fit(planner: Planner, plan: plan_lib.Plan) -> bool:
  """Whether a probe leaves `plan` worth a compile; where the planner races, no probe is
  made (it would cost what the compile does: 68 s against 70 for the 368M step's flags)."""
  if planner.races:
    return program(plan) not in planner.failed
  need = planner.need(plan)
  return need is None or need <= planner._capacity  # pylint: disable=protected-access


def _why_not(planner: Planner, plan: plan_lib.Plan) -> str | None:
  """Why a ladder plan (flags, a dtype) is passed over without a compile, or None."""
  why = cannot_close(planner, plan)
  if why is None and not _probe_may_fit(planner, plan):
    why = f"probed: {plan.describe()} needs {planner.need(plan)} bytes"
  return why


def _flag_chain(rest, first: plan_lib.Plan, facts, rec, max_class) -> list[plan_lib.Plan]:
  """The ladder's XLA-flag plans from `first` on, each adding a rung: weakest first."""
  chain, plan = [], first
  while plan is not None and plan.compiler_options and plan.compute_dtype == first.compute_dtype:
    chain.append(plan)
    plan, _ = ladder_lib.next_plan(rest, plan, facts, rec, max_class)
  return chain


def _strongest_flags_first(planner: Planner, rest, first: plan_lib.Plan, facts, rec,
                           max_class) -> tuple[plan_lib.Plan | None, list[ladder_lib.Skip]]:
  """Where probes cost what compiles do, XLA's flags are judged by one probe: all of them
  at once. If that plan does not fit by its figure, no weaker one is probed (each flag
  only adds rematerialization); the ladder goes on past them. If it fits, it is compiled."""
  chain = _flag_chain(rest, first, facts, rec, max_class)
  if len(chain) < 2:
    return first, []
  strongest = chain[-1]
  why = cannot_close(planner, strongest)
  if why is None and _probe_may_fit(planner, strongest):
    return strongest, []
  why = why or (f"compiled with every XLA flag at once: {strongest.describe()} does not fit"
                if program(strongest) in planner.failed else
                f"probed with every XLA flag at once: {strongest.describe()} needs "
                f"{planner.need(strongest)} bytes of {planner._capacity}")  # pylint: disable=protected-access
  skips = [ladder_lib.Skip(p.rungs[-1] if p.rungs else p.describe(), why,
                           ladder_lib.SkipKind.CANNOT_CLOSE_GAP) for p in chain]
  nxt, more = ladder_lib.next_plan(rest, strongest, facts, rec, max_class)
  return nxt, skips + more


def next_plan(planner: Planner, rungs: Sequence[ladder_lib.Rung], plan: plan_lib.Plan,
              facts: ladder_lib.StepFacts, rec, max_class: str
              ) -> tuple[plan_lib.Plan | None, list[ladder_lib.Skip], Planning]:
  """The planner's choice after `plan` failed; the ladder's remaining rungs (XLA flags,
  dtype) from the plan that came closest when no planned plan is predicted to fit."""
  n_probes = len(planner.probes)
  planner.state_bytes = facts.state_bytes
  if plan.shard_batch and planner.data_parallel_failed:
    plan = dataclasses.replace(plan, shard_batch=False)  # back to the features split
  fams, counts, skips = families(rungs, plan, facts, max_class,
                                 planner.data_parallel_failed)
  choice = planner.choose(fams, counts, facts.offload_bytes, race=True)
  if (choice is None and planner.scale > 1.0 and not planner.optimistic_tried
      and not planner.races):
    planner.optimistic_tried = True  # once: a miss here means the margin is real
    # Probes run low, but not always by the margin assumed: before XLA's flags (a last
    # resort), compile the cheapest plan the probe's own figure says fits.
    scale, planner.scale = planner.scale, 1.0
    try:
      choice = planner.choose(fams, counts, facts.offload_bytes)
    finally:
      planner.scale = scale
    if choice is not None:
      choice = dataclasses.replace(choice, why="fits by the probe's own figure (unscaled); "
                                   + choice.why)
  if choice is not None and program(choice.plan) != program(plan):
    nxt = with_rungs(choice.plan, plan)
    chosen, why, predicted = choice.plan.describe(), choice.why, choice.predicted_bytes
  else:
    measured = [(p, n) for p, n in planner._need.items() if n is not None]  # pylint: disable=protected-access
    closest = (min(measured, key=lambda pn: pn[1])[0] if measured else  # else: free rungs on
               dataclasses.replace(fams[0], microbatches=plan.microbatches) if fams else plan)
    closest = with_rungs(closest, plan)
    rest = [r for r in rungs if r.kind not in _PLANNED]
    nxt, more = ladder_lib.next_plan(rest, closest, facts, rec, max_class)
    skips += more
    if nxt is not None and planner.probes_are_dear:
      nxt, more = _strongest_flags_first(planner, rest, nxt, facts, rec, max_class)
      skips += more
    # XLA's flags and a dtype are priced by probes too: a plan the probe's own figure puts
    # over the capacity is passed over without a compile.
    while nxt is not None and (why_not := _why_not(planner, nxt)) is not None:
      skips.append(ladder_lib.Skip(nxt.rungs[-1] if nxt.rungs else nxt.describe(), why_not,
                                   ladder_lib.SkipKind.CANNOT_CLOSE_GAP))
      nxt, more = ladder_lib.next_plan(rest, nxt, facts, rec, max_class)
      skips += more
    chosen, predicted = (nxt.describe() if nxt else None), None
    why = ("no planned plan is predicted to fit; the ladder's remaining rungs from the "
           f"closest plan ({closest.describe()})")
  return nxt, skips, Planning(chosen, why, tuple(planner.probes[n_probes:]), planner.scale,
                              predicted)
