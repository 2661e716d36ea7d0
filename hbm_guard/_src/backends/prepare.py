"""What a failure of a fit's first compile would need first, made while that compile runs.

libtpu compiles outside Python, on about one core, so Python is free while a compile runs.
Once the compile has run long enough that a failure would make probes dear
(search.tuning.DEAR_COMPILE_SECONDS), a thread lowers the probes that failure starts with, then
prices the other families (a trace each). At 368M parameters on v5e:1x1 that is ~30 s of
a core beside a failing compile of ~30 s: the fit spent 25-28 s between its two compiles,
against 49 s without. Where probes run side by side (more than one core), it starts at
once with what a quick failure would read first (a probe, the other families' prices,
another probe), each only if it can be made before the failure would count as slow (the
README job: its first compile fails 1.0 s after lowering; its first probe was lowered and
its families priced meanwhile). The thread traces as the
caller's thread would (thread_context) and starts no new job once the compile is done:
what it made is read by the planner (a probe being lowered is waited for, not lowered
twice), and goes with the fit. Nothing waits for it if the compile fits.
"""

from __future__ import annotations

import functools
import threading
import time

from absl import logging

from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.backends import options as options_lib
from hbm_guard._src.backends import steps as steps_lib
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.plans import rungs as rungs_lib
from hbm_guard._src.plans import thread_context
from hbm_guard._src.search import space
from hbm_guard._src.search import tuning

AFTER_SECONDS = tuning.DEAR_COMPILE_SECONDS  # a compile this long: its probes are dear


class Preparation:
  """The work ahead of a failure of `plan`'s compile: `start` it as the compile begins,
  `stop` it as the compile ends, `close` it with the fit."""

  def __init__(self, backend, step: steps_lib.StepBuilder, options: options_lib.GuardOptions,
               key, args, kwargs, plan: plan_lib.Plan, width: int = 1):
    self.backend, self.step, self.options, self.plan = backend, step, options, plan
    self.key, self.args, self.kwargs = key, args, kwargs
    self.width = width  # compiles side by side (probes, a race's compiles)
    self.at_once = width > 1  # the cheap probes' opening right away (probes side by side)
    self._stopped, self._closed = threading.Event(), threading.Event()
    self.done: list[str] = []  # what it made, described (for tests and the log)

  def start(self, facts: compile_lib.TraceFacts | None, started: float) -> None:
    if facts is not None:  # traced as the caller's thread would (its mesh, its jax config)
      threading.Thread(target=thread_context.capture().run, args=(self._run, facts, started),
                       daemon=True, name="hbm_guard-prepare").start()

  def stop(self) -> None:
    self._stopped.set()

  def close(self) -> None:
    self._stopped.set()
    self._closed.set()

  def _run(self, facts: compile_lib.TraceFacts, started: float) -> None:
    try:
      step_facts = None  # made once, where first needed
      if self.at_once:
        step_facts = self._step_facts(facts)
        self._quick_opening(step_facts, started)
      wait = AFTER_SECONDS - (time.perf_counter() - started)
      if not self._stopped.wait(min(max(0.0, wait), threading.TIMEOUT_MAX)):
        for what, job in self._jobs(step_facts or self._step_facts(facts), started):
          if self._stopped.is_set():
            break
          self._make(what, job, started)
    except Exception as e:  # pylint: disable=broad-except  (preparation, never the compile)
      logging.warning("hbm_guard: preparing the fallback failed: %r", e)
    if self._closed.is_set():
      self.backend.unstage()  # the fit ended while the last job ran: nothing will read it

  def _quick_opening(self, step_facts: rungs_lib.StepFacts, started: float) -> None:
    """What a quick failure reads first, each made only if it would be ready before the
    compile counts as slow (so a slow one's own opening is not delayed): the midpoint's
    probe (the likely answer where the failure rules out the counts below it); the other
    families' prices, which every choice reads; then the top's probe, read only if the
    midpoint does not fit (the README job: priced before its failure, not beside its
    first probe, on two cores)."""
    if time.perf_counter() - started >= AFTER_SECONDS:
      return
    o = self.options
    probes, others = space.opening(o.ladder, self.plan, step_facts, o.max_class,
                                         dear=False)
    jobs = ([self._lowering(p) for p in probes[1:]] + [self._pricing(f) for f in others]
            + [self._lowering(p) for p in probes[:1]])
    last = 0.0
    for what, job in jobs:
      if self._stopped.is_set() or time.perf_counter() + last - started >= AFTER_SECONDS:
        return
      last = self._make(what, job, started)

  def _lowering(self, plan: plan_lib.Plan):
    return "lowered " + plan.describe(), functools.partial(self.backend.stage, plan, self.key,
                                                           self.args, self.kwargs)

  def _pricing(self, family: plan_lib.Plan):
    return "priced " + family.describe(), functools.partial(
        self.step.flops, family, self.args, self.kwargs, len(self.backend.devices()))

  def _make(self, what: str, job, started: float) -> float:
    """Runs one job, recorded in `done`: its seconds."""
    t0 = time.perf_counter()
    job()
    self.done.append(what)
    seconds = time.perf_counter() - t0
    logging.debug("hbm_guard: prepared: %s (%.1f s, %.1f s into the compile)", what, seconds,
                  time.perf_counter() - started)
    return seconds

  def _step_facts(self, facts: compile_lib.TraceFacts) -> rungs_lib.StepFacts:
    trial = compile_lib.Trial(self.plan, compile_lib.Outcome.OOM, 0.0, facts)  # facts only
    return self.backend.step_facts(self.args, self.kwargs, trial)

  def _jobs(self, step_facts: rungs_lib.StepFacts, started: float):
    dear = time.perf_counter() - started >= tuning.DEAR_COMPILE_SECONDS
    o = self.options
    probes, others = space.opening(o.ladder, self.plan, step_facts, o.max_class, dear)
    # Dear probes, compiles side by side: the planner races compiles, not probes (the
    # failed plan's own family waits for its figure; the others' cheapest do not).
    race = dear and self.at_once and self.backend.stages
    for p in [] if race else probes:
      yield self._lowering(p)
    for f in others:
      yield self._pricing(f)
    if race:
      _, counts, _ = space.families(o.ladder, self.plan, step_facts, o.max_class)
      flops = lambda f: self._pricing(f)[1]()  # noqa: E731  (priced above)
      for p in space.race_opening(others, counts, flops, self.width,
                                        step_facts.offload_bytes):
        yield self._lowering(p)
