"""A compiled step's time on a target, estimated from the program the compiler wrote.

Where the step only compiles for a target (`target=`, preflight) nothing can be timed, and
`cost_analysis()` does not rank plans: it counts a loop's body once (a microbatch loop's
flops halve as its count doubles) and libtpu's `optimal_seconds` came out negative. This
reads the optimised HLO instead: each instruction's time is libtpu's own per-op estimate
(`estimated_cycles` in its backend config) at the chip's clock where it gives one, else a
roofline, `max(flops / peak FLOP/s, bytes / HBM bandwidth)`; a `while` counts its body
times its trip count, a `conditional` its dearest branch. Asynchronous transfers (a
`copy-start`/`copy-done` pair: libtpu's prefetches into VMEM, async slices, collectives)
run beside the computation that issues them: each is priced once, by the bytes it moves,
and a computation costs the larger of its compute and its transfers. Priced as blocking,
twice each, they had put an unsplit step without remat 2.8x behind full remat on v5e
(bench_target_quality's lm: 9.5 ms against 3.4), where the two compute within 2%. A
collective's bytes are priced at HBM bandwidth, which ICI does not reach: across chips the
figure is low. An estimate, and said to be one.

The text is untrusted in the sense that matters here: it is parsed in one pass, in time
linear in its length, and whatever it does not recognise costs nothing rather than raising.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
import time
from typing import Any, Callable, Iterable

from absl import logging

_ITEMSIZE = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
             "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8,
             "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8\w*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply|true_computation|false_computation)"
                     r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_DIM_LABELS = re.compile(r"dim_labels=\w+_(\w+)->")
_CONSTANT = re.compile(r"(-?\d+)\)")  # a constant's operand text, after "constant("
_FREE = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                   "after-all", "partition-id", "replica-id", "iota", "opt-barrier"})
# The start of an asynchronous transfer costs nothing: its done is priced, by what it moves.
# An `async-done` costs nothing either: its `async-start` prices the computation it calls.
_ASYNC_START = frozenset({"copy-start", "slice-start", "all-gather-start", "all-reduce-start",
                          "collective-permute-start", "send", "recv", "async-done"})
_ASYNC_DONE = frozenset({"copy-done", "slice-done", "all-gather-done", "all-reduce-done",
                         "collective-permute-done", "send-done", "recv-done"})
# Custom calls that move nothing: libtpu's bitcast of buffers laid out side by side.
_FREE_TARGETS = frozenset({"ConcatBitcast"})
_TARGET = re.compile(r'custom_call_target="([^"]*)"')
MAX_TRIP = 1 << 20  # a trip count read from the text is believed up to this
MAX_NESTING = 64  # computations called within computations, deeper than XLA writes them


@dataclasses.dataclass(frozen=True)
class DeviceSpeed:
  """What a roofline needs of a chip: peak dense bf16 FLOP/s, HBM bytes/s, and the clock
  libtpu's per-op cycle estimates are counted in (None where it is not published)."""
  peak_flops: float
  hbm_bytes_per_second: float
  clock_hz: float | None = None

  @classmethod
  def from_entry(cls, entry: dict[str, Any]) -> "DeviceSpeed | None":
    """From a `configs/devices.json` entry; None where it lacks the figures."""
    try:
      flops, bandwidth = float(entry["peak_tflops"]) * 1e12, float(entry["hbm_gbps"]) * 1e9
      clock = entry.get("clock_ghz")
      clock = float(clock) * 1e9 if clock else None
    except (KeyError, TypeError, ValueError):
      return None
    if not (flops > 0 and bandwidth > 0) or (clock is not None and clock <= 0):
      return None
    return cls(flops, bandwidth, clock)


@dataclasses.dataclass(frozen=True)
class Estimate:
  """A step's estimated seconds, and how many instructions each source priced."""
  seconds: float
  by_cycles: int  # instructions priced by the compiler's own cycle estimate
  by_roofline: int  # priced by flops and bytes against the chip's peaks
  read_seconds: float = 0.0  # what reading the program cost the fit

  def to_dict(self) -> dict[str, Any]:
    return {"seconds": self.seconds, "by_compiler_cycles": self.by_cycles,
            "by_roofline": self.by_roofline, "read_seconds": round(self.read_seconds, 3)}


@dataclasses.dataclass
class _Instruction:
  name: str
  shape: str
  opcode: str
  rest: str


def _array_bytes(shape: str) -> tuple[int, list[list[int]]]:
  total, dims = 0, []
  for dtype, text in _ARRAY.findall(shape):
    d = [int(x) for x in text.split(",") if x]
    dims.append(d)
    total += math.prod(d) * _ITEMSIZE.get(dtype, 1)
  return total, dims


def _split_shape(text: str) -> tuple[str, str]:
  """'(f32[2], s32[]) while(...)' -> ('(f32[2], s32[])', ' while(...)'): a tuple's shape
  holds spaces, so its parentheses are matched."""
  if not text.startswith("("):
    head, _, tail = text.partition(" ")
    return head, " " + tail
  depth = 0
  for i, ch in enumerate(text):
    depth += ch == "("
    depth -= ch == ")"
    if depth == 0:
      return text[:i + 1], text[i + 1:]
  return text, ""


def parse(text: str) -> tuple[dict[str, list[_Instruction]], str | None]:
  """Computations by name, each its instructions, and the entry's name."""
  computations: dict[str, list[_Instruction]] = {}
  entry, current = None, None
  for line in text.splitlines():
    if current is None:
      m = _HEADER.match(line) if line.rstrip().endswith("{") else None  # bounds the regex
      if m:
        current = computations.setdefault(m.group(2), [])
        if m.group(1):
          entry = m.group(2)
      continue
    if line.strip() == "}":
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    shape, tail = _split_shape(line[m.end():])
    op = _OPCODE.match(tail)
    if op:
      current.append(_Instruction(m.group(1), shape, op.group(1), tail[op.end():]))
  return computations, entry


class _Pricer:
  def __init__(self, computations: dict[str, list[_Instruction]], speed: DeviceSpeed):
    self.computations, self.speed = computations, speed
    self.memo: dict[str, tuple[float, int, int]] = {}
    self.flops_memo: dict[str, float] = {}
    self.depth = 0

  def _over(self, memo: dict, name: str, price: Callable, add: Callable, zero):
    """`price` summed over computation `name`'s instructions, once per name: a cycle in
    the text, or nesting past MAX_NESTING, costs nothing rather than recursing."""
    if name in memo or self.depth >= MAX_NESTING:
      return memo.get(name, zero)
    memo[name] = zero
    body = self.computations.get(name, ())
    shapes = {i.name: i.shape for i in body}
    total = zero
    self.depth += 1
    for ins in body:
      total = add(total, price(ins, shapes))
    self.depth -= 1
    memo[name] = total
    return total

  def computation(self, name: str) -> tuple[float, int, int]:
    """(seconds, by cycles, by roofline) of computation `name`: the larger of its compute
    and the asynchronous transfers it overlaps with that compute."""
    compute, moved, cycles, roofline = self._over(self.memo, name, self._overlapped, _add,
                                                  (0.0, 0.0, 0, 0))
    return (max(compute, moved), cycles, roofline)

  def _overlapped(self, ins: _Instruction, shapes: dict[str, str]
                  ) -> tuple[float, float, int, int]:
    if ins.opcode in _ASYNC_START:
      return (0.0, 0.0, 0, 0)
    if ins.opcode in _ASYNC_DONE:
      return (0.0, _array_bytes(ins.shape)[0] / self.speed.hbm_bytes_per_second, 0, 1)
    seconds, cycles, roofline = self.instruction(ins, shapes)
    return (seconds, 0.0, cycles, roofline)

  def fused_flops(self, name: str) -> float:
    return self._over(self.flops_memo, name, self._op_flops, operator.add, 0.0)

  def _op_flops(self, ins: _Instruction, shapes: dict[str, str]) -> float:
    called = dict(_CALLED.findall(ins.rest))
    if ins.opcode == "fusion" and "calls" in called:
      return self.fused_flops(called["calls"])
    return _flops(ins, shapes)

  def instruction(self, ins: _Instruction, shapes: dict[str, str]) -> tuple[float, int, int]:
    if ins.opcode in _FREE:
      return (0.0, 0, 0)
    if ins.opcode == "custom-call":
      target = _TARGET.search(ins.rest)
      if target and target.group(1) in _FREE_TARGETS:
        return (0.0, 0, 0)
    called = dict(_CALLED.findall(ins.rest))
    if ins.opcode == "while" and "body" in called:
      body = _add(self.computation(called["body"]),
                  self.computation(called.get("condition", "")))
      trips = _trip_count(ins.rest, self.computations.get(called.get("condition", ""), ()))
      return (body[0] * trips, body[1], body[2])
    if ins.opcode == "conditional":
      branches = [b.strip().lstrip("%") for m in _BRANCHES.findall(ins.rest)
                  for b in m.split(",")]
      branches += [called[k] for k in ("true_computation", "false_computation") if k in called]
      priced = [self.computation(b) for b in branches if b]
      return max(priced, default=(0.0, 0, 0))
    if ins.opcode in ("call", "async-start") and "calls" in called:
      return self.computation(called["calls"])
    cycles = _CYCLES.search(ins.rest)
    if cycles and self.speed.clock_hz:
      return (int(cycles.group(1)) / self.speed.clock_hz, 1, 0)
    out_bytes, _ = _array_bytes(ins.shape)
    in_bytes = sum(_array_bytes(shapes.get(op, ""))[0]
                   for op in _OPERAND.findall(ins.rest.split(")", 1)[0]))
    flops = self._op_flops(ins, shapes)
    seconds = max(flops / self.speed.peak_flops,
                  (out_bytes + in_bytes) / self.speed.hbm_bytes_per_second)
    return (seconds, 0, 1)


def _add(a: tuple, b: tuple) -> tuple:
  return tuple(x + y for x, y in zip(a, b))


def _flops(ins: _Instruction, shapes: dict[str, str]) -> float:
  """A dot's or a convolution's multiply-adds, twice; nothing for the rest (on the vector
  unit, their bytes dominate)."""
  if ins.opcode not in ("dot", "convolution"):
    return 0.0
  _, out = _array_bytes(ins.shape)
  operands = _OPERAND.findall(ins.rest.split(")", 1)[0])
  if not out or len(operands) < 2:
    return 0.0
  out_elems = math.prod(out[0])
  if ins.opcode == "dot":
    _, lhs = _array_bytes(shapes.get(operands[0], ""))
    m = _CONTRACTING.search(ins.rest)
    if not lhs or not m:
      return 0.0
    dims = [int(x) for x in m.group(1).split(",") if x]
    contracted = math.prod(lhs[0][d] for d in dims if d < len(lhs[0]))
    return 2.0 * out_elems * contracted
  _, rhs = _array_bytes(shapes.get(operands[1], ""))
  labels = _DIM_LABELS.search(ins.rest)
  if not rhs or not labels or "o" not in labels.group(1) or len(labels.group(1)) != len(rhs[0]):
    return 0.0
  out_features = rhs[0][labels.group(1).index("o")] or 1
  return 2.0 * out_elems * math.prod(rhs[0]) / out_features


def _trip_count(rest: str, condition: Iterable[_Instruction]) -> int:
  """A while's trip count: the compiler's `known_trip_count`, else the bound its condition
  compares against (`i < N`, from zero, as `lax.scan` and `fori_loop` write it), else 1."""
  known = _TRIP.search(rest)
  if known:
    return min(int(known.group(1)), MAX_TRIP)
  condition = list(condition)
  constants = {}
  for ins in condition:
    m = _CONSTANT.match(ins.rest) if ins.opcode == "constant" else None
    if m:
      constants[ins.name] = int(m.group(1))
  for ins in condition:
    if ins.opcode == "compare" and "direction=LT" in ins.rest:
      bounds = [constants[o] for o in _OPERAND.findall(ins.rest.split(")", 1)[0])
                if o in constants]
      if bounds and 0 < bounds[-1] <= MAX_TRIP:
        return bounds[-1]
  return 1


def estimate(hlo_text: str, speed: DeviceSpeed) -> Estimate | None:
  """The estimated seconds of one run of the optimised program `hlo_text` on a chip of
  `speed`; None where the text has no entry computation."""
  computations, entry = parse(hlo_text)
  if entry is None:
    return None
  seconds, by_cycles, by_roofline = _Pricer(computations, speed).computation(entry)
  return Estimate(seconds, by_cycles, by_roofline)


def of_compiled(compiled: Any, speed: DeviceSpeed | None) -> Estimate | None:
  """`estimate` of a `jax.stages.Compiled`; None where its text cannot be had."""
  if speed is None:
    return None
  t0 = time.perf_counter()
  try:
    text = compiled.as_text()
  except Exception:  # pylint: disable=broad-except  (a backend without it)
    return None
  if not isinstance(text, str):
    return None
  try:
    found = estimate(text, speed)
    return found and dataclasses.replace(found, read_seconds=time.perf_counter() - t0)
  except Exception as e:  # pylint: disable=broad-except  (a figure, never a failed fit)
    logging.warning("hbm_guard: no step-time estimate: %s: %s", type(e).__name__, e)
    return None
