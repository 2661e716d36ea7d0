"""Issue #10: the report says what to change, validates against its schema, and renders as
a page in a real headless Chromium."""

import json
import os
import shutil
import subprocess

import jax
import jax.numpy as jnp
import jsonschema
import pytest

import hbm_guard
from hbm_guard._src.backends import compile as C
from hbm_guard._src.cli import cli
from hbm_guard._src.files import report as report_lib
from tests.record.test_record_corpus import body



def _schema():
  import importlib.resources
  return json.loads(importlib.resources.files("hbm_guard.configs")
                    .joinpath("report.schema.json").read_text())


def _mse_step(w, x, y):
  loss, g = hbm_guard.value_and_grad(lambda w, x, y: jnp.mean((jnp.tanh(x @ w) - y) ** 2),
                                     batch_argnums=(1, 2))(w, x, y)
  return w - 0.1 * g, loss


W = jnp.full((256, 256), 0.01)
X, Y = jnp.ones((512, 256)), jnp.zeros((512, 256))


def _capacity():
  from hbm_guard._src.plans import plan as plan_lib
  peaks = []
  for k in (1, 8):
    with plan_lib.plan_scope(hbm_guard.Plan(microbatches=k)):
      peaks.append(C.memory_of(jax.jit(lambda *a: _mse_step(*a)).lower(W, X, Y).compile())["peak"])
  return (peaks[0] + peaks[1]) // 2


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
  d = tmp_path_factory.mktemp("reports")
  opts = dict(state_argnums=0, capacity=_capacity(), report_dir=str(d), plan_cache=False)
  fitted = hbm_guard.guarded_jit(_mse_step, max_class="numerics", **opts)
  fitted(W, X, Y)
  exhausted = hbm_guard.guarded_jit(_mse_step, max_class="exact", **opts)
  with pytest.raises(hbm_guard.LadderExhaustedError) as info:
    exhausted(W, X, Y)
  off = hbm_guard.guarded_jit(_mse_step, auto_fallback=False, **opts)
  with pytest.raises(hbm_guard.CapacityExceededError):
    off(W, X, Y)
  return {"fits": fitted.report_path, "exhausted": exhausted.report_path,
          "diagnosed": off.report_path, "message": str(info.value)}


def test_reports_validate_against_the_shipped_schema(reports):
  schema = _schema()
  jsonschema.Draft202012Validator.check_schema(schema)
  for status in ("fits", "exhausted", "diagnosed"):
    data = json.load(open(reports[status]))
    jsonschema.validate(data, schema)
    assert data["status"] == status
  broken = json.load(open(reports["fits"]))
  broken["attempts"][0]["outcome"] = "maybe"
  with pytest.raises(jsonschema.ValidationError):
    jsonschema.validate(broken, schema)


def test_exhaustion_says_which_class_would_fit_and_by_how_much(reports):
  data = json.load(open(reports["exhausted"]))
  above = data["above_class"]
  assert above["class"] == "numerics" and "microbatch" in above["plan"]
  assert above["predicted_bytes"] <= data["capacity_bytes"]
  assert "Allowing max_class='numerics' would fit" in reports["message"]
  assert "would fit with class 'numerics'" in report_lib.render(data)


def test_advice_knows_the_state(reports):
  data = json.load(open(reports["exhausted"]))
  donate = [s for s in data["next_steps"] if s.get("rung") == "donate"]
  assert donate and "Probed here: the best plan with it needs" in donate[0]["text"]
  fitted = report_lib.next_steps(json.load(open(reports["fits"]))["attempts"])
  assert "donate" not in [s.get("rung") for s in fitted]  # the last plan donated already
  remat = [s for s in data["next_steps"] if s.get("rung") == "layer_remat"]
  assert remat and remat[0]["blocked"] == "not_plan_aware" and "Not applied here" in remat[0]["text"]


def test_overlays_are_not_blamed_on_user_code():
  rec = hbm_guard.E1000Record(
      kind="compile_hbm", used_bytes=100 << 20, capacity_bytes=96 << 20,
      allocations=(hbm_guard.Allocation(size_bytes=60 << 20, xla_label="overlays",
                                        allocation_type="overlays"),))
  diag = hbm_guard.diagnose(rec)
  assert diag.scenario == "S3" and not diag.large_allocations
  rows = report_lib.largest_allocations(rec.to_dict())
  assert rows[0]["user_code"] is False


def test_text_report_shows_the_largest_allocations(tmp_path, capsys):
  rec = hbm_guard.parse(body("021_au2018-detection-tpu-full-20-entries.txt"))
  attempt = {"number": 1, "plan": hbm_guard.Plan().to_dict(), "described": "plain jit",
             "outcome": "oom", "seconds": 1.0, "record": rec.to_dict(),
             "diagnosis": hbm_guard.diagnose(rec).to_dict(), "memory": None, "skipped": []}
  data = report_lib.build(function="step", status="exhausted", attempts=[attempt],
                          final_plan=None, target=None, capacity_bytes=rec.capacity_bytes,
                          max_class="exact", ladder=[])
  jsonschema.validate(data, _schema())
  path = tmp_path / "r.json"
  path.write_text(json.dumps(data))
  assert cli.main(["report", str(path)]) == 0
  out = capsys.readouterr().out
  assert "largest allocations" in out and rec.allocations[0].shape_text.split("{")[0] in out


_CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(_CHROMIUM is None and os.environ.get("CI") != "true",
                    reason="Debian's chromium is not installed (.ci/run installs it)")
@pytest.mark.parametrize("status", ["fits", "exhausted"])
def test_the_page_renders_in_headless_chromium(reports, tmp_path, status):
  page = tmp_path / f"{status}.html"
  assert cli.main(["report", reports[status], "--html", str(page)]) == 0
  text = page.read_text()
  assert "http://" not in text.replace("http://www.w3.org/2000/svg", "") and "<script" not in text
  flags = [_CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
           "--no-first-run", "--disable-background-networking", "--disable-component-update",
           "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}"]
  dom = subprocess.run(flags + ["--dump-dom", page.as_uri()], capture_output=True, text=True,
                       timeout=120).stdout
  data = json.load(open(reports[status]))
  for a in data["attempts"]:
    assert f"#{a['number']} " in dom  # every attempt is named, in the chart and the table
  assert "<svg" in dom and "capacity" in dom
  if status == "fits":
    assert "Pin it" in dom and "plan=hbm_guard.Plan(donate_argnums=(0,), microbatches=" in dom
  else:
    assert "Allowing class" in dom and "What to change next" in dom
  shot = tmp_path / f"{status}.png"
  subprocess.run(flags + [f"--screenshot={shot}", "--window-size=1200,1400", page.as_uri()],
                 capture_output=True, timeout=120, check=False)
  png = shot.read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000  # a page, not a blank
  shutil.copy(shot, f"/tmp/hbm_guard_page_{status}.png")


def test_the_page_tells_a_compile_made_in_place_of_a_probe_from_a_probe():
  from hbm_guard._src.cli import report_html  # pylint: disable=g-import-not-at-top
  page = report_html.render({"status": "fits", "attempts": [{"number": 2, "planning": {
      "probes": [{"plan": "donate", "need_bytes": 2**30, "compiled": True},
                 {"plan": "donate + microbatch(2)", "need_bytes": 2**29}]}}]})
  assert "compiled at the capacity donate: 1.00 GiB" in page
  assert "probe donate + microbatch(2): 512.00 MiB" in page
  from hbm_guard._src.files import report as report_lib  # pylint: disable=g-import-not-at-top
  text = report_lib.render({"function": "step", "status": "fits", "attempts": [{
      "number": 2, "described": "donate", "outcome": "fits", "seconds": 1.0, "planning": {
          "probes": [{"plan": "donate", "need_bytes": 2**30, "seconds": 9.0, "compiled": True},
                     {"plan": "donate + microbatch(2)", "need_bytes": 2**29, "seconds": 2.0}]}}]})
  assert "compiled at the capacity donate: needs 1.00 GiB (9.0s)" in text
  assert "probe donate + microbatch(2): needs 512.00 MiB (2.0s)" in text
