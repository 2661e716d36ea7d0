"""The post-mortem report: versioned JSON, written atomically, rendered for a person."""

from __future__ import annotations

import datetime
import json
import os
import tempfile
from typing import Any

from hbm_guard._src import diagnose as diagnose_lib

SCHEMA = "hbm_guard.report/1"


def build(*, function: str, status: str, attempts: list[dict[str, Any]],
          final_plan: dict[str, Any] | None, target: str | None, capacity_bytes: int | None,
          max_class: str, ladder: list[dict[str, Any]], note: str | None = None
          ) -> dict[str, Any]:
  """The report as a dict. status: climbing | fits | exhausted | diagnosed | failed."""
  last = next((a for a in reversed(attempts) if a.get("diagnosis")), None)
  withheld = sorted({s["rung"] for a in attempts for s in a.get("skipped", ())
                     if s.get("kind") == "withheld"})
  return {
      "schema": SCHEMA,
      "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "function": function,
      "status": status,
      "target": target,
      "capacity_bytes": capacity_bytes,
      "max_class": max_class,
      "compiles": len(attempts),
      "final_plan": final_plan,
      "withheld_rungs": withheld,
      "next_steps": (last["diagnosis"]["advice"] if last and status != "fits" else []),
      "attempts": attempts,
      "ladder": ladder,
      "note": note,
  }


def default_dir() -> str:
  return os.environ.get("HBM_GUARD_REPORT_DIR") or "hbm_guard_reports"


class Writer:
  """Owns one report file: its path, and writing it atomically after every attempt.

  `path` stays None until a write succeeded, so nothing ever names a report that is not
  there; a failed write is logged, never raised over the error the user needs to see.
  """

  def __init__(self, directory: str | None, stem: str):
    self._target = os.path.abspath(os.path.join(directory or default_dir(), stem + ".json"))
    self.path: str | None = None

  def write(self, data: dict[str, Any]) -> bool:
    try:
      write_atomic(self._target, data)
    except (OSError, TypeError, ValueError) as e:
      from absl import logging  # pylint: disable=g-import-not-at-top
      logging.error("hbm_guard: could not write report %s: %s", self._target, e)
      return False
    self.path = self._target
    return True


def is_report(data: Any) -> bool:
  return (isinstance(data, dict) and isinstance(data.get("schema"), str)
          and data["schema"].startswith("hbm_guard.report/")
          and isinstance(data.get("attempts"), list))


def write_atomic(path: str, data: dict[str, Any]) -> None:
  """Write to a temporary file beside `path`, fsync, then rename over it."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=".hbm_guard-", suffix=".json.tmp", dir=directory)
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      json.dump(data, f, indent=2, sort_keys=False, default=str)
      f.write("\n")
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except OSError:
      pass
    raise


def render(data: dict[str, Any]) -> str:
  """A report, for a person."""
  fmt = diagnose_lib.format_bytes
  lines = [f"hbm_guard report for {data.get('function')}: {data.get('status')} after "
           f"{data.get('compiles')} compile(s)"]
  if data.get("target"):
    lines.append(f"  target: {data['target']}")
  if data.get("capacity_bytes"):
    lines.append(f"  capacity: {fmt(data['capacity_bytes'])}")
  lines.append(f"  allowed up to class: {data.get('max_class')}")
  for a in data.get("attempts", ()):
    rec = a.get("record") or {}
    mem = a.get("memory") or {}
    need = rec.get("used_bytes") or rec.get("temp_bytes") or mem.get("peak")
    lines.append(f"  #{a['number']} {a['described']}: {a['outcome']}"
                 + (f", needs {fmt(need)}" if need else "")
                 + (f" of {fmt(rec.get('capacity_bytes'))}" if rec.get("capacity_bytes") else "")
                 + f" ({a['seconds']}s)")
    for s in a.get("skipped", ()):
      lines.append(f"      skipped {s['rung']}: {s['reason']}")
    planning = a.get("planning") or {}
    for pr in planning.get("probes", ()):
      lines.append(f"      probe {pr['plan']}: needs {fmt(pr['need_bytes'])} ({pr['seconds']}s)")
    if planning.get("why"):
      lines.append(f"      next: {planning.get('chosen') or 'none'} ({planning['why']})")
  if data.get("final_plan"):
    from hbm_guard._src import plan as plan_lib  # pylint: disable=g-import-not-at-top
    lines.append("  plan in force: "
                 + plan_lib.Plan.from_dict(data["final_plan"]).describe())
  if data.get("withheld_rungs"):
    lines.append(f"  withheld (not allowed): {', '.join(data['withheld_rungs'])}")
  if data.get("next_steps"):
    lines.append("  what to do next:")
    for adv in data["next_steps"][:6]:
      lines.append(f"    [{adv['section']}] {adv['text']}")
  return "\n".join(lines)
