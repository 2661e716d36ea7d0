"""The E1000 record: XLA out-of-memory text parsed into numbers a program can act on.

`parse` reads a message, an exception, or a whole log around one, and returns an
`E1000Record`, or `None` when the text holds no memory out-of-memory error. It never
raises: a truncated message gives a partial record with everything that was present.

Sizes in XLA's messages ("63.80G", "420.0K", "3.47E") are binary units; the record holds
integer bytes. What a message does not say is `None`.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
from typing import Any, Mapping

# Kinds of record, by the message that produced them.
COMPILE_HBM = "compile_hbm"  # "Ran out of memory in memory space hbm. Used X of Y hbm."
COMPILE_HBM_EARLY = "compile_hbm_early"  # "HLO temporaries (X) exceeds available HBM (Y)"
COMPILE_HBM_TC_SC = "compile_hbm_tc_sc"  # "TPU TensorCore Hbm usage: X, SparseCore ..."
COMPILE_OTHER_MEMORY = "compile_other_memory"  # vmem / smem, E1001
RUNTIME_HBM = "runtime_hbm"  # TPU runtime: reserve / allocate failures
RUNTIME_GPU = "runtime_gpu"  # "Out of memory while trying to allocate N bytes"
BUDGET = "budget"  # hbm_guard's own: memory_analysis() above a user-set capacity

KINDS = (COMPILE_HBM, COMPILE_HBM_EARLY, COMPILE_HBM_TC_SC, COMPILE_OTHER_MEMORY,
         RUNTIME_HBM, RUNTIME_GPU, BUDGET)
COMPILE_KINDS = frozenset({COMPILE_HBM, COMPILE_HBM_EARLY, COMPILE_HBM_TC_SC, BUDGET})

MAX_BYTES = 1 << 80  # beyond any memory; a larger figure is a damaged field, dropped
# Byte counts that are amounts (never negative). Breakdown rows may be ("Available after
# request: -2.55G"), so they are not checked.
_AMOUNTS = ("used_bytes", "capacity_bytes", "exceeded_bytes", "temp_bytes", "tensorcore_bytes",
            "sparsecore_bytes", "requested_bytes", "free_bytes", "largest_free_bytes")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
          "P": 1 << 50, "E": 1 << 60}

# One size as XLA prints it: "63.80G", "0B", "420.0K", "14.30GiB", "-2.55G".
_SIZE = r"-?\d+(?:\.\d+)?\s?(?:[KMGTPE]i?B?|B)(?![A-Za-z0-9])"
_SIZE_RE = re.compile(r"(-?\d+(?:\.\d+)?)\s?([KMGTPE]?)(?:i?B)?(?![A-Za-z0-9])")


def parse_size(text: str | None) -> int | None:
  """'63.80G' -> 68504728371 (binary units). None when the text is not a size."""
  if not text:
    return None
  m = _SIZE_RE.fullmatch(text.strip().replace(",", ""))
  if not m or len(m.group(1)) > 40:  # no real size has 40 digits: an absurd field
    return None
  value = float(m.group(1)) * _UNITS[m.group(2)]
  if not math.isfinite(value) or abs(value) > MAX_BYTES:
    return None
  return int(round(value))


@dataclasses.dataclass(frozen=True)
class Allocation:
  """One entry of a "Largest program allocations" (or arguments/outputs) listing."""
  size_bytes: int | None = None
  unpadded_bytes: int | None = None
  padding_bytes: int | None = None
  shape: tuple[int, ...] | None = None  # None for tuple shapes
  dtype: str | None = None
  layout: str | None = None  # e.g. "1,2,0:T(8,128)"
  op_name: str | None = None
  op_type: str | None = None
  source_file: str | None = None
  source_line: int | None = None
  xla_label: str | None = None
  allocation_type: str | None = None
  shape_text: str | None = None

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["shape"] = list(self.shape) if self.shape is not None else None
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "Allocation":
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in d.items() if k in names}
    if kw.get("shape") is not None:
      kw["shape"] = tuple(kw["shape"])
    return cls(**kw)


@dataclasses.dataclass(frozen=True)
class E1000Record:
  """A parsed XLA out-of-memory error. Byte counts are ints; unknowns are None."""
  kind: str
  error_code: str | None = None
  memory_space: str | None = None
  used_bytes: int | None = None
  capacity_bytes: int | None = None
  exceeded_bytes: int | None = None
  temp_bytes: int | None = None
  tensorcore_bytes: int | None = None
  sparsecore_bytes: int | None = None
  requested_bytes: int | None = None
  free_bytes: int | None = None
  largest_free_bytes: int | None = None
  hlo_module: str | None = None
  device: str | None = None
  breakdown: Mapping[str, int | None] = dataclasses.field(
      default_factory=lambda: types.MappingProxyType({}))
  allocations: tuple[Allocation, ...] = ()
  arguments_and_outputs: tuple[Allocation, ...] = ()
  raw: str = ""

  def __post_init__(self):
    if not isinstance(self.breakdown, types.MappingProxyType):
      object.__setattr__(self, "breakdown", types.MappingProxyType(dict(self.breakdown)))
    object.__setattr__(self, "allocations", tuple(self.allocations))
    object.__setattr__(self, "arguments_and_outputs", tuple(self.arguments_and_outputs))

  @property
  def is_compile_time(self) -> bool:
    return self.kind in COMPILE_KINDS

  @property
  def required_bytes(self) -> int | None:
    """What the program needed, by the best figure the message gives."""
    if self.used_bytes is not None:
      return self.used_bytes
    if self.kind in (RUNTIME_HBM, RUNTIME_GPU) and self.requested_bytes is not None:
      return self.requested_bytes
    if self.tensorcore_bytes is not None or self.sparsecore_bytes is not None:
      return (self.tensorcore_bytes or 0) + (self.sparsecore_bytes or 0)
    if self.temp_bytes is not None:
      return self.temp_bytes
    if self.requested_bytes is not None:
      return self.requested_bytes
    return self.breakdown.get("program")

  @property
  def available_bytes(self) -> int | None:
    """What the request had to fit in: free memory at run time, else the capacity.

    A runtime reserve ("Attempting to reserve 3.95G ... There are 1.92G free") also prints
    the chip's capacity (8.00G), but other buffers held most of it: the free figure counts.
    """
    if self.kind in (RUNTIME_HBM, RUNTIME_GPU) and self.free_bytes is not None:
      return self.free_bytes
    if self.capacity_bytes is not None:
      return self.capacity_bytes
    return self.free_bytes

  @property
  def shortfall_bytes(self) -> int | None:
    """How far over: stated ("Exceeded ... by"), else required minus available."""
    if self.exceeded_bytes is not None:
      return self.exceeded_bytes
    need, have = self.required_bytes, self.available_bytes
    if need is None or have is None:
      return None
    return need - have

  def __reduce__(self):  # the read-only breakdown view does not pickle; its dict does
    return (_record_from_dict, (self.to_dict(),))

  def to_dict(self) -> dict[str, Any]:
    d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    d["breakdown"] = dict(self.breakdown)
    d["allocations"] = [a.to_dict() for a in self.allocations]
    d["arguments_and_outputs"] = [a.to_dict() for a in self.arguments_and_outputs]
    return d

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "E1000Record":
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {k: v for k, v in d.items() if k in names}
    kw["allocations"] = tuple(Allocation.from_dict(a) for a in d.get("allocations") or ())
    kw["arguments_and_outputs"] = tuple(
        Allocation.from_dict(a) for a in d.get("arguments_and_outputs") or ())
    kw["breakdown"] = dict(d.get("breakdown") or {})
    return cls(**kw)


def _record_from_dict(d: Mapping[str, Any]) -> E1000Record:
  return E1000Record.from_dict(d)


# --------------------------------------------------------------------------------------
# Cleaning: what logs and issue trackers wrap around the message.

_LINE_PREFIX = re.compile(
    r"^(?:"
    r"[ \t]*>[ \t]?"  # markdown quote
    r"|\(\w+(?:_\w+)* pid=\d+\)[ \t]?"  # (EngineCore_DP0 pid=896988)
    r"|[IWEF]\d{4}[ \t]+\d\d:\d\d:\d\d(?:\.\d+)?[ \t]+\d+[ \t]+[\w./\-]+:\d+\][ \t]?"  # glog
    r"|(?:\[\d+\][ \t]+)?\d{4}-\d\d-\d\d[ \t]+\d\d:\d\d:\d\d(?:\.\d+)?:[ \t][IWEF][ \t]"
    r"[\w./\-]+:\d+\][ \t]?"  # TF C++ log line
    r")+",
    re.MULTILINE)


# Logs are untrusted: runs of whitespace are where backtracking regexes go quadratic. Every
# character `str.isspace()` accepts is first made a space or a newline (Python's `\s` matches
# all of them: U+00A0, U+3000, U+2028, \x1f ...); then capping horizontal runs and dropping
# blank lines (both linear) bounds every `\s*`/`\s+` below.
UNICODE_WHITESPACE = ("\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2000\u2001\u2002\u2003"
                      "\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
_LINE_BREAKS = "\r\x1c\x1d\x1e\x85\u2028\u2029"
_WHITESPACE = str.maketrans({c: ("\n" if c in _LINE_BREAKS else " ")
                             for c in UNICODE_WHITESPACE if c not in "\n\t "})
_HORIZONTAL_RUN = re.compile(r"[ \t\f\v]{9,}")
_BLANK_LINES = re.compile(r"(?:\n[ \t\f\v]*)+\n")
_MAX_LINE = 4096  # longer lines are cut for the block parser: no table row is that long


def _clean(text: str) -> str:
  text = text.replace("\r\n", "\n").translate(_WHITESPACE).replace("**", "")
  text = _HORIZONTAL_RUN.sub(" " * 8, text)
  text = _BLANK_LINES.sub("\n", text)
  return _LINE_PREFIX.sub("", text)


# --------------------------------------------------------------------------------------
# The headline sentences. `\s+` between words tolerates re-wrapped lines.

def _words(*parts: str) -> str:
  return r"\s+".join(parts)


_S = f"({_SIZE})"
_RE_CLASSIC = re.compile(
    _words(r"Ran", r"out", r"of", r"memory", r"in", r"memory", r"space", r"(\w+)")
    + r"(?:\.\s+|\s+)"
    + r"(?:" + _words("Used", _S, "of", _S, r"\w+\.?") + r")?"
    + r"(?:\s+" + _words("Exceeded", r"\w+", "capacity", "by", _S) + r")?",
    re.IGNORECASE)
_RE_EARLY_TEMPS = re.compile(
    _words("Ran", "out", "of", "memory", "on", r"HBM,?", r"(?:the\s+)?total", "memory",
           "required", "for", "HLO", "temporaries", r"\(" + _S + r"\)", "exceeds",
           "available", "HBM", r"\(" + _S + r"\)")
    + r"(?:\.?\s+HLO\s+module:\s+([\w.\-]+?)\.?(?=\s|$))?",
    re.IGNORECASE)
_RE_EARLY_ABORT = re.compile(
    _words("Aborting", "compilation", "early", "because", "it's", "unlikely", "to", "have",
           "enough", r"memory\.", "Requires", _S + ",", "has", _S, "available"),
    re.IGNORECASE)
_RE_TC_SC = re.compile(
    _words("TensorCore", "Hbm", r"usage:?", _S + ",", "SparseCore", "Hbm", r"usage:?",
           _S + ",", "exceeding", "available", r"bytes:?", _S),
    re.IGNORECASE)
_RE_RESERVE = re.compile(
    r"(?:Error\s+loading\s+program(?:\s+'([^']*)')?:\s+)?"
    + _words("Attempting", "to", "reserve", _S, "at", "the", "bottom", "of", r"memory\.")
    + r"(?:\s+" + _words("That", "was", "not", r"possible\.", "There", "are", _S,
                         r"free,", _S, r"reserved,", "and", _S, "reservable") + r")?",
    re.IGNORECASE)
_RE_ALLOCATE = re.compile(
    r"(?:Error\s+allocating\s+device\s+buffer:\s+)?"
    + _words("Attempting", "to", "allocate", _S + r"\.", "That", "was", "not", r"possible\.")
    + r"(?:\s+" + _words("There", "are", _S, "free") + r")?"
    + r"(?:\.?;?\s*\((\w+)\))?",
    re.IGNORECASE)
_RE_FAILED_REQUEST = re.compile(
    _words("Failed", "to", "allocate", "request", "for", _S)
    + r"(?:\s*\((\d+)B\))?(?:\s+on\s+device\s+ordinal\s+(\d+))?",
    re.IGNORECASE)
_RE_GPU_BYTES = re.compile(
    _words("Out", "of", "memory", "while", "trying", "to", "allocate", r"(\d+)", "bytes"),
    re.IGNORECASE)
_RE_FRAGMENTATION = re.compile(
    _words("Due", "to", r"fragmentation,", "the", "largest", "contiguous", "region")
    + r"[^.\d]*?" + _S, re.IGNORECASE)
_RE_COMPACTION = re.compile(
    _words("maximum", "reservable", "bytes", "would", "be", _S), re.IGNORECASE)
_RE_CODE = re.compile(r"\b(E\d{4}):\s*([A-Z]\w+):")
_RE_BLOCK_ONLY = re.compile(
    r"^[ \t]*(?:Total\s+hbm\s+usage\s*>=|Program\s+hbm\s+requirement|"
    r"Largest\s+program\s+allocations\s+in\s+hbm|Largest\s+program\s+arguments|"
    r"program\s+" + _SIZE + r"\s*$|\d+\.\s+Size:\s*" + _SIZE + r"\s*$)",
    re.IGNORECASE | re.MULTILINE)

_HEADLINES = (_RE_CLASSIC, _RE_EARLY_TEMPS, _RE_EARLY_ABORT, _RE_TC_SC, _RE_RESERVE,
              _RE_ALLOCATE, _RE_FAILED_REQUEST, _RE_GPU_BYTES)


def _first_headline(text: str, start: int = 0) -> tuple[re.Pattern, re.Match] | None:
  best = None
  for pattern in _HEADLINES:
    m = pattern.search(text, start)
    if m and (best is None or m.start() < best[1].start()):
      best = (pattern, m)
  return best


def _headline_fields(pattern: re.Pattern, m: re.Match, text: str) -> dict[str, Any]:
  g = m.groups()
  if pattern is _RE_CLASSIC:
    space = g[0].lower()
    return dict(kind=COMPILE_HBM if space == "hbm" else COMPILE_OTHER_MEMORY,
                memory_space=space, used_bytes=parse_size(g[1]),
                capacity_bytes=parse_size(g[2]), exceeded_bytes=parse_size(g[3]))
  if pattern is _RE_EARLY_TEMPS:
    return dict(kind=COMPILE_HBM_EARLY, memory_space="hbm", temp_bytes=parse_size(g[0]),
                capacity_bytes=parse_size(g[1]), hlo_module=g[2])
  if pattern is _RE_EARLY_ABORT:
    return dict(kind=COMPILE_HBM_EARLY, memory_space="hbm", used_bytes=parse_size(g[0]),
                capacity_bytes=parse_size(g[1]))
  if pattern is _RE_TC_SC:
    return dict(kind=COMPILE_HBM_TC_SC, memory_space="hbm",
                tensorcore_bytes=parse_size(g[0]), sparsecore_bytes=parse_size(g[1]),
                capacity_bytes=parse_size(g[2]))
  if pattern is _RE_RESERVE:
    fields = dict(kind=RUNTIME_HBM, memory_space="hbm", hlo_module=g[0],
                  requested_bytes=parse_size(g[1]), free_bytes=parse_size(g[2]))
    extra = {"reserved": parse_size(g[3]), "reservable": parse_size(g[4])}
    fields["_breakdown"] = {k: v for k, v in extra.items() if v is not None}
    return fields
  if pattern is _RE_ALLOCATE:
    return dict(kind=RUNTIME_HBM, memory_space="hbm", requested_bytes=parse_size(g[0]),
                free_bytes=parse_size(g[1]), device=g[2])
  if pattern is _RE_FAILED_REQUEST:
    exact = int(g[1]) if g[1] else parse_size(g[0])
    window = text[max(0, m.start() - 2000):m.end() + 200].lower()
    on_tpu = "tpu" in window or "xrt" in window
    return dict(kind=RUNTIME_HBM if on_tpu else RUNTIME_GPU,
                memory_space="hbm" if on_tpu else "device", requested_bytes=exact,
                device=f"ordinal {g[2]}" if g[2] else None)
  if pattern is _RE_GPU_BYTES:
    return dict(kind=RUNTIME_GPU, memory_space="device", requested_bytes=int(g[0]))
  raise AssertionError(pattern)


# --------------------------------------------------------------------------------------
# The blocks under the headline: breakdown tables and allocation listings.

_RE_TOTAL = re.compile(r"^\s*Total\s+hbm\s+usage\s*>=\s*" + _S + r"\s*:?", re.I)
_RE_OUTPUT = re.compile(
    r"^\s*Output\s+size\s+(" + _SIZE + r"|unknown)"
    r"(?:\s*\([^)]*\))?(?:;\s*shares\s+" + _S + r"\s+with\s+arguments)?", re.I)
_RE_PROGRAM = re.compile(r"^\s*Program\s+hbm\s+requirement\s+" + _S + r"\s*:?", re.I)
_RE_CAPACITY = re.compile(r"^\s*HBM\s+capacity\s+" + _S + r"\s*:", re.I)
_RE_SECTION = re.compile(
    r"^\s*(Heap allocator status|Persistent allocations include[^:]*|"
    r"BufferAssignment stats|Peak buffers)\s*:", re.I)
_RE_LISTING = re.compile(
    r"^\s*Largest\s+program\s+(allocations|arguments\s+and\s+outputs)\s+in\s+(\w+)\s*:", re.I)
_RE_ENTRY = re.compile(r"^\s*(?:\d+\.\s+Size:\s*" + _S + r"|Buffer\s+\d+:\s*$)", re.I)
_RE_FIELD = re.compile(
    r"^\s*(Size|Operator|Shape|Unpadded size|Extra memory due to padding|XLA label|"
    r"Allocation type|Entry Parameter Subshape)\s*:\s*(.*)$", re.I)
_RE_ROW = re.compile(
    r"^\s*([A-Za-z][\w\- /]*?(?:\([^)]{0,200}\))?)\s*:?\s+(" + _SIZE + r"|unknown size)"
    r"(.*)$", re.I)
_RE_HLO_TEMP_DETAIL = re.compile(
    r"Unpadded\s*\(" + _S + r"\)\s*Padded\s*\(" + _S + r"\)", re.I)
_RE_FRAG_DETAIL = re.compile(r"fragmentation\s*\(" + _S + r"\)", re.I)
_RE_TOTAL_ROW = re.compile(r"^\s*(?:reserved|program|arguments)\s+" + _SIZE, re.I)
_RE_MAX_FREE = re.compile(r"^\s*Max\s+free\s+chunk\s+" + _S, re.I)
_RE_SEPARATOR = re.compile(r"^\s*=+\s*$")

_MAX_BLOCK_LINES = 20000
_MAX_STRAY_LINES = 8


def _operator_fields(text: str) -> dict[str, Any]:
  out: dict[str, Any] = {}
  for key in ("op_name", "op_type", "source_file"):
    m = re.search(key + r'="((?:[^"\\]|\\.)*)"?', text)
    if m:
      out[key] = m.group(1)
  m = re.search(r"source_line=(\d+)", text)
  if m:
    out["source_line"] = int(m.group(1))
  return out


_RE_SHAPE = re.compile(r"^(\w+)\[([\d,\s]*)\](?:\{([^}]*)\})?")


def _shape_fields(text: str) -> dict[str, Any]:
  out: dict[str, Any] = {"shape_text": text}
  m = _RE_SHAPE.match(text)
  if m:
    out["dtype"] = m.group(1)
    dims = [d for d in m.group(2).replace(" ", "").split(",") if d]
    out["shape"] = tuple(int(d) for d in dims)
    if m.group(3) is not None:
      out["layout"] = m.group(3)
  elif text.startswith("("):
    out["dtype"] = "tuple"
  return out


def _finish_entry(entry: dict[str, Any]) -> Allocation:
  if (entry.get("padding_bytes") is None and entry.get("size_bytes") is not None
      and entry.get("unpadded_bytes") is not None):
    entry["padding_bytes"] = entry["size_bytes"] - entry["unpadded_bytes"]
  return Allocation(**entry)


def _row_key(name: str) -> str:
  name = re.sub(r"\s*\([^)]*\)\s*$", "", name.strip())  # "reserved(Infeed/...)"
  return re.sub(r"\s+", " ", name)


def _entry_field(entry: dict[str, Any], key: str, value: str) -> None:
  """One "Key: value" line of a listing entry."""
  if key == "size":
    entry["size_bytes"] = parse_size(value)
  elif key == "operator":
    entry.update(_operator_fields(value))
  elif key in ("shape", "entry parameter subshape"):
    entry.update(_shape_fields(value))
  elif key == "unpadded size":
    entry["unpadded_bytes"] = parse_size(value)
  elif key == "extra memory due to padding":
    entry["padding_bytes"] = parse_size(value.split("(")[0])
  elif key == "xla label":
    entry["xla_label"] = value
  elif key == "allocation type":
    entry["allocation_type"] = value


def _table_row(breakdown: dict[str, int | None], section: str, m: re.Match) -> None:
  """One "name  size" row of a breakdown table, with the details some rows carry."""
  key = _row_key(m.group(1))
  if section == "program" and key in ("reserved",):
    key = "program reserved"
  value = None if m.group(2).lower().startswith("unknown") else parse_size(m.group(2))
  if section == "capacity":
    exact = re.search(r"\(\s*(-?[\d,]+)\s*bytes\s*\)", m.group(3))
    if exact and len(exact.group(1)) <= 40:
      value = int(exact.group(1).replace(",", ""))
  breakdown.setdefault(key, value)
  if key == "HLO temp":
    if d := _RE_HLO_TEMP_DETAIL.search(m.group(3)):
      breakdown["HLO temp unpadded"] = parse_size(d.group(1))
      breakdown["HLO temp padded"] = parse_size(d.group(2))
    if d := _RE_FRAG_DETAIL.search(m.group(3)):
      breakdown["fragmentation"] = parse_size(d.group(1))
  if key == "total fragmentation":
    breakdown["fragmentation"] = value


def _parse_blocks(lines: list[str]) -> tuple[dict, dict, list, list, int]:
  """Breakdown tables and listings. Returns (fields, breakdown, allocs, args, used)."""
  fields: dict[str, Any] = {}
  breakdown: dict[str, int | None] = {}
  listings: dict[str, list[Allocation]] = {"allocations": [], "arguments_and_outputs": []}
  section = None  # total | program | capacity | table | listing name
  entry: dict[str, Any] | None = None
  last_used = -1
  stray = 0

  def close_entry():
    nonlocal entry
    if entry is not None and section in listings:
      listings[section].append(_finish_entry(entry))
    entry = None

  for i, line in enumerate(lines[:_MAX_BLOCK_LINES]):
    if not line.strip():
      continue
    line = line[:_MAX_LINE]
    used = True
    if m := _RE_TOTAL.match(line):
      close_entry()
      section = "total"
      breakdown["total"] = parse_size(m.group(1))
    elif m := _RE_OUTPUT.match(line):
      close_entry()
      section = None
      breakdown["output"] = parse_size(m.group(1))
      if m.group(2):
        breakdown["output aliased"] = parse_size(m.group(2))
    elif m := _RE_PROGRAM.match(line):
      close_entry()
      section = "program"
      breakdown["program"] = parse_size(m.group(1))
    elif m := _RE_CAPACITY.match(line):
      close_entry()
      section = "capacity"
      fields.setdefault("capacity_bytes", parse_size(m.group(1)))
    elif m := _RE_SECTION.match(line):
      close_entry()
      section = "peak" if m.group(1).lower().startswith("peak") else "table"
      if section == "peak":
        section = "allocations"
    elif m := _RE_LISTING.match(line):
      close_entry()
      section = ("allocations" if m.group(1).lower().startswith("alloc")
                 else "arguments_and_outputs")
      fields.setdefault("memory_space", m.group(2).lower())
    elif (section in listings or section is None) and (m := _RE_ENTRY.match(line)):
      close_entry()
      section = section or "allocations"  # a fragment that starts inside a listing
      entry = {"size_bytes": parse_size(m.group(1))} if m.group(1) else {}
    elif section in listings and entry is not None and (m := _RE_FIELD.match(line)):
      _entry_field(entry, m.group(1).lower(), m.group(2).strip())
    elif section in listings and _RE_SEPARATOR.match(line):
      close_entry()
    elif m := _RE_MAX_FREE.match(line):
      fields["largest_free_bytes"] = parse_size(m.group(1))
    elif (section in ("total", "program", "capacity", "table")
          or (section is None and _RE_TOTAL_ROW.match(line))) and (m := _RE_ROW.match(line)):
      section = section or "total"  # a fragment that starts inside "Total hbm usage"
      _table_row(breakdown, section, m)
    else:
      used = False
    if used:
      last_used, stray = i, 0
    else:
      stray += 1
      if stray >= _MAX_STRAY_LINES and entry is None:
        break
  close_entry()
  return fields, breakdown, listings["allocations"], listings["arguments_and_outputs"], last_used


def _as_text(x: Any) -> str | None:
  if x is None:
    return None
  if isinstance(x, BaseException):
    parts, seen, e = [], set(), x
    while e is not None and id(e) not in seen:  # the exception and what it was raised from
      seen.add(id(e))
      parts.append(f"{type(e).__name__}: {e}")
      e = e.__cause__ or e.__context__
    return "\n".join(parts)
  if isinstance(x, (bytes, bytearray)):
    return bytes(x).decode("utf-8", errors="replace")
  if isinstance(x, str):
    return x
  return str(x)


# Phrases one of which every message above contains; big logs are searched for these with
# str.find (fast) and only a window around each is parsed.
_ANCHORS = ("out of memory", "attempting to reserve", "attempting to allocate",
            "failed to allocate request", "aborting compilation early", "hbm usage",
            "hbm requirement", "largest program", "size: ")
_BIG = 4 << 20
_WINDOW_BEFORE, _WINDOW_AFTER = 64 << 10, 4 << 20


def _parse_big(text: str) -> E1000Record | None:
  lower = text.lower()
  pos = 0
  while True:
    hits = [p for a in _ANCHORS if (p := lower.find(a, pos)) >= 0]
    if not hits:
      return None
    first = min(hits)
    start = max(0, first - _WINDOW_BEFORE)
    start = text.rfind("\n", 0, start) + 1 if start else 0
    rec = _parse_text(text[start:first + _WINDOW_AFTER])
    if rec is not None:
      return rec
    pos = first + _WINDOW_AFTER - _WINDOW_BEFORE


def parse(x: Any) -> E1000Record | None:
  """Parses an XLA out-of-memory error into an `E1000Record`; None if there is none.

  `x` is a message, an exception (its cause chain is read too), bytes, or a whole log
  around one. Never raises.
  """
  try:
    text = _as_text(x)
    if not text:
      return None
    if len(text) > _BIG:
      return _parse_big(text)
    return _parse_text(text)
  except Exception:  # A parser of error text must never add an error of its own.
    return None


def _parse_text(original: str) -> E1000Record | None:
  text = _clean(original)
  found = _first_headline(text)
  if found is not None:
    pattern, m = found
    fields = _headline_fields(pattern, m, text)
    start = text.rfind("\n", 0, m.start()) + 1
    nxt = _first_headline(text, m.end())
    block_start = text.find("\n", m.end())
    block_start = len(text) if block_start < 0 else block_start + 1
    block_end = len(text) if nxt is None else text.rfind("\n", 0, nxt[1].start()) + 1
    block_end = max(block_end, block_start)
    code_window = text[max(0, m.start() - 200):m.end()]
  else:
    b = _RE_BLOCK_ONLY.search(text)
    if b is None:
      return None
    fields = dict(kind=COMPILE_HBM, memory_space="hbm")
    start = block_start = b.start()
    block_end = len(text)
    code_window = text[max(0, b.start() - 200):b.start()]

  extra_breakdown = fields.pop("_breakdown", {})
  lines = text[block_start:block_end].split("\n")
  block_fields, breakdown, allocations, arguments, last_used = _parse_blocks(lines)
  for key, value in block_fields.items():
    if fields.get(key) is None:
      fields[key] = value
  for key, value in extra_breakdown.items():
    breakdown.setdefault(key, value)

  if fields["kind"] in (COMPILE_HBM, COMPILE_OTHER_MEMORY) and found is None:
    # Only the blocks survived: "program" is what the program needed.
    if fields.get("used_bytes") is None and breakdown.get("program") is not None:
      fields["used_bytes"] = breakdown["program"]
  if fields.get("kind") == RUNTIME_HBM:
    if (m2 := _RE_COMPACTION.search(text, start, block_end)):
      breakdown["max reservable after compaction"] = parse_size(m2.group(1))
  if (m3 := _RE_FRAGMENTATION.search(text, start, block_end)):
    fields["largest_free_bytes"] = parse_size(m3.group(1))
  if breakdown.get("HLO temp") is not None and fields.get("temp_bytes") is None:
    fields["temp_bytes"] = breakdown["HLO temp"]

  code = _RE_CODE.search(code_window)
  if code:
    fields["error_code"] = code.group(1)
  elif fields["kind"] in (COMPILE_HBM, COMPILE_HBM_EARLY, COMPILE_HBM_TC_SC):
    fields["error_code"] = None
  # E1001 (scoped vmem) announces itself on the line before its body.
  if fields.get("error_code") is None and fields["kind"] == COMPILE_OTHER_MEMORY:
    c2 = _RE_CODE.search(text, max(0, start - 300), start + 300)
    if c2:
      fields["error_code"] = c2.group(1)

  if last_used >= 0:
    end = block_start + sum(len(line) + 1 for line in lines[:last_used + 1])
  elif found is not None:
    end = block_start
  else:
    end = block_end
  raw = text[start:end].strip("\n")
  for key in _AMOUNTS:  # an absurd figure is dropped, not the record
    if fields.get(key) is not None and fields[key] < 0:
      fields[key] = None
  return E1000Record(breakdown=breakdown, allocations=tuple(allocations),
                     arguments_and_outputs=tuple(arguments), raw=raw, **fields)
