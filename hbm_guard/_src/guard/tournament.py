"""Of the plans that fit, the fastest: timed on the user's own first steps.

A flop count cannot rank plans on a device: more microbatches ran faster on a CPU (each
fits in cache), and underfill a TPU's MXU. Where the step runs here, the plan the search
chose is the incumbent, and rivals near it (`search.rivals`) are compiled beside its steps
(in a thread, after its first few) and then timed against it in alternating steps, each a
real step of the user's: plans within `max_class` compute the same training up to the
rounding that class allows, so none is wasted. A rival faster by more than the noise in
two rounds running becomes the incumbent; one whose compile does not fit is learnt, so
the next rival is not its like. After at most `max_rivals` rivals the incumbent is
settled on: the guard runs it directly from then on (nothing on the hot path), reports
every plan's median step time and remembers the winner in the plan cache, so a restart
compiles only it. At most two executables are held at a time: the incumbent's and one
rival's.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import enum
import statistics
import threading
import time
from typing import Any, Callable

import jax
from absl import logging

from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.search import rivals as rivals_lib
from hbm_guard._src.search.state import program

Plan = plan_lib.Plan
STEPS_EACH = 4  # timed steps of each of the two plans in a round, alternating
# Steps of the incumbent before the first rival is compiled: a job's first steps are often
# not its typical ones (allocations, the input pipeline), and a loop this short (a test,
# a smoke run) pays for no rival.
SETTLING_STEPS = 5
MARGIN = 0.03  # a rival must be this much faster (median against median) to win


class _Kind(enum.Enum):
  """How a step of the schedule runs."""
  FREE = "free"  # not waited for: the user's own pace
  WARM = "warm"  # a rival's first run, waited for but not timed: the next step's clock
  #                must start with nothing queued before it (the queued steps' time is no
  #                one's, and fell on the incumbent's first timed step)
  TIMED = "timed"


@dataclasses.dataclass(frozen=True)
class Timing:
  """A plan's measured step times."""
  plan: Plan
  seconds: tuple[float, ...]

  @property
  def median(self) -> float:
    return statistics.median(self.seconds)

  def to_dict(self) -> dict[str, Any]:
    return {"plan": self.plan.describe(), "median_seconds": round(self.median, 6),
            "steps": len(self.seconds)}


@dataclasses.dataclass(frozen=True)
class Outcome:
  """How a tournament ended: the plan settled on, and every plan it timed (it first)."""
  winner: Plan
  timings: tuple[Timing, ...]
  why: str


class Tournament:
  """Runs the user's steps for one input signature until a plan is settled on.

  `entry(plan)` gives the callable that runs a plan (its jit, admitted for the signature);
  `compile_fits(plan)` compiles it (in a thread) and says whether it fits; `settle(outcome)`
  is told the result once, and is where the guard installs the winner. `recoverable(error,
  args)`: whether a rival's run failed before it consumed anything (a GPU's allocation at
  run time), so that the step is run again on the incumbent and the rival let go.
  """

  def __init__(self, field: rivals_lib.Field, incumbent: Plan,
               entry: Callable[[Plan], Callable], compile_fits: Callable[[Plan], bool],
               settle: Callable[[Outcome], None], *, max_rivals: int,
               recoverable: Callable[[Exception, Any], bool] = lambda e, args: False,
               clock: Callable[[], float] = time.perf_counter):
    self._field, self._entry, self._compile_fits = field, entry, compile_fits
    self._settle, self._clock, self._recoverable = settle, clock, recoverable
    self._lock = threading.Lock()  # steps from several threads: one schedule
    self._incumbent = incumbent
    self._runs = {program(incumbent): entry(incumbent)}
    self._rivals_left = max_rivals
    self._tried = frozenset({program(incumbent)})
    self._rival: Plan | None = None
    self._compiling: concurrent.futures.Future | None = None
    self._schedule: collections.deque[tuple[Plan, _Kind]] = collections.deque()
    self._round: dict[Plan, list[float]] = collections.defaultdict(list)
    self._seconds: dict[Plan, list[float]] = collections.defaultdict(list)
    self._done = False
    self._pool: concurrent.futures.ThreadPoolExecutor | None = None
    self._untimed = SETTLING_STEPS
    self._confirming = False  # the rival won its first round: a second must agree

  def __call__(self, args, kwargs):
    with self._lock:
      plan, kind = self._next()
      run = self._runs[program(plan)]
    timed = kind is _Kind.TIMED
    t0 = self._clock()
    try:
      out = run(args, kwargs)
      if kind is not _Kind.FREE:
        out = jax.block_until_ready(out)
    except jax.errors.JaxRuntimeError as e:
      if plan == self._incumbent or not self._recoverable(e, args):
        raise
      logging.warning("hbm_guard: %s failed at run time (%s); it is let go",
                      plan.describe(), str(e).splitlines()[0][:200])
      with self._lock:
        self._let_rival_go()
        run = self._runs[program(self._incumbent)]
      return run(args, kwargs)
    if timed:
      seconds = self._clock() - t0
      with self._lock:
        self._round[program(plan)].append(seconds)
        self._seconds[program(plan)].append(seconds)
        if not self._schedule and self._rival is not None:
          self._judge()
    return out

  # -- the schedule ------------------------------------------------------------------------

  def _next(self) -> tuple[Plan, _Kind]:
    """The plan this step runs, and how."""
    if self._schedule:
      return self._schedule.popleft()
    if self._untimed > 0:
      self._untimed -= 1
      return self._incumbent, _Kind.FREE
    if self._compiling is None:
      self._start_rival()
    elif self._compiling.done():
      fits = self._read_rival()
      if fits:
        rival = self._rival
        self._schedule.extend([(rival, _Kind.WARM)] + [
            (p, _Kind.TIMED) for _ in range(STEPS_EACH) for p in (self._incumbent, rival)])
        return self._schedule.popleft()
    return self._incumbent, _Kind.FREE  # while a rival compiles, or before the next

  def _start_rival(self) -> None:
    rival = (rivals_lib.next_rival(self._field, self._incumbent, self._tried)
             if self._rivals_left > 0 else None)
    if rival is None:
      self._finish()
      return
    self._rivals_left -= 1
    self._rival, self._tried = rival, self._tried | {rival}
    # A pool's thread, not a daemon: an exit waits for the compile (XLA aborts the process
    # if it is torn down under one).
    self._pool = self._pool or concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix="hbm_guard-rival")
    self._compiling = self._pool.submit(self._compile_fits, rival)

  def _read_rival(self) -> bool:
    future, self._compiling = self._compiling, None
    try:
      fits = bool(future.result())
    except Exception as e:  # pylint: disable=broad-except  (a rival is optional)
      logging.warning("hbm_guard: could not compile %s to time it: %r",
                      self._rival.describe(), e)
      fits = False
    self._field = rivals_lib.learn(self._field, self._rival, fits)
    if fits:
      self._runs[program(self._rival)] = self._entry(self._rival)
    else:
      self._rival = None
    return fits

  def _let_rival_go(self) -> None:
    if self._rival is not None:
      self._runs.pop(program(self._rival), None)
      self._seconds.pop(program(self._rival), None)
    self._schedule.clear()
    self._round.clear()
    self._rival, self._compiling, self._confirming = None, None, False

  def _judge(self) -> None:
    """After a round: a rival faster by more than MARGIN in two rounds running (one round
    of four steps each is noise enough on a busy host to crown a plan 10% slower) is the
    incumbent; the other let go."""
    rival, incumbent = program(self._rival), program(self._incumbent)
    mine, theirs = (statistics.median(self._round[p]) for p in (incumbent, rival))
    logging.info("hbm_guard: timed %s at %.4f s a step against %s at %.4f s",
                 self._rival.describe(), theirs, self._incumbent.describe(), mine)
    self._round.clear()
    faster = theirs < (1 - MARGIN) * mine
    if faster and not self._confirming:
      self._confirming = True  # the second round leads with the incumbent's rival
      self._schedule.extend((p, _Kind.TIMED) for _ in range(STEPS_EACH)
                            for p in (self._rival, self._incumbent))
      return
    loser = rival
    if faster:
      self._incumbent, loser = self._rival, incumbent
    self._runs.pop(loser, None)  # two executables at most
    self._rival, self._compiling, self._confirming = None, None, False

  def _finish(self) -> None:
    if self._done:
      return
    self._done = True
    if self._pool is not None:
      self._pool.shutdown(wait=False)
    # The plan settled on first, then the others by median: one within MARGIN of it may
    # show a lower median over all its steps, but lost its own alternating round.
    timings = sorted((Timing(p, tuple(s)) for p, s in self._seconds.items() if s),
                     key=lambda t: (t.plan != program(self._incumbent), t.median))
    why = (f"each rival against the plan in force, {STEPS_EACH} steps each in turn; one "
           f"{MARGIN:.0%} faster took its place" if len(timings) > 1 else
           "no rival near it fits to time against")
    self._settle(Outcome(self._incumbent, tuple(timings), why))
