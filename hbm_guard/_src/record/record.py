"""The E1000 record: XLA out-of-memory text parsed into numbers a program can act on.

`parse` reads a message, an exception, or a whole log around one, and returns an
`E1000Record`, or `None` when the text holds no memory out-of-memory error. It never
raises: a truncated message gives a partial record with everything that was present.

Sizes in XLA's messages ("63.80G", "420.0K", "3.47E") are binary units; the record holds
integer bytes. What a message does not say is `None`.
"""

from __future__ import annotations

import dataclasses
import enum
import re
import types
from typing import Any, Mapping

from hbm_guard._src.record import record_blocks as blocks



class RecordKind(enum.StrEnum):
  """Kinds of record, by the message that produced them."""
  COMPILE_HBM = "compile_hbm"  # "Ran out of memory in memory space hbm. Used X of Y hbm."
  COMPILE_HBM_EARLY = "compile_hbm_early"  # "HLO temporaries (X) exceeds available HBM (Y)"
  COMPILE_HBM_TC_SC = "compile_hbm_tc_sc"  # "TPU TensorCore Hbm usage: X, SparseCore ..."
  COMPILE_OTHER_MEMORY = "compile_other_memory"  # vmem / smem, E1001
  RUNTIME_HBM = "runtime_hbm"  # TPU runtime: reserve / allocate failures
  RUNTIME_GPU = "runtime_gpu"  # "Out of memory while trying to allocate N bytes"
  BUDGET = "budget"  # hbm_guard's own: memory_analysis() above a user-set capacity


(COMPILE_HBM, COMPILE_HBM_EARLY, COMPILE_HBM_TC_SC, COMPILE_OTHER_MEMORY, RUNTIME_HBM,
 RUNTIME_GPU, BUDGET) = RecordKind
KINDS = tuple(RecordKind)
COMPILE_KINDS = frozenset({COMPILE_HBM, COMPILE_HBM_EARLY, COMPILE_HBM_TC_SC, BUDGET})

Allocation = blocks.Allocation
parse_size = blocks.parse_size
MAX_BYTES = blocks.MAX_BYTES
_SIZE = blocks.SIZE
# Byte counts that are amounts (never negative). Breakdown rows may be ("Available after
# request: -2.55G"), so they are not checked.
_AMOUNTS = ("used_bytes", "capacity_bytes", "exceeded_bytes", "temp_bytes", "tensorcore_bytes",
            "sparsecore_bytes", "requested_bytes", "free_bytes", "largest_free_bytes")


@dataclasses.dataclass(frozen=True)
class E1000Record:
  """A parsed XLA out-of-memory error. Byte counts are ints; unknowns are None."""
  kind: RecordKind
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
    object.__setattr__(self, "kind", RecordKind(self.kind))
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
    d["kind"] = self.kind.value
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
  block_fields, breakdown, allocations, arguments, last_used = blocks.parse_blocks(lines)
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
