"""Issue #10: two processes whose capacities differ end on one plan that fits both.
Issue #17: a time budget stops every process's fit together, none waiting past it."""

import json
import os
import socket
import subprocess
import sys
from tests import paths

ROOT = str(paths.ROOT)


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(capacities, *extra):
  port = _free_port()
  env = dict(os.environ, JAX_PLATFORMS="cpu", HBM_GUARD_PLAN_CACHE="off")
  procs = [subprocess.Popen([sys.executable, "-m", "tests.helpers.multihost_main", str(i), str(port),
                             cap, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env) for i, cap in enumerate(capacities)]
  outs = []
  results = []
  try:
    for p in procs:
      results.append(p.communicate(timeout=300))  # a hang fails here, not forever
  finally:
    for q in procs:  # only a failure or a hang leaves one running
      if q.poll() is None:
        q.kill()
  outs = []
  for p, (out, err) in zip(procs, results):
    assert p.returncode == 0, err[-3000:]
    outs.append(json.loads(out.strip().splitlines()[-1]))
  return outs


def test_different_capacities_end_on_one_plan_that_fits_both():
  # Process 0's plain compile fits; process 1's does not: only one process fails.
  a, b = _run(["roomy", "tight"])
  assert a["plan"] == b["plan"] and a["plan"]["microbatches"] > 1
  assert a["attempts"] == b["attempts"] and a["attempts"][0][1] == "oom"
  assert a["peak"] <= a["capacity"] and b["peak"] <= b["capacity"]
  assert a["loss"] == b["loss"]


def test_the_time_budget_stops_every_process_together_none_waiting_past_it():
  # Process 1's second compile is 60 s slower; the budget is 20 s. It stops waiting at the
  # budget, and process 0, whose compile was done, stops with it (alone, it would wait for
  # process 1 at the next collective).
  a, b = _run(["tight", "tight"], "60")
  assert a["ended"] == b["ended"] == "FitTimeBudgetError"
  assert b["compiles"] == 2 and not b["slow_compile_finished"]
