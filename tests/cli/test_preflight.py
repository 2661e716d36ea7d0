"""Issue #10: `hbm-guard preflight` answers for several targets in one run."""

import json
import os
import subprocess
import sys

import pytest

from hbm_guard._src.backends import estimated as estimated_lib
from tests import paths

pytestmark = pytest.mark.real_compiler
ROOT = str(paths.ROOT)


def _run(*argv):
  env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  proc = subprocess.run([sys.executable, "-m", "hbm_guard", "preflight", *argv],
                        capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
  return proc.returncode, proc.stdout, proc.stderr


def test_two_targets_one_run_and_the_exit_status():
  code, out, err = _run("tests.helpers.preflight_factory:make", "--target", "v5e:1x1",
                        "--target", "v5e:2x2", "--capacity", "3MiB", "--json")
  assert code == 1, err[-2000:]  # one target does not fit
  rows = {r["target"]: r for r in json.loads(out)}
  assert set(rows) == {"v5e:1x1", "v5e:2x2"}
  for r in rows.values():
    assert {"target", "fits", "plan", "compiles", "peak_bytes", "capacity_bytes",
            "seconds"} <= set(r)
    assert r["capacity_bytes"] == 3 << 20
  assert not rows["v5e:1x1"]["fits"] and rows["v5e:1x1"]["peak_bytes"] > 3 << 20
  assert rows["v5e:2x2"]["fits"] and "reshard_fsdp" in rows["v5e:2x2"]["plan"]
  assert rows["v5e:2x2"]["peak_bytes"] <= 3 << 20


def test_every_target_fits_exits_0_with_a_table():
  code, out, err = _run("tests.helpers.preflight_factory:make", "--target", "v5e:2x2",
                        "--capacity", "3MiB")
  assert code == 0, err[-2000:]
  lines = out.splitlines()
  assert lines[0].split()[:3] == ["target", "fits", "compiles"]
  assert "step ms*" in lines[0]
  assert lines[1].split()[:2] == ["v5e:2x2", "yes"]
  end = lines[0].index("step ms*") + len("step ms*")
  assert float(lines[1][end - 9:end]) > 0  # the program's estimate, in its column
  assert lines[-1].startswith("* a step's time on the target, not timed: an estimate")
  assert "--estimated-rivals N" in lines[-1]


def test_rivals_compiled_for_the_target_are_listed_beside_the_plan_kept():
  code, out, err = _run("tests.helpers.preflight_factory:make_layers", "--target", "v5e:1x1",
                        "--capacity", "12MiB", "--max-class", "numerics",
                        "--estimated-rivals", "1", "--json")
  assert code == 0, err[-2000:]
  (row,) = json.loads(out)
  compared = row["compared"]
  assert len(compared) == 2 and compared[0]["fits"]  # the search's choice, one rival
  kept = next(c for c in compared if c["plan"] == row["plan"])
  assert row["estimated_step_ms"] == pytest.approx(1000 * kept["estimated_seconds"], rel=1e-3)
  # the plan kept's own peak, within the capacity, and every compile paid for counted
  assert row["peak_bytes"] == kept["peak_bytes"] and 0 < row["peak_bytes"] <= 12 << 20
  assert row["compiles"] >= len(compared)
  fastest = min(1000 * c["estimated_seconds"] for c in compared if c["estimated_seconds"])
  assert row["estimated_step_ms"] * (1 - estimated_lib.MARGIN) <= fastest


@pytest.mark.parametrize("argv", [["tests.helpers.preflight_factory:nope", "--target", "v5e:1x1"],
                                  ["no_such_module:make", "--target", "v5e:1x1"],
                                  ["tests.helpers.preflight_factory:make", "--target", "v9z:1x1"],
                                  ["tests.helpers.preflight_factory:make"],
                                  ["tests.helpers.preflight_factory:make", "--target", "v5e:1x1",
                                   "--estimated-rivals", "-1"]])
def test_usage_errors_exit_2(argv):
  code, _, err = _run(*argv)
  assert code == 2 and "Traceback" not in err
