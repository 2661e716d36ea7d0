"""The drop-in on train steps nobody here wrote (`benchmarks/outside/`, six readings): each
step under a pinned microbatch(4) plan against jax.jit, as a user's step would be split.

Prints, per reading: the steps their author judged splittable, how many split and how many
were refused; steps that trained differently from jax.jit while the report said exact (must
be 0), and crashes (must be 0); then each refusal of a step its author judged splittable,
with the guard's reason.

    PYTHONPATH=. .venv/bin/python -m benchmarks.bench_outside [--only reading3]
"""

from __future__ import annotations

import argparse
import collections
import importlib
import time

import jax

from hbm_guard._src.plans import plan as plan_lib
from tests.exactness import harness

READINGS = ("reading1", "reading2", "reading3", "reading4", "reading5", "reading6")


def judge(case) -> tuple[str, str]:
  """(verdict, what the guard said): ok | refused | split? | different | crash."""
  try:
    o = harness.under_plan(case, plan_lib.Plan(microbatches=4))
  except Exception as e:  # pylint: disable=broad-except  (a crash is a finding, printed)
    return "crash", f"{type(e).__name__}: {str(e)[:200]}"
  if o.split and o.different and not case.stochastic:
    return "different", f"d={o.distance:.2e} (float64: {o.distance64})"
  if case.expect_split and not o.split:
    return "refused", o.refused or ""
  if case.expect_split is False and o.split:
    return "split?", o.auto or ""
  return "ok", ""


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--only", default=",".join(READINGS))
  a = p.parse_args()
  print("| reading | steps | judged splittable | split | refused | different | crashed | s |")
  print("|---|---|---|---|---|---|---|---|")
  notes = []
  for name in a.only.split(","):
    cases = importlib.import_module(f"benchmarks.outside.{name}").CASES
    t0 = time.perf_counter()
    got = collections.Counter()
    for c in cases:
      verdict, said = judge(c)
      jax.clear_caches()  # (400 steps' executables held at once ran this machine out of memory)
      got[verdict] += 1
      if c.expect_split:
        got["splittable"] += 1
        got["split"] += verdict == "ok"
      if verdict != "ok":
        notes.append(f"{name} {verdict:9} {c.name}: {said[:220]}")
    print(f"| {name} | {len(cases)} | {got['splittable']} | {got['split']} | "
          f"{got['refused']} | {got['different']} | {got['crash']} | "
          f"{time.perf_counter() - t0:.0f} |")
  print()
  print("\n".join(notes))


if __name__ == "__main__":
  main()
