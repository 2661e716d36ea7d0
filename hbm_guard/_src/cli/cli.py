"""The `hbm-guard` command: explain an out-of-memory error, or render a post-mortem report.

  hbm-guard explain [FILE|-] [--json]   exit 0: found one; 1: none; 2: usage error
  hbm-guard report REPORT.json [--html OUT.html]   a guard's post-mortem, for a person
  hbm-guard cache list [DIR] | show KEY [DIR] | clear [DIR] [--key K] [--exhausted]
  hbm-guard preflight MOD:FACTORY --target T [--target T2] [--capacity C] [--max-class X]
                      [--json]   exit 0: every target fits; 1: one does not; 2: usage
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence, TextIO

from hbm_guard._src.record import diagnose as diagnose_lib
from hbm_guard._src.record import record as record_lib

_fmt = diagnose_lib.format_bytes
_MAX_LISTED = 5
_MAX_REPORT_BYTES = 64 << 20


def render_explanation(rec: record_lib.E1000Record, diag: diagnose_lib.Diagnosis) -> str:
  """What ran out, by how much, the largest allocations, the scenario and the advice."""
  lines = []
  code = f" {rec.error_code}" if rec.error_code else ""
  lines.append(f"XLA out-of-memory{code}: {rec.kind} ({rec.memory_space or 'memory'})")
  if rec.hlo_module:
    lines.append(f"  module:    {rec.hlo_module}")
  need, have = rec.required_bytes, rec.available_bytes
  if need is not None:
    lines.append(f"  needs:     {_fmt(need)}")
  if rec.tensorcore_bytes is not None or rec.sparsecore_bytes is not None:
    lines.append(f"             TensorCore {_fmt(rec.tensorcore_bytes)}, "
                 f"SparseCore {_fmt(rec.sparsecore_bytes)}")
  if have is not None:
    lines.append(f"  has:       {_fmt(have)}")
  short = rec.shortfall_bytes
  if short is not None and short > 0:
    lines.append(f"  short by:  {_fmt(short)}")
  if rec.breakdown:
    parts = [f"{k} {_fmt(v)}" for k, v in rec.breakdown.items() if v is not None]
    lines.append("  breakdown: " + ", ".join(parts))
  listed = list(rec.allocations[:_MAX_LISTED])
  if listed:
    lines.append(f"  largest allocations ({len(rec.allocations)} listed):")
    for i, a in enumerate(listed, start=1):
      where = a.op_name or a.xla_label or "?"
      if len(where) > 100:
        where = where[:97] + "..."
      pad = (f", padding {_fmt(a.padding_bytes)}" if a.padding_bytes else "")
      lines.append(f"    {i}. {_fmt(a.size_bytes)} {a.shape_text or ''}{pad}")
      lines.append(f"       {where}")
      if a.source_file:
        lines.append(f"       at {a.source_file}"
                     + (f":{a.source_line}" if a.source_line else ""))
  from hbm_guard._src.memory import breakdown as breakdown_lib  # pylint: disable=g-import-not-at-top
  from hbm_guard._src.files import report as report_lib  # pylint: disable=g-import-not-at-top
  listed_parts = breakdown_lib.from_listing(rec.allocations, rec.required_bytes)
  if listed_parts is not None:
    lines += report_lib.breakdown_lines(listed_parts.to_dict())
  lines.append("")
  lines.append(f"Scenario {diag.scenario or '-'}"
               + (f" ({diag.variant})" if diag.variant else "")
               + (f" [{', '.join(diag.sections)}]" if diag.sections else ""))
  lines.append(f"  {diag.summary}")
  for p in diag.padding[:_MAX_LISTED]:
    lines.append(f"  padding: allocation #{p.index} {list(p.shape)} is laid out as "
                 f"{list(p.padded_shape)} ({p.expansion}x, {_fmt(p.padding_bytes)} wasted); "
                 f"dims {list(p.padded_dims)} pad; {list(p.aligned_shape)} would not.")
  lines.append("")
  lines.append("Advice, most promising first:")
  for i, a in enumerate(diag.advice, start=1):
    tag = f" [rung: {a.rung}]" if a.rung else ""
    warn = " (may change model behaviour)" if a.may_change_behaviour else ""
    lines.append(f"  {i}. [{a.section}] {a.text}{warn}{tag}")
  lines.append(f"\nSee {diag.docs}")
  return "\n".join(lines)


def _read(path: str) -> str:
  if path == "-":
    data = sys.stdin.buffer.read()
  else:
    with open(path, "rb") as f:
      data = f.read()
  return data.decode("utf-8", errors="replace")


def _explain(args, out: TextIO) -> int:
  try:
    text = _read(args.file)
  except OSError as e:
    print(f"hbm-guard explain: cannot read {args.file}: {e.strerror or e}", file=sys.stderr)
    return 2
  rec = record_lib.parse(text)
  if rec is None:
    if args.json:
      print(json.dumps({"record": None, "diagnosis": None}), file=out)
    else:
      print("No XLA out-of-memory error found.", file=out)
    return 1
  diag = diagnose_lib.diagnose(rec)
  if args.json:
    print(json.dumps({"record": rec.to_dict(), "diagnosis": diag.to_dict()}, indent=2),
          file=out)
  else:
    print(render_explanation(rec, diag), file=out)
  return 0


def _report(args, out: TextIO) -> int:
  from hbm_guard._src.files import report as report_lib  # pylint: disable=g-import-not-at-top
  from hbm_guard._src.files import untrusted  # pylint: disable=g-import-not-at-top
  try:
    data = untrusted.read_json(args.file, max_bytes=_MAX_REPORT_BYTES)
  except ValueError as e:
    print(f"hbm-guard report: cannot read {args.file}: {e}", file=sys.stderr)
    return 2
  if not report_lib.is_report(data):
    print(f"hbm-guard report: {args.file} is not an hbm_guard report (no "
          f"'schema': 'hbm_guard.report/...' with 'attempts').", file=sys.stderr)
    return 2
  try:
    text = report_lib.render(data)
    page = None
    if args.html:
      from hbm_guard._src.cli import report_html  # pylint: disable=g-import-not-at-top
      page = report_html.render(data)
  except Exception as e:  # pylint: disable=broad-except  (a damaged file: one line, exit 2)
    print(f"hbm-guard report: {args.file} is a damaged report "
          f"({type(e).__name__}: {str(e)[:200]})", file=sys.stderr)
    return 2
  if page is not None:
    try:
      report_lib.write_text_atomic(args.html, page)
    except OSError as e:
      print(f"hbm-guard report: cannot write {args.html}: {e}", file=sys.stderr)
      return 2
    print(f"wrote {args.html}", file=out)
  else:
    print(text, file=out)
  return 0


def _cache_entries(cache, prefix: str | None = None):
  """(key, Entry or the reason it cannot be read) for each entry, or those with `prefix`."""
  for key in cache.keys():
    if prefix and not key.startswith(prefix):
      continue
    try:
      yield key, cache.read(key)
    except ValueError as e:
      yield key, str(e)


def _cache(args, out: TextIO) -> int:
  from hbm_guard._src.files import plan_cache  # pylint: disable=g-import-not-at-top
  cache = plan_cache.resolve(args.dir if args.dir else True)
  if cache is None:
    print("hbm-guard cache: the plan cache is off ($HBM_GUARD_PLAN_CACHE); name a directory",
          file=sys.stderr)
    return 2
  if args.action == "list":
    rows = list(_cache_entries(cache))
    print(f"{cache.directory}: {len(rows)} entr{'y' if len(rows) == 1 else 'ies'}", file=out)
    for key, e in rows:
      if isinstance(e, str):
        print(f"  {key[:16]}  damaged    {e[:100]}", file=out)
        continue
      age = e.age_seconds()
      print(f"  {key[:16]}  {e.status:<9}  {'?' if age is None else f'{age / 3600:.1f}h':>6}  "
            f"{str(e.parts.get('where'))[:40]:<24} {_fmt(e.parts.get('capacity')):>10}  "
            f"{e.parts.get('max_class')}  {e.plan.describe()}", file=out)
    return 0
  if args.action == "show":
    found = list(_cache_entries(cache, args.key))
    if len(found) != 1:
      print(f"hbm-guard cache: {len(found)} entries start with {args.key!r} in "
            f"{cache.directory}", file=sys.stderr)
      return 2
    key, e = found[0]
    if isinstance(e, str):
      print(f"hbm-guard cache: {cache.path(key)} is damaged: {e}", file=sys.stderr)
      return 1
    print(json.dumps({"key": key, "path": cache.path(key), **e.to_dict()}, indent=2,
                     default=str), file=out)
    return 0
  removed = 0
  for key, e in list(_cache_entries(cache, args.key)):
    if args.exhausted and (isinstance(e, str) or e.status != plan_cache.Status.EXHAUSTED):
      continue
    removed += cache.remove(key)
  print(f"removed {removed} entr{'y' if removed == 1 else 'ies'} from {cache.directory}",
        file=out)
  return 0


def _preflight(args, out: TextIO) -> int:
  from hbm_guard._src.backends import targets  # pylint: disable=g-import-not-at-top
  targets.quiet_libtpu_on_cpu_host()
  from hbm_guard._src.guard import guard as guard_lib  # pylint: disable=g-import-not-at-top
  from hbm_guard._src.cli import preflight  # pylint: disable=g-import-not-at-top
  from hbm_guard._src.files import report as report_lib  # pylint: disable=g-import-not-at-top
  try:
    for t in args.target:
      targets.Target.parse(t).devices()  # unknown topology, no libtpu, libtpu busy: usage
    made = preflight.load_factory(args.factory)()
    step, step_args = made
    if not isinstance(step, guard_lib.GuardedFunction):
      raise ValueError("the factory must return (a guarded_jit step, its example arguments)")
  except Exception as e:  # pylint: disable=broad-except  (a usage error, said plainly)
    print(f"hbm-guard preflight: {e}", file=sys.stderr)
    return 2
  rows = [preflight.check(step, tuple(step_args), t, capacity=args.capacity,
                          max_class=args.max_class, estimated_rivals=args.estimated_rivals)
          for t in args.target]
  if args.json:
    print(json.dumps(rows, indent=2, default=str), file=out)
  else:
    print(f"{'target':<12} {'fits':<5} {'compiles':>8} {'peak':>11} {'capacity':>11} "
          f"{'seconds':>8} {'step ms*':>9}  plan", file=out)
    for r in rows:
      ms = r["estimated_step_ms"]
      print(f"{r['target']:<12} {'yes' if r['fits'] else 'NO':<5} {r['compiles']:>8} "
            f"{_fmt(r['peak_bytes']):>11} {_fmt(r['capacity_bytes']):>11} {r['seconds']:>8} "
            f"{'-' if ms is None else f'{ms:.4g}':>9}  "
            f"{r['plan'] or r.get('error', '')[:150]}", file=out)
      for i, c in enumerate(r["compared"]):
        if c["plan"] != r["plan"]:
          print(f"{'':<12} beside: {c['plan']}{' (searched)' if i == 0 else ''}: "
                f"{report_lib.compared(c)}", file=out)
      for line in report_lib.breakdown_lines(r.get("breakdown"), indent=" " * 12)[:6]:
        print(line, file=out)
      for a in r["largest_allocations"]:
        print(f"{'':<12} largest: {_fmt(a['size_bytes'])} {a.get('shape') or ''} "
              f"{(a.get('what') or '')[:70]}{' at ' + a['source'] if a.get('source') else ''}",
              file=out)
    if any(r["estimated_step_ms"] is not None for r in rows):
      print("* a step's time on the target, not timed: " + report_lib.ESTIMATE_SOURCE
            + ("" if args.estimated_rivals else
               ". --estimated-rivals N compiles N plans near each and keeps the fastest"),
            file=out)
  return 0 if all(r["fits"] for r in rows) else 1


def _memory(args, out: TextIO) -> int:
  """Where a step's memory goes for a target, as written (compiled once, not fitted)."""
  from hbm_guard._src.backends import targets  # pylint: disable=g-import-not-at-top
  targets.quiet_libtpu_on_cpu_host()
  from hbm_guard._src.guard import guard as guard_lib  # pylint: disable=g-import-not-at-top
  from hbm_guard._src.cli import preflight  # pylint: disable=g-import-not-at-top
  from hbm_guard._src.files import report as report_lib  # pylint: disable=g-import-not-at-top
  try:
    targets.Target.parse(args.target).devices()
    step, step_args = preflight.load_factory(args.factory)()
    if not isinstance(step, guard_lib.GuardedFunction):
      raise ValueError("the factory must return (a guarded_jit step, its example arguments)")
  except Exception as e:  # pylint: disable=broad-except  (a usage error, said plainly)
    print(f"hbm-guard memory: {e}", file=sys.stderr)
    return 2
  row = preflight.memory(step, tuple(step_args), args.target, capacity=args.capacity)
  if args.json:
    print(json.dumps(row, indent=2, default=str), file=out)
  else:
    print(f"{args.target}: {'fits' if row['fits'] else 'does not fit'}"
          + (f" ({row['error'][:200]})" if row.get("error") else ""), file=out)
    lines = report_lib.breakdown_lines(row["breakdown"])
    print("\n".join(lines) if lines else "  no breakdown: the compiler dumped nothing",
          file=out)
  return 0 if row["breakdown"] else 1


def _count(text: str) -> int:
  """An argparse type: a count, 0 or more."""
  value = int(text)
  if value < 0:
    raise ValueError(text)
  return value


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
  out = out or sys.stdout
  parser = argparse.ArgumentParser(
      prog="hbm-guard", description="Explain XLA out-of-memory errors (E1000).")
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("explain", help="parse and diagnose an out-of-memory error")
  p.add_argument("file", nargs="?", default="-", help="a log or message; '-' for stdin")
  p.add_argument("--json", action="store_true", help="print {record, diagnosis} as JSON")
  r = sub.add_parser("report", help="render a guarded_jit post-mortem report")
  r.add_argument("file", help="the report's JSON file")
  r.add_argument("--html", metavar="OUT.html", help="write a self-contained HTML page")
  c = sub.add_parser("cache", help="list, show or clear the plans the plan cache remembers")
  actions = c.add_subparsers(dest="action", required=True)
  where = ("the cache directory (default: $HBM_GUARD_PLAN_CACHE, else "
           "~/.cache/hbm_guard/plans)")
  a = actions.add_parser("list", help="one line an entry")
  a.add_argument("dir", nargs="?", default=None, help=where)
  a = actions.add_parser("show", help="one entry, whole, as JSON")
  a.add_argument("key", help="the entry's key (a unique prefix is enough)")
  a.add_argument("dir", nargs="?", default=None, help=where)
  a = actions.add_parser("clear", help="remove entries")
  a.add_argument("dir", nargs="?", default=None, help=where)
  a.add_argument("--key", default=None, help="only entries whose key starts so")
  a.add_argument("--exhausted", action="store_true",
                 help="only entries that remember that nothing fit")
  f = sub.add_parser("preflight", help="will a guarded step fit these TPU targets?")
  f.add_argument("factory", help="MODULE:FACTORY; FACTORY() returns (guarded step, args)")
  f.add_argument("--target", action="append", required=True, help="e.g. v5e:2x2; repeat")
  f.add_argument("--capacity", default=None, help="per device: bytes, 16GiB, or a device")
  f.add_argument("--max-class", default=None, choices=("exact", "numerics", "behaviour"))
  f.add_argument("--estimated-rivals", type=_count, default=None, metavar="N",
                 help="compile up to N plans near the search's choice for each target and "
                      "keep the one its program estimates fastest (each costs a compile)")
  f.add_argument("--json", action="store_true", help="print a list of objects, one a target")
  m = sub.add_parser("memory", help="where a step's memory goes for a TPU target, as written")
  m.add_argument("factory", help="MODULE:FACTORY; FACTORY() returns (guarded step, args)")
  m.add_argument("--target", required=True, help="e.g. v5e:1x1")
  m.add_argument("--capacity", default=None, help="per device: bytes, 16GiB, or a device")
  m.add_argument("--json", action="store_true", help="print the breakdown as JSON")
  try:
    args = parser.parse_args(argv)
  except SystemExit as e:  # argparse exits 2 on usage errors, 0 on --help
    return int(e.code or 0)
  if args.command == "explain":
    return _explain(args, out)
  if args.command == "preflight":
    return _preflight(args, out)
  if args.command == "memory":
    return _memory(args, out)
  if args.command == "cache":
    return _cache(args, out)
  return _report(args, out)


def run() -> None:
  sys.exit(main())
