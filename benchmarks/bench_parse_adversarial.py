"""Parse time of adversarial logs: runs of whitespace (every character `str.isspace()`
accepts) and repeated fragments, 1 MiB each.

    .venv/bin/python benchmarks/bench_parse_adversarial.py [--size-kib 1024]

A log is untrusted input; parse time must grow linearly. Prints seconds per input.
"""

import argparse
import time

from hbm_guard._src.record import record


def adversarial_inputs(size: int) -> dict[str, str]:
  """Shapes that make backtracking regexes quadratic, each about `size` characters."""
  head = "RESOURCE_EXHAUSTED: out of memory\n"
  total = "Ran out of memory in memory space hbm. Used 1.00G of 512.00M hbm.\nTotal hbm usage >= 1.00G:\n"
  return {
      "newlines after a headline": head + "\n" * size,
      "spaces after a headline": head + " " * size,
      "tabs and spaces": head + " \t" * (size // 2),
      "CR LF runs": head + "\r\n" * (size // 2),
      "total block row of spaces": total + "    reserved" + " " * size + "1.0M\n",
      "total block row, no size": total + "    reserved" + " " * size + "x\n",
      "row name of words": total + "    a" + " b" * (size // 2) + "\n",
      "listing size lines": "Largest program allocations in hbm:\n" + "  1. Size: 1.0G\n" * (size // 16),
      "operator field quotes": "Largest program allocations in hbm:\n  1. Size: 1.0G\n     Operator: op_name=\"" + "\\\"" * (size // 2) + "\n",
      "shape brackets": "Largest program allocations in hbm:\n  1. Size: 1.0G\n     Shape: f32[" + "1," * (size // 2) + "\n",
      "words of a headline repeated": "Ran out of memory in memory space " * (size // 34),
      "numbers without units": "Used " + "9" * size,
      "markdown quotes": "> " * (size // 2),
      "glog-ish prefixes": "I0101 00:00:00.0 1 " * (size // 19),
      "early check, long spaces": "Ran out of memory on HBM, the total memory required for HLO temporaries (" + " " * size,
      "reserve then spaces": "Attempting to reserve 1.0G at the bottom of memory." + " " * size,
      "size: anchors": "size: " * (size // 6),
      "sizes": "1.0G " * (size // 5),
      "parentheses": "(" * size,
      **{f"total rows of U+{ord(ch):04X}": total + ("    reserved" + ch * 4000 + "x\n") * (size // 4013)
         for ch in record.UNICODE_WHITESPACE if ch not in " \n"},
      "1 MiB of every whitespace": total + record.UNICODE_WHITESPACE * (size // len(record.UNICODE_WHITESPACE)),
  }


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--size-kib", type=int, default=1024)
  args = parser.parse_args()
  size = args.size_kib << 10
  worst = 0.0
  for name, text in adversarial_inputs(size).items():
    t0 = time.perf_counter()
    record.parse(text)
    dt = time.perf_counter() - t0
    worst = max(worst, dt)
    print(f"{name:<32} {len(text) / 2**20:5.2f} MiB  {dt:7.3f} s")
  print(f"worst: {worst:.3f} s")


if __name__ == "__main__":
  main()
