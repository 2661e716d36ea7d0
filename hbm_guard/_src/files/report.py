"""The post-mortem report: versioned JSON, written atomically, rendered for a person."""

from __future__ import annotations

import datetime
import enum
import json
import os
import re
import tempfile
import time
from typing import Any

from hbm_guard._src.memory import breakdown_check
from hbm_guard._src.record import diagnose as diagnose_lib
from hbm_guard._src.record import record as record_lib

SCHEMA = "hbm_guard.report/1"


class Status(enum.StrEnum):
  """Where a guarded step stands, as its report says."""
  CLIMBING = "climbing"  # an attempt failed; the next is being chosen or compiled
  FITS = "fits"
  EXHAUSTED = "exhausted"  # no allowed plan fits
  DIAGNOSED = "diagnosed"  # does not fit; auto fallback off, nothing changed
  FAILED = "failed"


def build(*, function: str, status: Status | str, attempts: list[dict[str, Any]],
          final_plan: dict[str, Any] | None, target: str | None, capacity_bytes: int | None,
          max_class: str, ladder: list[dict[str, Any]], note: str | None = None,
          above_class: dict[str, Any] | None = None,
          timed: dict[str, Any] | None = None,
          estimated: dict[str, Any] | None = None,
          refused: list[dict[str, str]] | None = None,
          probed: list[dict[str, Any]] | None = None) -> dict[str, Any]:
  """The report as a dict. status: climbing | fits | exhausted | diagnosed | failed."""
  last = next((a for a in reversed(attempts) if a.get("diagnosis")), None)
  withheld = sorted({s["rung"] for a in attempts for s in a.get("skipped", ())
                     if s.get("kind") == "withheld"})
  return {
      "schema": SCHEMA,
      "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(),
      "function": function,
      "status": Status(status).value,
      "target": target,
      "capacity_bytes": capacity_bytes,
      "max_class": max_class,
      "compiles": len(attempts),
      "final_plan": final_plan,
      "withheld_rungs": withheld,
      "next_steps": next_steps(attempts) if status != Status.FITS else [],
      "largest_allocations": largest_allocations(last["record"]) if last else [],
      "above_class": above_class,
      "timed": timed,  # the plans timed on the first steps, and why the one in force won
      "estimated": estimated,  # a target's rivals compiled, each its estimated step
      "refused": refused or [],  # why the drop-in did not split the batch, under which plan
      # where the memory goes in the last program compiled (the plan kept, or the last
      # failure): by kind, layer and buffer, each part with the rung that removes it
      "breakdown": next((a["breakdown"] for a in reversed(attempts) if a.get("breakdown")),
                        None),
      "probed": probed or [],  # where each probe's program's memory goes
      # the first program's parts as the plan kept was predicted to leave them, beside
      # what the compiler then allotted them in its program
      "predicted_vs_compiled": _predicted_vs_compiled(attempts) if status == Status.FITS else [],
      "attempts": attempts,
      "ladder": ladder,
      "note": note,
  }


def _predicted_vs_compiled(attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
  with_breakdown = [a for a in attempts if isinstance(a.get("breakdown"), dict)]
  kept = attempts[-1] if attempts else None
  if not with_breakdown or kept is None or kept is with_breakdown[0]:
    return []
  return breakdown_check.compare(with_breakdown[0], kept)


def _applied(plan: dict[str, Any]) -> set[str]:
  """The rungs a plan (as a dict) has taken as far as they go."""
  from hbm_guard._src.plans import plan as plan_lib  # pylint: disable=g-import-not-at-top
  try:
    p = plan_lib.Plan.from_dict(plan)
  except ValueError:
    return set()
  done = set(p.rungs) | {rung for rung, _ in p.field_rungs(dtype=True)}
  if p.remat_policy != "nothing_saveable":
    done.discard("layer_remat")  # a weaker policy leaves room to go further
  if p.microbatches > 1:
    done.discard("microbatch")
  return done


def next_steps(attempts: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The last diagnosis' advice, less what the plan has done or the step cannot take.

  A rung the step is not plan-aware for, or that its platform rules out, is not advised as
  is: the advice says what would unlock it instead.
  """
  last = next((a for a in reversed(attempts) if a.get("diagnosis")), None)
  if last is None:
    return []
  done = _applied(attempts[-1].get("plan") or {})  # the latest plan compiled
  blocked = {}
  for a in attempts:
    for s in a.get("skipped", ()):
      if s.get("kind") in ("not_plan_aware", "not_applicable", "withheld"):
        blocked.setdefault(s["rung"], s)
  probed: dict[str, int] = {}  # rung -> the least a probed plan with it needed
  for a in attempts:
    for pr in (a.get("planning") or {}).get("probes", ()):
      for r in pr.get("rungs", ()):
        if pr.get("need_bytes") is not None:
          probed[r] = min(probed.get(r, pr["need_bytes"]), pr["need_bytes"])
  out = []
  savings = (next((a["breakdown"] for a in reversed(attempts) if a.get("breakdown")), None)
             or {}).get("savings") or {}
  advice = sorted(last["diagnosis"]["advice"],  # what frees most in this program, first
                  key=lambda adv: -savings.get(adv.get("rung"), 0))
  for adv in advice:
    rung = adv.get("rung")
    if rung in done:
      continue
    if savings.get(rung):
      adv = dict(adv, text=f"{adv['text']} Here it frees about "
                 f"{diagnose_lib.format_bytes(savings[rung])} (breakdown).")
    if rung in probed:
      adv = dict(adv, text=f"{adv['text']} Probed here: the best plan with it needs "
                 f"{diagnose_lib.format_bytes(probed[rung])}.")
    if rung in blocked:
      skip = blocked[rung]
      adv = dict(adv, text=f"{adv['text']} Not applied here: {skip['reason']}.",
                 blocked=skip["kind"])
    out.append(adv)
  return out


def largest_allocations(record: dict[str, Any] | None, n: int = 8) -> list[dict[str, Any]]:
  """The record's largest allocations, each with where it comes from and whether user
  code can shrink it (program code and runtime reservations cannot)."""
  if not record:
    return []
  allocs = list(record.get("allocations") or ()) + list(record.get("arguments_and_outputs") or ())
  allocs = [a for a in allocs if a.get("size_bytes")]
  allocs.sort(key=lambda a: -a["size_bytes"])
  out = []
  for a in allocs[:n]:
    alloc = record_lib.Allocation.from_dict(a)
    source = (f"{a['source_file']}:{a['source_line']}" if a.get("source_file")
              and a.get("source_line") else a.get("source_file"))
    out.append({"size_bytes": a["size_bytes"], "shape": a.get("shape_text"),
                "padding_bytes": a.get("padding_bytes"),
                "what": a.get("op_name") or a.get("xla_label") or a.get("allocation_type"),
                "source": source, "user_code": not diagnose_lib.is_system(alloc)})
  return out


def default_dir() -> str:
  return os.environ.get("HBM_GUARD_REPORT_DIR") or "hbm_guard_reports"


class Writer:
  """Owns one report file: its path, and writing it atomically after every attempt.

  `path` stays None until a write succeeded, so nothing ever names a report that is not
  there; a failed write is logged, never raised over the error the user needs to see.
  """

  def __init__(self, directory: str | os.PathLike | None, stem: str):
    # A step's name is not a path: "../x/step" stays inside the report directory.
    stem = _UNSAFE.sub("_", stem).lstrip(".")[:200] or "step"
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
  """JSON to a temporary file beside `path`, fsync, then rename over it."""
  write_text_atomic(path, json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


_UNSAFE = re.compile(r"[^\w.\-]")
_TMP_PREFIX, _TMP_SUFFIX = ".hbm_guard-", ".tmp"
_SWEPT: set[str] = set()
STALE_TMP_SECONDS = 600.0  # a write takes milliseconds: older temporaries were killed writes


def remove_stale_temporaries(directory: str, now: float | None = None) -> int:
  """Removes temporaries that killed writers left in `directory`; how many."""
  now = time.time() if now is None else now
  removed = 0
  try:
    with os.scandir(directory) as it:
      for e in it:
        if not (e.name.startswith(_TMP_PREFIX) and e.name.endswith(_TMP_SUFFIX)):
          continue
        try:
          if e.is_file(follow_symlinks=False) and now - e.stat(
              follow_symlinks=False).st_mtime > STALE_TMP_SECONDS:
            os.unlink(e.path)
            removed += 1
        except OSError:
          pass  # another process removed or replaced it
  except OSError:
    pass
  return removed


def write_text_atomic(path: str, text: str) -> None:
  """Write to a temporary file beside `path`, fsync, then rename over it."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  if directory not in _SWEPT:  # once per directory and process: a shared cache is large
    _SWEPT.add(directory)
    remove_stale_temporaries(directory)
  fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, suffix=_TMP_SUFFIX, dir=directory)
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except OSError:
      pass
    raise


_LOSS_FORMS = {
    "weighted_sum": "loss: weighted sums accumulated, divided once (exact under microbatching)",
    "mean": "loss: mean of microbatch means (exact for a plain mean over examples only)"}
_STREAMING = {
    "streamed": "optimizer state: streamed through the device in parts (no update mixes them)",
    "whole": "optimizer state: brought to the device whole (the update mixes parameters)"}


def forms(attempt: dict[str, Any]) -> list[str]:
  """How the step's loss and offloaded state were handled, and where the batch and the
  largest state leaves were placed, where the plan made it matter."""
  plan = attempt.get("plan") or {}
  out = []
  layout = [line for line in attempt.get("layout") or () if isinstance(line, str)][:8]
  if any("sharded" in line or "(host)" in line for line in layout):
    out += [f"layout: {line}" for line in layout]
  auto = attempt.get("auto")
  if isinstance(auto, str) and (plan.get("microbatches", 1) > 1 or plan.get("remat_policy")):
    out.append(f"drop-in: {auto}")
  elif plan.get("microbatches", 1) > 1 and attempt.get("loss_form") in _LOSS_FORMS:
    out.append(_LOSS_FORMS[attempt["loss_form"]])
  if plan.get("offload_optimizer") and attempt.get("optimizer_streaming") in _STREAMING:
    out.append(_STREAMING[attempt["optimizer_streaming"]])
  largest = largest_parts(attempt.get("breakdown"))
  if largest:
    out.append(f"largest at the peak: {largest}")
  return out


def largest_parts(b: Any, n: int = 3) -> str:
  """A breakdown's largest parts, from a report (untrusted: what is not sound is left)."""
  parts = [p for p in (b or {}).get("parts") or () if isinstance(p, dict)
           and isinstance(p.get("bytes"), int) and isinstance(p.get("kind"), str)]
  parts.sort(key=lambda p: -p["bytes"])
  return ", ".join(f"{p['kind']} {diagnose_lib.format_bytes(p['bytes'])}" for p in parts[:n])


ESTIMATE_SOURCE = ("an estimate from the compiled program: libtpu's per-op cycles at the "
                   "chip's clock, else a roofline at its peak FLOP/s and HBM bandwidth; "
                   "loops times their trip counts")


def _ms(seconds: Any) -> float | None:
  """Seconds read from a report, in ms, if sound (a report is untrusted)."""
  if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
    return None
  return 1000.0 * seconds if 0 <= seconds < float("inf") else None


def estimated_ms(attempt: dict[str, Any]) -> float | None:
  """A fitting attempt's estimated step time in ms, if the report holds a sound one."""
  return _ms((attempt.get("estimated_step") or {}).get("seconds"))


def compared(entry: dict[str, Any]) -> str:
  """What the report says of one plan `estimated_rivals` compiled."""
  if not entry.get("fits"):
    return "does not fit"
  ms = _ms(entry.get("estimated_seconds"))
  peak = entry.get("peak_bytes")
  peak = (f", peak {diagnose_lib.format_bytes(peak)}" if isinstance(peak, int)
          and not isinstance(peak, bool) and peak >= 0 else "")
  return (f"estimated {ms:.2f} ms a step" if ms is not None else "fits, no estimate") + peak


def made_as(probe: dict[str, Any]) -> str:
  """How a planning figure was made: a probe, or a compile at the capacity in its place."""
  return "compiled at the capacity" if probe.get("compiled") else "probe"


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
    lines += [f"      {line}" for line in forms(a)]
    estimated = estimated_ms(a)
    if estimated is not None:
      lines.append(f"      estimated step time: {estimated:.3f} ms ({ESTIMATE_SOURCE})")
    for s in a.get("skipped", ()):
      lines.append(f"      skipped {s['rung']}: {s['reason']}")
    for r in a.get("refused") or ():
      lines.append(f"      not split under {r}")
    planning = a.get("planning") or {}
    for pr in planning.get("probes", ()):
      lines.append(f"      {made_as(pr)} {pr['plan']}: needs {fmt(pr['need_bytes'])} "
                   f"({pr['seconds']}s)")
    if planning.get("why"):
      lines.append(f"      next: {planning.get('chosen') or 'none'} ({planning['why']})")
  if data.get("final_plan"):
    from hbm_guard._src.plans import plan as plan_lib  # pylint: disable=g-import-not-at-top
    lines.append("  plan in force: "
                 + plan_lib.Plan.from_dict(data["final_plan"]).describe())
  timed = data.get("timed") or {}
  if timed.get("plans"):
    lines.append(f"  timed on the first steps ({timed.get('why')}):")
    for t in timed["plans"]:
      lines.append(f"    {t['plan']}: {1000 * t['median_seconds']:.2f} ms a step "
                   f"(median of {t['steps']})")
  estimated = data.get("estimated") or {}
  if estimated.get("plans"):
    lines.append(f"  compiled for the target and compared ({estimated.get('why')}):")
    for e in estimated["plans"]:
      lines.append(f"    {e.get('plan')}: {compared(e)}")
  for r in data.get("refused") or ():
    lines.append(f"  the batch was not split ({r.get('plan')}): {r.get('why')}")
  if data.get("withheld_rungs"):
    lines.append(f"  withheld (not allowed): {', '.join(data['withheld_rungs'])}")
  lines += breakdown_lines(data.get("breakdown"))
  compared_parts = breakdown_check.lines(data.get("predicted_vs_compiled"), "    ")
  if compared_parts:
    said = breakdown_check.summary(data.get("predicted_vs_compiled"))
    lines.append("  the first program's parts, predicted under the plan kept and compiled"
                 + (f" ({said})" if said else "") + ":")
    lines += compared_parts
  allocs = data.get("largest_allocations") or ()
  if allocs:
    lines.append("  largest allocations (last failure):")
    for a in allocs[:6]:
      pad = f", padding {fmt(a['padding_bytes'])}" if a.get("padding_bytes") else ""
      where = f" at {a['source']}" if a.get("source") else ""
      sys_note = "" if a.get("user_code", True) else " (program code / runtime: not user code)"
      what = (a.get("what") or "?")[:90]
      lines.append(f"    {fmt(a['size_bytes'])} {a.get('shape') or ''}{pad} {what}{where}{sys_note}")
  above = data.get("above_class")
  if above:
    lines.append(f"  would fit with class '{above['class']}': {above['plan']} (predicted "
                 f"{fmt(above['predicted_bytes'])} of {fmt(data.get('capacity_bytes'))})")
  if data.get("next_steps"):
    lines.append("  what to do next:")
    for adv in data["next_steps"][:6]:
      lines.append(f"    [{adv['section']}] {adv['text']}")
  return "\n".join(lines)


def breakdown_lines(b: dict[str, Any] | None, indent: str = "  ") -> list[str]:
  """A breakdown, for a person: its parts (with what each rung leaves of them), its
  largest buffers with their source lines, and where the figures come from."""
  if not b:
    return []
  fmt = diagnose_lib.format_bytes
  check = (f", checked against {b['checked_against']}"
           + ("" if b.get("agrees") in (None, True) else " (the parts do not add up to it)")
           if b.get("checked_against") else "")
  out = [f"{indent}where the memory goes ({fmt(b.get('total_bytes'))}, from "
         f"{b.get('source')}{check}):"]
  for p in sorted(b.get("parts") or (), key=lambda p: -p.get("bytes", 0)):
    rungs = "; ".join(f"{s['rung']} -> {fmt(s['remaining_bytes'])}"
                      for s in p.get("savings") or ())
    after = f": {rungs}" if rungs else ""
    if p.get("untouched"):
      after += f"; {p['untouched']}"
    out.append(f"{indent}  {fmt(p['bytes'])} {p['kind']}{after}")
  for layer in (b.get("layers") or ())[:8]:
    out.append(f"{indent}    {fmt(layer['bytes'])} in {layer['layer']}")
  for buf in (b.get("top") or ())[:5]:
    where = f" at {buf['source']}" if buf.get("source") else ""
    module = f" in {buf['module']}" if buf.get("module") else ""
    out.append(f"{indent}  buffer {buf.get('shape')} {fmt(buf['bytes'])} {buf.get('kind')}"
               f"{module}{where}{' (' + buf['op'] + ')' if buf.get('op') else ''}")
  if b.get("padding_bytes"):
    out.append(f"{indent}  of which padding (S3.C): {fmt(b['padding_bytes'])}")
  out += [f"{indent}  note: {n}" for n in b.get("notes") or ()]
  return out


def render_path(report: str | os.PathLike | dict[str, Any]) -> str:
  """A report (its path, or its dict) rendered for a person."""
  if not isinstance(report, dict):
    with open(report, encoding="utf-8") as f:
      report = json.load(f)
  return render(report)
