"""Issue #10: `hbm-guard preflight` answers for several targets in one run."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real_compiler
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
  assert out.splitlines()[0].split()[:3] == ["target", "fits", "compiles"]
  assert "v5e:2x2" in out and "yes" in out


@pytest.mark.parametrize("argv", [["tests.helpers.preflight_factory:nope", "--target", "v5e:1x1"],
                                  ["no_such_module:make", "--target", "v5e:1x1"],
                                  ["tests.helpers.preflight_factory:make", "--target", "v9z:1x1"],
                                  ["tests.helpers.preflight_factory:make"]])
def test_usage_errors_exit_2(argv):
  code, _, err = _run(*argv)
  assert code == 2 and "Traceback" not in err
