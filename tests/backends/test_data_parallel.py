"""Resharding is FSDP proper (#22): the batch is sharded over the devices with the state.


Each device takes its share of the examples; the per-example values of an unmodified step's
loss are kept sharded on their batch axis (the drop-in analysis knows where it is), so the
compiler gathers parameters instead of the batch.
"""

import json
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from hbm_guard._src.backends import options as options_lib
from hbm_guard._src.backends import steps as steps_lib
from hbm_guard._src.plans import plan as plan_lib
from tests import paths
from tests.dropin import test_drop_in as drop_in

ROOT = str(paths.ROOT)


def test_four_cpu_devices_each_take_a_quarter_of_the_batch_and_train_the_same(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu", HG_REPORT_DIR=str(tmp_path))
  proc = subprocess.run([sys.executable, "-m", "tests.helpers.data_parallel_main"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["devices"] == 4 and out["plan"]["shard_state"] and out["plan"]["shard_batch"]
  assert out["compiles"] <= 3 and out["final_peak"] <= out["capacity"]
  assert out["batch_spec"] == "PartitionSpec('fsdp',)" or out["batch_spec"] == "P('fsdp',)"
  # each device's matmuls see a quarter of the batch's rows (32 x 64 tokens / 4)
  assert out["dot_rows_sharded"] * 4 == out["dot_rows_replicated"] == 32 * 64
  for got, want in out["losses"]:
    assert abs(got - want) <= 1e-5 * abs(want)
  assert out["param_rel"] < 1e-5


def _flops(compiled) -> float:
  analysis = compiled.cost_analysis()
  analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
  return float(analysis["flops"])


@pytest.mark.real_compiler
def test_on_v5e_2x2_each_chip_holds_a_quarter_of_the_batch(v5e_devices):
  tokens = drop_in._tokens(batch=32, seq=64)  # pylint: disable=protected-access
  state = drop_in._linen_state(tokens, width=64)  # pylint: disable=protected-access
  args = (state, {"inputs": tokens})
  builder = steps_lib.StepBuilder(drop_in.lm1b_train_step, options_lib.make(state_argnums=0))
  builder.learn_state(args, {})
  plan = plan_lib.Plan(donate_argnums=(0,), shard_state=True, shard_batch=True)
  layout = builder.layout(plan, args, v5e_devices)
  mesh = jax.sharding.Mesh(np.array(v5e_devices), ("fsdp",))
  replicated = {**layout, 1: jax.tree.map(lambda _: NamedSharding(mesh, P()), args[1])}
  per_chip, rows = {}, {}
  for name, lay in (("sharded", layout), ("replicated", replicated)):
    targs, tkw = builder.abstract(args, {}, lay, v5e_devices)
    compiled = builder.jit(plan, lay, 2).lower(*targs, **tkw).compile()
    per_chip[name] = _flops(compiled)
    rows[name] = _rows(compiled.as_text())
  # each chip's program holds a quarter of the batch's 32 x 64 tokens; with the batch left
  # replicated every chip holds all of them (libtpu then splits the features instead, so
  # its per-chip flop count is about the same: 3.31e8 against 3.35e8 here)
  assert rows["sharded"] == 32 * 64 // 4 and rows["replicated"] == 32 * 64
  assert per_chip["sharded"] <= per_chip["replicated"]


def _rows(hlo: str) -> int:
  return max(int(m.group(1)) for m in re.finditer(
      r"= f32\[(\d+),\d+\]\{[^}]*\} (?:dot|convolution|fusion)\(", hlo))


def test_the_planner_prices_a_sharded_batch_per_device():
  tokens = drop_in._tokens(batch=32, seq=16)  # pylint: disable=protected-access
  state = drop_in._linen_state(tokens)  # pylint: disable=protected-access
  args = (state, {"inputs": tokens})
  builder = steps_lib.StepBuilder(drop_in.lm1b_train_step, options_lib.make(state_argnums=0))
  builder.learn_state(args, {})
  whole = builder.flops(plan_lib.Plan(), args, {}, n_devices=4)
  sharded = builder.flops(plan_lib.Plan(shard_state=True, shard_batch=True), args, {},
                          n_devices=4)
  assert builder.flops(plan_lib.Plan(shard_state=True), args, {}, n_devices=4) == whole
  assert sharded == pytest.approx(whole / 4)
  odd = (state, {"inputs": tokens[:30]})  # 30 examples do not split over 4 devices
  assert builder.flops(plan_lib.Plan(shard_state=True, shard_batch=True), odd, {},
                       n_devices=4) == \
      builder.flops(plan_lib.Plan(), odd, {}, n_devices=4)
