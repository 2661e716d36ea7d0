"""XLA's own account of a program's memory, read from its dump: the buffer assignment
(every allocation, and the values placed in it), the values' live ranges over the
schedule, and the optimized HLO (each instruction's op name, a Flax module path in its name
stack, and its source frames).

libtpu (and XLA:CPU, XLA:GPU) write these with `xla_dump_to` even for a compile that fails
its memory check: the early check that fails most of the guard's probes runs after buffer
assignment. Everything here is untrusted text: each file is read up to a size bound, each
line is parsed on its own in linear time, and a malformed line is skipped (the result is
partial, never an exception).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

MAX_FILE_BYTES = 512 << 20  # a 1B-parameter LM's optimized HLO is tens of MiB

_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*)$")
_VALUE = re.compile(r"^ value: <(\d+) ([^ {>]+)(\{[^}]*\})? @(\d+)> "
                    r"\(size=(\d+),offset=(\d+)\): (.*)$")
_RANGE = re.compile(r"^\s+(\S+\{[^}]*\}):(\d+)-(\d+)$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([^ ]+) = (.+?) ([a-z][a-z0-9-]*)\(")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME_ID = re.compile(r"stack_frame_id=(\d+)")
_PARAMETER = re.compile(r"\bparameter\((\d+)\)")
_TABLE_ROW = re.compile(r"^(\d+) (.*)$")
_FIELD = re.compile(r"(\w+)=(\d+)")


@dataclasses.dataclass(frozen=True)
class Value:
  """A value XLA placed in an allocation: its instruction (and tuple index), bytes, offset."""
  key: str  # "name{index}", as the live ranges name it
  name: str  # the instruction
  size: int
  offset: int
  shape: str  # with XLA's layout and tiling, e.g. f32[8192,256]{1,0:T(8,128)}


@dataclasses.dataclass(frozen=True)
class Allocation:
  index: int
  size: int
  color: int  # memory space: 0 is HBM (device memory); others on-chip (VMEM, SMEM, ...)
  parameter: int | None  # the entry parameter it holds, if any
  live_out: bool  # holds (part of) the program's output
  temp: bool  # XLA's preallocated arena of temporaries
  thread_local: bool
  constant: bool
  values: tuple[Value, ...]


@dataclasses.dataclass(frozen=True)
class Instruction:
  opcode: str
  shape: str
  op_name: str  # the jax name stack: "jit(step)/jvp(LM)/block_2/Dense_0/dot_general"
  frame: int | None  # a stack frame id (see Dump.frames)
  parameter: int | None  # for entry parameters: the number


@dataclasses.dataclass(frozen=True)
class Dump:
  """What was read of one program's dump (any part may be empty: then said so)."""
  allocations: tuple[Allocation, ...]
  ranges: dict  # value key -> (first, last) position in the schedule
  instructions: dict  # instruction name -> Instruction
  frames: dict  # stack frame id -> (file, line, function, parent frame id)
  files: tuple[str, ...]  # the dump's files read
  notes: tuple[str, ...] = ()  # what could not be read, and why

  def source_of(self, frame: int | None, skip=("site-packages", "dist-packages")) -> str | None:
    """The innermost frame of `frame`'s stack in the user's own code ("train.py:17"),
    else its innermost frame."""
    first, seen = None, set()
    while frame is not None and frame in self.frames and frame not in seen:
      seen.add(frame)
      file, line, _, parent = self.frames[frame]
      here = f"{os.path.basename(file)}:{line}"
      first = first or here
      if not any(s in file for s in skip) and "/hbm_guard/" not in file:
        return here
      frame = parent
    return first


def find(directory: str) -> dict[str, str] | None:
  """The files of the program in `directory` (the largest buffer assignment where several
  modules were dumped): {"assignment", "ranges", "hlo"} -> path, or None."""
  assignments = glob.glob(os.path.join(directory, "*after_optimizations-buffer-assignment.txt"))
  if not assignments:
    return None
  assignment = max(assignments, key=lambda p: (_size(p), p))
  stem = assignment[:-len("-buffer-assignment.txt")]
  return {"assignment": assignment, "ranges": stem + "-live-range.txt", "hlo": stem + ".txt"}


def _size(path: str) -> int:
  try:
    return os.path.getsize(path)
  except OSError:
    return 0


def read(directory: str) -> Dump | None:
  """The dump in `directory`, parsed (None where XLA wrote none)."""
  paths = find(directory)
  if paths is None:
    return None
  notes, texts = [], {}
  for what, path in paths.items():
    texts[what], note = _read(path)
    if note:
      notes.append(f"{what}: {note}")
  instructions, frames = parse_hlo(texts["hlo"])
  return Dump(parse_assignment(texts["assignment"]), parse_ranges(texts["ranges"]),
              instructions, frames, tuple(os.path.basename(p) for p in paths.values()),
              tuple(notes))


def _read(path: str) -> tuple[str, str | None]:
  try:
    size = os.path.getsize(path)
    if size > MAX_FILE_BYTES:
      return "", f"{os.path.basename(path)} is {size} bytes, over {MAX_FILE_BYTES}: not read"
    with open(path, encoding="utf-8", errors="replace") as f:
      return f.read(MAX_FILE_BYTES), None
  except OSError as e:
    return "", f"{os.path.basename(path)} could not be read ({e.strerror})"


def parse_assignment(text: str) -> tuple[Allocation, ...]:
  """XLA's BufferAssignment text: each allocation with the values placed in it."""
  out: list[Allocation] = []
  current = None
  values: list[Value] = []

  def close():
    if current is not None:
      out.append(dataclasses.replace(current, values=tuple(values)))

  for line in text.splitlines():
    m = _ALLOCATION.match(line)
    if m:
      close()
      rest = m.group(3)
      color = re.search(r"\bcolor (\d+)", rest)
      param = re.search(r"\bparameter (\d+)", rest)
      current = Allocation(
          int(m.group(1)), int(m.group(2)), int(color.group(1)) if color else 0,
          int(param.group(1)) if param else None, "live-out" in rest or "output shape" in rest,
          "preallocated-temp" in rest, "thread-local" in rest, "constant" in rest, ())
      values = []
      continue
    v = _VALUE.match(line)
    if v and current is not None:
      name, index = v.group(2), v.group(3) or "{}"
      values.append(Value(name + index, name, int(v.group(5)), int(v.group(6)), v.group(7)))
    elif line and not line.startswith((" ", "\t")) and current is not None:
      close()  # the assignment's listing is over (its statistics follow)
      current = None
  close()
  return tuple(out)


def parse_ranges(text: str) -> dict[str, tuple[int, int]]:
  """XLA's HloLiveRange text: each value's first and last position in the schedule."""
  out = {}
  for line in text.splitlines():
    m = _RANGE.match(line)
    if m:
      out[m.group(1)] = (int(m.group(2)), int(m.group(3)))
  return out


def parse_hlo(text: str) -> tuple[dict[str, Instruction], dict]:
  """The optimized HLO's instructions (opcode, shape, op name, stack frame) and its stack
  frame tables, resolved to (file, line, function, parent frame)."""
  instructions: dict[str, Instruction] = {}
  tables: dict[str, dict[int, str]] = {}
  table = None
  for line in text.splitlines():
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      table = tables.setdefault(line, {})
      continue
    if table is not None:
      row = _TABLE_ROW.match(line)
      if row:
        table[int(row.group(1))] = row.group(2)
        continue
      table = None
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    op = _OP_NAME.search(line)
    frame = _FRAME_ID.search(line)
    param = _PARAMETER.search(line) if m.group(3) == "parameter" else None
    instructions[m.group(1)] = Instruction(
        m.group(3), m.group(2), op.group(1).replace("\\'", "'") if op else "",
        int(frame.group(1)) if frame else None, int(param.group(1)) if param else None)
  return instructions, _frames(tables)


def _frames(tables: dict) -> dict:
  def fields(row: str) -> dict[str, int]:
    return {k: int(v) for k, v in _FIELD.findall(row)}
  names = {k: v.strip('"') for k, v in tables.get("FileNames", {}).items()}
  functions = {k: v.strip('"') for k, v in tables.get("FunctionNames", {}).items()}
  locations = {k: fields(v) for k, v in tables.get("FileLocations", {}).items()}
  out = {}
  for k, row in tables.get("StackFrames", {}).items():
    f = fields(row)
    loc = locations.get(f.get("file_location_id", -1), {})
    parent = f.get("parent_frame_id", 0) - 1  # printed one above the parent's id; 0: none
    out[k] = (names.get(loc.get("file_name_id", -1), "?"), loc.get("line", 0),
              functions.get(loc.get("function_name_id", -1), "?"),
              parent if parent >= 1 else None)
  return out
