"""The blocks under an out-of-memory message's headline: sizes as XLA prints them, the
breakdown tables, and the allocation listings, read line by line in linear time.

`record.parse` assembles these into an `E1000Record`; nothing here knows the record."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

MAX_BYTES = 1 << 80  # beyond any memory; a larger figure is a damaged field, dropped
_MAX_LINE = 4096  # longer lines are cut: no table row is that long

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
          "P": 1 << 50, "E": 1 << 60}

# One size as XLA prints it: "63.80G", "0B", "420.0K", "14.30GiB", "-2.55G".
SIZE = r"-?\d+(?:\.\d+)?\s?(?:[KMGTPE]i?B?|B)(?![A-Za-z0-9])"
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



_S = f"({SIZE})"

_RE_TOTAL = re.compile(r"^\s*Total\s+hbm\s+usage\s*>=\s*" + _S + r"\s*:?", re.I)
_RE_OUTPUT = re.compile(
    r"^\s*Output\s+size\s+(" + SIZE + r"|unknown)"
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
    r"^\s*([A-Za-z][\w\- /]*?(?:\([^)]{0,200}\))?)\s*:?\s+(" + SIZE + r"|unknown size)"
    r"(.*)$", re.I)
_RE_HLO_TEMP_DETAIL = re.compile(
    r"Unpadded\s*\(" + _S + r"\)\s*Padded\s*\(" + _S + r"\)", re.I)
_RE_FRAG_DETAIL = re.compile(r"fragmentation\s*\(" + _S + r"\)", re.I)
_RE_TOTAL_ROW = re.compile(r"^\s*(?:reserved|program|arguments)\s+" + SIZE, re.I)
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


def parse_blocks(lines: list[str]) -> tuple[dict, dict, list, list, int]:
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


