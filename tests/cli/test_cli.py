"""`hbm-guard explain`: what a person sees, --json, and exit codes."""

import io
import json
import subprocess
import sys

from hbm_guard._src.cli import cli
from tests.record.test_record_corpus import CORPUS, body, G


def run(argv, stdin=None):
  out = io.StringIO()
  old = sys.stdin
  if stdin is not None:
    sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode()))
  try:
    code = cli.main(argv, out=out)
  finally:
    sys.stdin = old
  return code, out.getvalue()


def test_explain_a_file(tmp_path):
  f = tmp_path / "log.txt"
  f.write_text(body("006_flowpm-27-cic-padding-32x.txt"))
  code, out = run(["explain", str(f)])
  assert code == 0
  assert "needs:     41.74 GiB" in out and "has:       16.00 GiB" in out
  assert "short by:  25.74 GiB" in out
  assert "slicewise_79/cic_update/FloorMod" in out
  assert "Scenario S2" in out and "S3.C" in out
  assert "[8388608, 8, 128]" in out  # the padded layout


def test_explain_json_from_stdin():
  code, out = run(["explain", "-", "--json"], stdin=body("029_notes-hlo-temporaries-verbatim-"
                                                         "test-string.txt"))
  assert code == 0
  data = json.loads(out)
  assert data["record"]["kind"] == "compile_hbm_early"
  assert data["record"]["temp_bytes"] == G(98.58)
  assert data["diagnosis"]["scenario"] == "S3"


def test_explain_exit_1_when_no_oom(tmp_path):
  f = tmp_path / "log.txt"
  f.write_text(body("054_jax-20008-pallas-shared-memory-limit.txt"))
  assert run(["explain", str(f)])[0] == 1
  code, out = run(["explain", str(f), "--json"])
  assert code == 1 and json.loads(out) == {"record": None, "diagnosis": None}


def test_explain_exit_2_on_usage_errors(tmp_path):
  assert run(["explain", str(tmp_path / "missing.txt")])[0] == 2
  assert run(["frobnicate"])[0] == 2
  assert run([])[0] == 2


def test_large_log_with_the_error_at_the_end(tmp_path):
  noise = "I1130 10:00:00.000000 1 train.py:10] step 123 loss 0.5 RESOURCE_EXHAUSTED? no\n"
  f = tmp_path / "big.log"
  f.write_text(noise * 60000 + body("021_au2018-detection-tpu-full-20-entries.txt"))
  code, out = run(["explain", str(f), "--json"])
  assert code == 0
  rec = json.loads(out)["record"]
  assert rec["used_bytes"] == G(17.60) and len(rec["allocations"]) == 20
  assert len(rec["raw"]) < 20000  # the excerpt, not the whole log


def test_console_script_is_installed():
  proc = subprocess.run([sys.executable, "-m", "hbm_guard", "explain",
                         str(CORPUS / "018_enzyme-jax-pr2422-e1000-prefixed.txt")],
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr
  assert "E1000" in proc.stdout


def test_report_command_renders_a_guard_report(tmp_path):
  import jax.numpy as jnp
  import hbm_guard
  import pytest

  def step(w, x):
    return w + (x @ w).sum(), (x @ w).sum()

  g = hbm_guard.guarded_jit(step, state_argnums=0, capacity="1KiB", report_dir=str(tmp_path))
  with pytest.raises(hbm_guard.LadderExhaustedError):
    g(jnp.ones((64, 64)), jnp.ones((8, 64)))
  code, out = run(["report", g.report_path])
  assert code == 0
  assert "exhausted after 1 compile(s)" in out  # the planner probed donation: no compile
  assert "#1 plain jit: oom" in out and "probe donate: needs" in out
  assert "skipped reshard_fsdp: needs several devices" in out
  assert "what to do next:" in out
  assert run(["report", str(tmp_path / "nope.json")])[0] == 2


def test_report_names_the_plan_in_force(tmp_path):
  import jax
  import jax.numpy as jnp
  import hbm_guard

  def step(w, x):
    g = jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
    return w - 0.1 * g, g.sum()

  w, x = jnp.full((512, 512), 0.01, jnp.float32), jnp.ones((64, 512))
  peak = hbm_guard._src.backends.compile.memory_of(jax.jit(step).lower(w, x).compile())["peak"]
  g = hbm_guard.guarded_jit(step, state_argnums=0, capacity=peak - w.nbytes // 2,
                            report_dir=str(tmp_path))
  g(w, x)
  code, out = run(["report", g.report_path])
  assert code == 0 and "fits after 2 compile(s)" in out
  assert "plan in force: donate" in out
