"""The drop-in's differential fuzzer, long: random loss programs over a batch, each split
under a pinned microbatch plan and run by jax.jit. Two families, alternating: maps of
`[B, F]` activations (tests/exactness/programs.py) and what large models do to `[B, L, F]`
tokens (tests/exactness/token_programs.py: flattened token axes with positions over them,
segments, labels, checkpoints, scans, many sums, a tuple batch). Prints how many were
split exactly, refused, different (a split that trains otherwise, its float64 run as far
apart: must be 0), rounding (apart in float32 only), refused as the guard's own bug (must
be 0) and crashed (where jax.jit does not: must be 0). A refused program is only traced:
the guard then runs jax's own gradient (the CI fuzzer, tests/dropin/test_exactness_fuzz.py, runs
them too).

  PYTHONPATH=. .venv/bin/python -m benchmarks.bench_exactness_fuzz --programs 10000 --workers 2
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import random
import sys
import time


def _run(seed: int, n: int) -> list[tuple[str, str]]:
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("HBM_GUARD_RAISE_INTERNAL", "1")  # (a bug crashes: counted)
  from tests.exactness import programs  # pylint: disable=import-outside-toplevel
  from tests.exactness import token_programs  # pylint: disable=import-outside-toplevel
  rng = random.Random(seed)
  out = []
  for i in range(n):
    family = token_programs if (seed + i) % 2 else programs
    verdict = programs.judge(family.random_program(rng), run_refused=False)
    kind = ("crashed" if verdict.error else "different" if verdict.silently_different
            else "bug" if verdict.internal_error else "rounding" if verdict.rounding
            else "split exactly" if verdict.split else "refused")
    out.append((kind, f"{verdict.program} {verdict.distance:.2e} "
                      f"(float64 {verdict.distance64}) {verdict.error or ''}"))
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--programs", type=int, default=200)
  parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  start = time.perf_counter()
  chunk = max(1, args.programs // (4 * args.workers))
  jobs = [(args.seed * 100003 + i, min(chunk, args.programs - i * chunk))
          for i in range((args.programs + chunk - 1) // chunk)]
  counts: collections.Counter = collections.Counter()
  bad = []
  with concurrent.futures.ProcessPoolExecutor(args.workers) as pool:
    for results in pool.map(_run, *zip(*jobs)):
      for kind, what in results:
        counts[kind] += 1
        if kind in ("different", "bug", "crashed"):
          bad.append(f"{kind}: {what}")
  seconds = time.perf_counter() - start
  print(f"programs tried: {sum(counts.values())} in {seconds:.0f} s ({args.workers} workers)")
  for kind in ("split exactly", "rounding", "refused", "different", "bug", "crashed"):
    print(f"  {kind}: {counts[kind]}")
  for line in bad[:20]:
    print("  " + line)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
