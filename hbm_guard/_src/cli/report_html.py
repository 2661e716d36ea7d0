"""The report as one self-contained HTML page: no network, an inline SVG chart.

What a person needs when a job did not fit: what was tried and what each attempt needed
against the capacity, the largest allocations and where they come from, the diagnosis with
its E1000 section, the plan in force, and what to change next, with the plan as code to
pin it.
"""

from __future__ import annotations

import html
import urllib.parse
from typing import Any

from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.files import report as report_lib
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.record import diagnose as diagnose_lib

_fmt = diagnose_lib.format_bytes
_PARTS = (("arguments", "#4e79a7"), ("outputs", "#f28e2b"), ("temporaries", "#e15759"),
          ("code", "#76b7b2"), ("needed", "#b07aa1"))
_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1100px;color:#222}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:26px 0 8px}
.status{display:inline-block;padding:2px 10px;border-radius:10px;color:#fff;font-weight:600}
.fits{background:#2e7d32}.exhausted,.diagnosed,.failed{background:#c62828}.climbing{background:#ef6c00}
table{border-collapse:collapse;width:100%} td,th{border-bottom:1px solid #ddd;padding:4px 6px;
text-align:left;vertical-align:top} th{background:#f5f5f5} .num{text-align:right;white-space:nowrap}
.muted{color:#777} pre{background:#f6f8fa;padding:10px;overflow-x:auto;border-radius:6px}
.legend span{display:inline-block;margin-right:14px} .sw{display:inline-block;width:12px;height:12px;
margin-right:4px;vertical-align:-1px}
"""


def _e(x: Any) -> str:
  return html.escape("" if x is None else str(x))


def _parts(a: dict[str, Any]) -> list[tuple[str, int]]:
  """An attempt's memory by part: the compiler's figures, else the error's, else its need."""
  m = a.get("memory")
  if m:
    return [("arguments", m.get("argument", 0)),
            ("outputs", max(0, m.get("output", 0) - m.get("alias", 0))),
            ("temporaries", m.get("temp", 0)), ("code", m.get("generated_code", 0))]
  rec = a.get("record") or {}
  b = rec.get("breakdown") or {}
  if b.get("arguments") is not None and b.get("HLO temp") is not None:
    return [("arguments", b.get("arguments") or 0), ("temporaries", b.get("HLO temp") or 0),
            ("code", b.get("overlays") or 0)]
  need = rec.get("used_bytes") or rec.get("temp_bytes") or 0
  return [("needed", need)]


def chart(data: dict[str, Any]) -> str:
  """Stacked bars, one per attempt, with the capacity as a line."""
  attempts = data.get("attempts") or []
  cap = data.get("capacity_bytes") or 0
  totals = [sum(v for _, v in _parts(a)) for a in attempts]
  top = max(totals + [cap, 1])
  label_w, bar_w, row_h = 330, 560, 26
  height = 30 + row_h * max(1, len(attempts)) + 20
  out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + bar_w + 110}" '
         f'height="{height}" role="img" aria-label="memory of each attempt">']
  colors = dict(_PARTS)
  for i, a in enumerate(attempts):
    y = 20 + i * row_h
    out.append(f'<text x="0" y="{y + 15}" font-size="12">#{_e(a.get("number"))} '
               f'{_e(str(a.get("described") or "")[:48])}</text>')
    x = label_w
    for name, v in _parts(a):
      w = bar_w * v / top
      if w > 0:
        out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h - 8}" '
                   f'fill="{colors[name]}"><title>{name}: {_e(_fmt(v))}</title></rect>')
      x += w
    out.append(f'<text x="{x + 6:.1f}" y="{y + 15}" font-size="12">{_e(_fmt(totals[i]))} '
               f'{"fits" if a.get("outcome") == compile_lib.Outcome.FITS else "OOM"}</text>')
  if cap:
    cx = label_w + bar_w * cap / top
    out.append(f'<line x1="{cx:.1f}" y1="8" x2="{cx:.1f}" y2="{height - 10}" '
               'stroke="#000" stroke-dasharray="5,3"/>')
    out.append(f'<text x="{cx + 4:.1f}" y="14" font-size="12">capacity {_e(_fmt(cap))}</text>')
  out.append("</svg>")
  legend = " ".join(f'<span><i class="sw" style="background:{c}"></i>{n}</span>'
                    for n, c in _PARTS)
  return "\n".join(out) + f'<div class="legend">{legend}</div>'


_KIND_COLORS = ("#1565c0", "#6a1b9a", "#00838f", "#8d6e63", "#9e9d24", "#c62828", "#ef6c00",
                "#2e7d32", "#546e7a", "#ad1457", "#bdbdbd", "#37474f")


def memory(b: dict[str, Any] | None) -> str:
  """Where the memory goes: one stacked bar of the parts at the peak (and one of the
  layers' activations), the largest buffers with their source lines, the savings."""
  if not b or not b.get("parts"):
    return ""
  parts = sorted(b["parts"], key=lambda p: -p.get("bytes", 0))
  total = max(1, sum(p.get("bytes", 0) for p in parts))
  width, height = 900, 28
  x, rects, legend = 0.0, [], []
  for i, p in enumerate(parts):
    w = width * p["bytes"] / total
    color = _KIND_COLORS[i % len(_KIND_COLORS)]
    rects.append(f'<rect x="{x:.1f}" y="0" width="{max(w, 0.5):.1f}" height="{height}" '
                 f'fill="{color}"><title>{_e(p["kind"])}: {_e(_fmt(p["bytes"]))}</title></rect>')
    legend.append(f'<span><i class="sw" style="background:{color}"></i>{_e(p["kind"])} '
                  f'{_e(_fmt(p["bytes"]))}</span>')
    x += w
  bar = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
         f'role="img" aria-label="where the memory goes">{"".join(rects)}</svg>')
  layers = b.get("layers") or []
  if layers:
    top = max(1, max(l["bytes"] for l in layers))
    rows = "".join(f'<tr><td>{_e(l["layer"])}</td><td><svg width="300" height="12">'
                   f'<rect width="{300 * l["bytes"] / top:.1f}" height="12" fill="#6a1b9a"/>'
                   f'</svg> {_e(_fmt(l["bytes"]))}</td></tr>' for l in layers)
    bar += f"<h3>Activations held at the peak, by layer</h3><table>{rows}</table>"
  saves = "".join(
      f"<tr><td>{_e(p['kind'])}</td><td class='num'>{_e(_fmt(p['bytes']))}</td><td>"
      + _e("; ".join(f"{s['rung']} -> {_fmt(s['remaining_bytes'])}" for s in p["savings"]))
      + (f" <span class='muted'>{_e(p['untouched'])}</span>" if p.get("untouched") else "")
      + "</td></tr>" for p in parts)
  buffers = "".join(
      f"<tr><td class='num'>{_e(_fmt(t['bytes']))}</td><td>{_e(t.get('shape'))}</td>"
      f"<td>{_e(t.get('kind'))}</td><td>{_e(t.get('module') or '')}</td>"
      f"<td>{_e(t.get('op') or '')}</td><td>{_e(t.get('source') or '')}</td></tr>"
      for t in b.get("top") or [])
  check = _e(b.get("checked_against") or "no figure of the compiler's to check against")
  notes = "".join(f"<li>{_e(n)}</li>" for n in b.get("notes") or [])
  return (f"<h2>Where the memory goes</h2><p class='muted'>{_e(_fmt(b.get('total_bytes')))} "
          f"from {_e(b.get('source'))}; checked against {check}</p>{bar}"
          f"<div class='legend'>{''.join(legend)}</div>"
          f"<h3>What removes each part</h3><table><tr><th>part</th><th>bytes</th>"
          f"<th>rung: what it leaves</th></tr>{saves}</table>"
          f"<h3>Largest buffers at the peak</h3><table><tr><th>size</th><th>shape</th>"
          f"<th>part</th><th>module</th><th>op</th><th>source</th></tr>{buffers}</table>"
          + (f"<ul class='muted'>{notes}</ul>" if notes else ""))


def predicted(rows: Any) -> str:
  """The first program's parts as the plan kept was predicted to leave them, beside what
  the compiler allotted them (and held on chip)."""
  rows = [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []
  if not rows:
    return ""

  def size(x: Any, absent: str = "") -> str:
    return _fmt(x) if isinstance(x, int) and not isinstance(x, bool) else absent

  def row(r: dict[str, Any]) -> str:
    chip = size(r.get("on_chip_bytes")) if r.get("on_chip_bytes") else ""
    chip = f" <span class='muted'>(+{_e(chip)} on chip)</span>" if chip else ""
    verdict = {True: "agrees", False: "differs"}.get(r.get("agrees"), "")
    return (f"<tr><td>{_e(r.get('kind'))}</td><td class='num'>{_e(size(r.get('before_bytes')))}"
            f"</td><td class='num'>{_e(size(r.get('predicted_bytes'), 'not predicted'))}</td>"
            f"<td>{_e(r.get('by'))}</td><td class='num'>{_e(size(r.get('compiled_bytes')))}"
            f"{chip}</td><td>{_e(verdict)}</td></tr>")

  return ("<h3>Predicted and compiled, for the plan kept</h3><table><tr><th>part</th>"
          "<th>first program</th><th>predicted</th><th>by</th><th>compiled</th><th></th></tr>"
          f"{''.join(row(r) for r in rows)}</table>")


def _safe_href(url: Any) -> str | None:
  """Only http(s) links: a report is a file anyone may have written."""
  if isinstance(url, str) and urllib.parse.urlsplit(url.strip()).scheme in ("http", "https"):
    return url.strip()
  return None


def _pin(data: dict[str, Any]) -> str:
  raw = data.get("final_plan") or (data.get("attempts") or [{}])[-1].get("plan")
  if not raw:
    return ""
  try:  # the snippet is built from a validated Plan only, never from the file's keys
    plan = plan_lib.Plan.from_dict(raw)
  except (ValueError, TypeError):
    return "<p class='muted'>the report's plan is malformed: no snippet to pin it</p>"
  args = plan_code(plan.to_dict())
  code = (f"step = hbm_guard.guarded_jit(train_step, state_argnums=0, auto_fallback=False,\n"
          f"    plan=hbm_guard.Plan({args}))\n"
          f"# pinned: compiles once, and raises if it ever stops fitting")
  return (f"<p>Plan: <b>{_e(plan.describe())}</b></p>"
          f"<p>Pin it, so the next job compiles once:</p><pre>{_e(code)}</pre>"
          "<p class='muted'>or save the report's <code>final_plan</code> to a file and pass "
          "<code>plan='plan.json'</code>.</p>")


def plan_code(plan: dict[str, Any]) -> str:
  """The plan's fields that differ from the default, as Plan(...) keyword arguments."""
  default = plan_lib.Plan().to_dict()
  parts = []
  for k, v in plan.items():
    if k == "rungs" or v == default.get(k):
      continue
    if isinstance(v, list):
      v = tuple(v)
    if isinstance(v, dict):
      v = tuple(sorted(v.items()))
    parts.append(f"{k}={v!r}")
  return ", ".join(parts)


def render(data: dict[str, Any]) -> str:
  status = data.get("status", "?")
  cap = data.get("capacity_bytes")
  rows = []
  for a in data.get("attempts") or []:
    rec = a.get("record") or {}
    need = rec.get("used_bytes") or rec.get("temp_bytes") or (a.get("memory") or {}).get("peak")
    notes = report_lib.forms(a)
    notes += [f"skipped {s['rung']}: {s['reason']}" for s in a.get("skipped", ())]
    notes += [f"not split under {r}" for r in a.get("refused") or ()]
    planning = a.get("planning") or {}
    notes += [f"{report_lib.made_as(p)} {p['plan']}: {_fmt(p['need_bytes'])}"
              for p in planning.get("probes", ())]
    if planning.get("why"):
      notes.append(f"next: {planning.get('chosen') or 'none'} ({planning['why']})")
    estimated = report_lib.estimated_ms(a)
    if estimated is not None:
      notes.append(f"estimated step time: {estimated:.3f} ms ({report_lib.ESTIMATE_SOURCE})")
    rows.append(f"<tr><td>#{_e(a.get('number'))}</td><td>{_e(a.get('described'))}<div class='muted'>"
                f"{_e(a.get('signature'))}</div></td><td>{_e(a.get('outcome'))}</td>"
                f"<td class='num'>{_e(_fmt(need))}</td><td class='num'>{_e(a.get('seconds'))} s</td>"
                f"<td>{'<br>'.join(_e(n) for n in notes)}</td></tr>")
  allocs = []
  for al in data.get("largest_allocations") or []:
    who = "" if al.get("user_code", True) else " <span class='muted'>(program code / runtime)</span>"
    allocs.append(f"<tr><td class='num'>{_e(_fmt(al['size_bytes']))}</td>"
                  f"<td>{_e(al.get('shape'))}</td><td class='num'>"
                  f"{_e(_fmt(al['padding_bytes'])) if al.get('padding_bytes') else ''}</td>"
                  f"<td>{_e((al.get('what') or '')[:160])}{who}</td><td>{_e(al.get('source'))}</td></tr>")
  last = next((a for a in reversed(data.get("attempts") or []) if a.get("diagnosis")), None)
  diag = ""
  if last:
    d = last["diagnosis"]
    href = _safe_href(d.get("docs"))
    link = f" <a href='{_e(href)}'>E1000</a>" if href else ""
    diag = (f"<p><b>{_e(d.get('scenario'))}</b> "
            f"{_e(', '.join(str(x) for x in d.get('sections') or ()))}: "
            f"{_e(d.get('summary'))}{link}</p>")
  steps = "".join(f"<li>[{_e(s.get('section'))}] {_e(s.get('text'))}</li>"
                  for s in data.get("next_steps") or [])
  above = data.get("above_class")
  if above:
    steps = (f"<li><b>Allowing class '{_e(above['class'])}' would fit</b>: {_e(above['plan'])}, "
             f"predicted {_e(_fmt(above['predicted_bytes']))} of {_e(_fmt(cap))} "
             f"(max_class='{_e(above['class'])}').</li>") + steps
  timed = data.get("timed") or {}
  speeds = "".join(f"<tr><td>{_e(t.get('plan'))}</td><td class='num'>"
                   f"{_e(round(1000 * float(t.get('median_seconds') or 0), 2))} ms</td>"
                   f"<td class='num'>{_e(t.get('steps'))}</td></tr>"
                   for t in timed.get("plans") or [])
  if speeds:
    speeds = (f"<h2>Timed on the first steps</h2><p class='muted'>{_e(timed.get('why'))}</p>"
              "<table><tr><th>plan (the one in force first)</th><th>median step</th><th>steps"
              f"</th></tr>{speeds}</table>")
  estimated = data.get("estimated") or {}
  rivals = "".join(f"<tr><td>{_e(e.get('plan'))}</td><td class='num'>"
                   f"{_e(report_lib.compared(e))}</td></tr>" for e in estimated.get("plans") or [])
  if rivals:
    speeds += (f"<h2>Compared on the target</h2><p class='muted'>{_e(estimated.get('why'))}"
               "</p><table><tr><th>plan (the search's choice first)</th><th>estimated step"
               f"</th></tr>{rivals}</table>")
  refused = "".join(f"<li><b>{_e(r.get('plan'))}</b>: {_e(r.get('why'))}</li>"
                    for r in data.get("refused") or [])
  if refused:
    refused = f"<h2>The batch was not split</h2><ul>{refused}</ul>"
  title = f"hbm_guard: {data.get('function')}"
  return f"""<!doctype html><html><head><meta charset="utf-8"><title>{_e(title)}</title>
<style>{_CSS}</style></head><body>
<h1>{_e(title)} <span class="status {_e(status)}">{_e(status)}</span></h1>
<p>{_e(data.get('compiles'))} compile(s){' for ' + _e(data['target']) if data.get('target') else ''}
{' &middot; capacity ' + _e(_fmt(cap)) if cap else ''} &middot; allowed up to class
<b>{_e(data.get('max_class'))}</b> &middot; <span class="muted">{_e(data.get('written_at'))}</span></p>
<h2>Memory of each attempt</h2>{chart(data)}
<h2>Attempts</h2><table><tr><th>#</th><th>plan</th><th>outcome</th><th>needs</th><th>time</th>
<th>why the next plan</th></tr>{''.join(rows)}</table>
<h2>Diagnosis</h2>{diag or '<p class="muted">no out-of-memory recorded</p>'}
{memory(data.get("breakdown"))}
{predicted(data.get("predicted_vs_compiled"))}
{refused}
<h2>Largest allocations</h2>{('<table><tr><th>size</th><th>shape</th><th>padding</th><th>what</th><th>source</th></tr>' + ''.join(allocs) + '</table>') if allocs else '<p class="muted">the compiler listed none</p>'}
<h2>Plan in force</h2>{_pin(data) if status == 'fits' else '<p class="muted">none: the step does not fit</p>'}
{speeds}
<h2>What to change next</h2>{('<ol>' + steps + '</ol>') if steps else '<p class="muted">nothing: it fits</p>'}
</body></html>
"""

