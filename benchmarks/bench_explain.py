"""Time to parse a large log: `hbm-guard explain` must read 100 MB in seconds, linearly.

    python benchmarks/bench_explain.py [--mb 100]
"""

import argparse
import pathlib
import time

import hbm_guard

CORPUS = pathlib.Path(__file__).resolve().parents[1] / "tests" / "data" / "corpus"


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--mb", type=int, default=100)
  a = p.parse_args()
  tail = (CORPUS / "021_au2018-detection-tpu-full-20-entries.txt").read_text()
  line = "I1130 10:00:00.000000 1 train.py:10] step 123 loss 0.512 tokens/s 123456\n"
  for mb in sorted({max(1, a.mb // 4), max(1, a.mb // 2), a.mb}):
    text = line * (mb * 2**20 // len(line)) + tail
    t0 = time.perf_counter()
    rec = hbm_guard.parse(text)
    dt = time.perf_counter() - t0
    print(f"{len(text) / 2**20:7.1f} MiB log: parsed in {dt:6.2f} s "
          f"({len(text) / 2**20 / dt:6.1f} MiB/s), {len(rec.allocations)} allocations")


if __name__ == "__main__":
  main()
