"""BENCHMARKS.md is what the benchmarks print: this regenerates it.

    .venv/bin/python -m benchmarks.regenerate                 # every benchmark: hours here
    .venv/bin/python -m benchmarks.regenerate --only plan_quality,models

Each benchmark below runs in a process of its own (`PYTHONPATH=.`, `ALLOW_MULTIPLE_LIBTPU_LOAD`
unset: one at a time), and its output becomes its section, headed by the command and the
commit, machine and versions it ran on. With `--only`, the other sections are kept as the
file has them. The file is written atomically. History lives in git, not in the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUT = os.path.join(ROOT, "BENCHMARKS.md")


@dataclasses.dataclass(frozen=True)
class Benchmark:
  name: str
  title: str
  args: tuple[str, ...]
  why: str  # what it measures, one sentence


BENCHMARKS = (
    Benchmark("plan_quality", "Of the plans that fit, the fastest",
              ("-m", "benchmarks.bench_plan_quality"),
              "five models the tests do not use x three capacities on this CPU: the plan the "
              "guard settles on against the fastest plan that fits, every plan timed"),
    Benchmark("target_quality", "For a target: of the plans that fit, the one estimated fastest",
              ("-m", "benchmarks.bench_target_quality", "--model", "lm,lm512,mixer"),
              "three models for v5e:1x1 x three capacities: the search's plan, and the plan "
              "kept with `estimated_rivals=3`, against the plan libtpu's program estimates "
              "fastest of every plan that fits"),
    Benchmark("main_job", "The README job's fit against one compile",
              ("-m", "benchmarks.bench_main_job", "--runs", "3"),
              "the README's main job on v5e:1x1 at 96 MiB, fitted with the plan cache on"),
    Benchmark("models", "Steps the project was not written against",
              ("-m", "benchmarks.bench_models"),
              "five unmodified Flax steps on v5e:1x1: plan, compiles, probes, seconds"),
    Benchmark("fit", "Compiles to fit, against what people use today",
              ("-m", "benchmarks.bench_fit"),
              "hbm_guard against batch-size finders and the ladder, on five cases"),
    Benchmark("scale", "At a real size: a 368M-parameter LM on one v5e chip",
              ("-m", "benchmarks.bench_scale", "--skip-halving"),
              "fit seconds against one compile of the plan found, abstract arguments"),
    Benchmark("scale_unmodified", "At a real size, the step unmodified",
              ("-m", "benchmarks.bench_scale", "--unmodified", "--skip-halving"),
              "the same, with nothing plan-aware in the step: the drop-in's analysis"),
    Benchmark("archs", "Fit cost across architectures, at real sizes",
              ("-m", "benchmarks.bench_archs"),
              "six unmodified steps of five kinds (a decoder LM with a 262k vocabulary, an "
              "encoder-decoder, ViT-L/16, layers under nn.scan and nn.remat, a mixture of "
              "experts; the decoder LM also at 1.3B on four chips): the fit against one "
              "compile of the plan it keeps"),
    Benchmark("breakdown", "Where the memory goes, at a real size",
              ("-m", "benchmarks.bench_breakdown"),
              "the 368M LM unmodified for v5e:1x1 fitted with the memory breakdown on and "
              "off: what it adds to the fit, the kept plan's breakdown, and the first "
              "program's parts predicted under the plan kept against the compiled ones"),
    Benchmark("breakdown_vit", "Where the memory goes, on a kind the tests do not use",
              ("-m", "benchmarks.bench_breakdown", "--model", "vit"),
              "bench_models' ViT (8 blocks, bf16 attention and MLP) for v5e:1x1 at 1 GiB, "
              "fitted with the memory breakdown on and off: the kept plan's breakdown, and "
              "the first program's parts predicted under the plan kept against the compiled "
              "ones"),
    Benchmark("call_overhead", "What the guard adds to a call",
              ("-m", "benchmarks.bench_call_overhead"),
              "per-call time against jax.jit, interleaved"),
    Benchmark("exactness_fuzz", "The drop-in against jax.jit",
              ("-m", "benchmarks.bench_exactness_fuzz", "--programs", "2000"),
              "random loss programs split under pinned microbatch plans: none may differ"),
    Benchmark("outside", "Train steps nobody here wrote",
              ("-m", "benchmarks.bench_outside"),
              "six readings of steps written by sessions that had not read the analysis's "
              "rules, each under microbatch(4) against jax.jit: what splits, what is refused "
              "and why, and none may differ"),
    Benchmark("offload", "Optimizer-state offload on v5e",
              ("-m", "benchmarks.bench_offload"), "device peak by libtpu's own figures"),
    Benchmark("parse", "Parsing untrusted logs", ("-m", "benchmarks.bench_parse_adversarial"),
              "parse time of adversarial inputs: linear"),
    Benchmark("explain", "Explaining a large log", ("-m", "benchmarks.bench_explain"),
              "`hbm-guard explain` on 100 MB"),
)
_BY_NAME = {b.name: b for b in BENCHMARKS}
_MARK = "<!-- benchmark: {} -->"
_SECTION = re.compile(r"<!-- benchmark: (\w+) -->\n(.*?)(?=<!-- benchmark: |\Z)", re.S)
_NOISE = re.compile(r"^(E0000 |I\d{4} |W\d{4} |WARNING|Failed to find host bounds|Source Loc)")


def _versions() -> str:
  out = subprocess.run(
      [sys.executable, "-c", "import jax, jaxlib, importlib.metadata as m; "
       "print(jax.__version__, jaxlib.__version__, m.version('libtpu'))"],
      capture_output=True, text=True, cwd=ROOT, check=False).stdout.split()
  jax_v, jaxlib_v, libtpu_v = (out + ["?"] * 3)[:3]
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=ROOT, check=False).stdout.strip() or "?"
  return (f"commit {commit}, {platform.machine()} ({os.cpu_count()} cores), Python "
          f"{platform.python_version()}, jax {jax_v}, jaxlib {jaxlib_v}, libtpu {libtpu_v}")


def run(bench: Benchmark) -> str:
  """The benchmark's section: its command, where it ran, and what it printed."""
  env = {**os.environ, "PYTHONPATH": ROOT, "HBM_GUARD_PLAN_CACHE": "off"}
  env.pop("ALLOW_MULTIPLE_LIBTPU_LOAD", None)
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, *bench.args], capture_output=True, text=True,
                        cwd=ROOT, env=env, check=False)
  seconds = time.perf_counter() - t0
  lines = [l for l in proc.stdout.splitlines() if not _NOISE.match(l)]
  if proc.returncode:
    lines += ["", f"(exited {proc.returncode})"] + proc.stderr.splitlines()[-20:]
  body = "\n".join(lines).strip()
  tabular = body.startswith("|") or "\n|" in body
  command = " ".join(["python", *bench.args])
  return "\n".join([
      _MARK.format(bench.name), f"## {bench.title}", "",
      f"{bench.why[0].upper()}{bench.why[1:]}. `{command}`; {_versions()}; "
      f"{seconds:.0f} s.", "",
      body if tabular else f"```\n{body}\n```", "", ""])


def _existing(path: str) -> dict[str, str]:
  if not os.path.exists(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return {m.group(1): _MARK.format(m.group(1)) + "\n" + m.group(2)
            for m in _SECTION.finditer(f.read())}


def missing(path: str = OUTPUT) -> list[str]:
  """The registered benchmarks the file has no section for (CI keeps this empty)."""
  have = _existing(path)
  return [b.name for b in BENCHMARKS if b.name not in have]


def write(path: str, sections: dict[str, str]) -> None:
  head = ("# Benchmarks\n\nWhat `benchmarks/` prints, regenerated by "
          "`.venv/bin/python -m benchmarks.regenerate` (`--only NAME,...` for some). "
          "Seconds are the machine's named in each section.\n\n")
  text = head + "".join(sections[b.name] for b in BENCHMARKS if b.name in sections)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", suffix=".md")
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    f.write(text)
  os.replace(tmp, path)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--only", default=None, help="comma-separated names: " +
                      ", ".join(_BY_NAME))
  parser.add_argument("--output", default=OUTPUT)
  args = parser.parse_args()
  names = args.only.split(",") if args.only else list(_BY_NAME)
  unknown = [n for n in names if n not in _BY_NAME]
  if unknown:
    parser.error(f"unknown benchmark(s) {unknown}; known: {', '.join(_BY_NAME)}")
  sections = _existing(args.output) if args.only else {}
  for name in names:
    print(f"running {name} ...", flush=True)
    sections[name] = run(_BY_NAME[name])
    write(args.output, sections)  # after each: a long run interrupted keeps what it made


if __name__ == "__main__":
  main()
