"""diagnose picks the E1000 scenario and cites its sections."""

import json

import pytest

import hbm_guard
from hbm_guard._src.record import diagnose as D
from tests.record.test_record_corpus import body, G, M


def diag(name):
  return hbm_guard.diagnose(hbm_guard.parse(body(name)))


def test_tc_sc_sample_is_s1_sparsecore_high():
  d = diag("028_xla-docs-e1000-tc-sc-sample.txt")
  assert (d.scenario, d.variant) == ("S1", "sc_high")
  assert any("xla_sc_num_serialized_tables_to_optimize_hbm" in a.text for a in d.advice)
  assert all(a.section == "S1" for a in d.advice)


@pytest.mark.parametrize("tc,sc,variant", [
    ("120.00G", "10.00G", "tc_high"), ("60.00G", "50.00G", "balanced")])
def test_tc_sc_variants(tc, sc, variant):
  rec = hbm_guard.parse(f"RESOURCE_EXHAUSTED: TPU TensorCore Hbm usage: {tc}, SparseCore "
                        f"Hbm usage {sc}, exceeding available bytes: 95.74G")
  d = hbm_guard.diagnose(rec)
  assert (d.scenario, d.variant) == ("S1", variant)
  assert "S3" in d.sections


def test_one_huge_padded_allocation_is_s2_with_padding():
  d = diag("006_flowpm-27-cic-padding-32x.txt")
  assert d.scenario == "S2"
  assert "S3.C" in d.sections
  big = d.large_allocations[0]
  assert big.size_bytes == G(32.00) and big.op_name == "slicewise_79/cic_update/FloorMod"
  pad = d.padding[0]
  # s32[8388608,8,4] with tile (8,128): the minor-most dim 4 pads to 128 -> 32x.
  assert pad.shape == (8388608, 8, 4) and pad.padded_shape == (8388608, 8, 128)
  assert pad.padded_dims == (2,) and pad.expansion == 32.0


def test_s2_names_source_file_and_line():
  d = diag("001_easydel-166-falcon-v4-32.txt")
  # 2.00G allocations on a 30.75G chip are not >50%: this is S3, the total.
  assert d.scenario == "S3"
  rec = hbm_guard.parse(body("001_easydel-166-falcon-v4-32.txt"))
  small_chip = hbm_guard.E1000Record.from_dict({**rec.to_dict(), "capacity_bytes": G(3.0)})
  d2 = hbm_guard.diagnose(small_chip)
  assert d2.scenario == "S2"
  assert d2.large_allocations[0].source == (
      "/home/air/workspace/EasyDel/src/easydel/modules/attention_module.py:1059")


def test_argument_too_large_suspects_missing_sharding():
  d = diag("005_tensor2tensor-1382-lstm-tpu.txt")  # 4.00G XLA_Args on an 8.00G chip: 50%
  assert d.scenario == "S3"  # exactly half is not "larger than 50%"
  rec = hbm_guard.parse(body("005_tensor2tensor-1382-lstm-tpu.txt"))
  d2 = hbm_guard.diagnose(
      hbm_guard.E1000Record.from_dict({**rec.to_dict(), "capacity_bytes": G(7.0)}))
  assert d2.scenario == "S2"
  assert "missing_sharding" in d2.large_allocations[0].suspects
  assert D.RESHARD_FSDP in d2.rungs


def test_debug_print_is_flagged():
  text = ("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 20.00G of 16.00G "
          "hbm. Exceeded hbm capacity by 4.00G.\n\n  Largest program allocations in hbm:\n\n"
          "  1. Size: 12.00G\n     Operator: op_name=\"jit(step)/debug_callback\" "
          "source_file=\"train.py\" source_line=42\n     Shape: f32[3221225472]{0}\n"
          "     ==========================\n")
  d = hbm_guard.diagnose(hbm_guard.parse(text))
  assert d.scenario == "S2"
  assert d.large_allocations[0].suspects == ("debug_print",)
  assert "jax.debug.print" in d.advice[0].text
  assert d.large_allocations[0].source == "train.py:42"


def test_padding_waste_without_shapes_is_s3c():
  d = diag("004_flax-1733-conv-padding.txt")  # HLO temp 1.2% utilised: padding
  assert "S3.C" in d.sections


def test_padding_finding_for_bf16_tile():
  d = diag("009_pytorch-xla-6674-padding-4x.txt")
  pad = d.padding[0]
  # bf16[2048,1,2048,128]{0,1,3,2:T(4,128)}: dim 1 (size 1) is second-minor, pads to 4.
  assert pad.padded_dims == (1,) and pad.padded_shape == (2048, 4, 2048, 128)
  assert pad.expansion == 4.0


def test_total_too_large_is_s3_with_ranked_rungs():
  d = diag("011_easydel-78-tinyllama-v2-8.txt")
  assert d.scenario == "S3"
  assert d.rungs[0] == D.DONATE
  assert D.BF16 in d.rungs
  bf16 = [a for a in d.advice if a.rung == D.BF16][0]
  assert bf16.may_change_behaviour


def test_state_heavy_step_ranks_sharding_before_remat():
  d = diag("008_tpu-inference-pr1882-enginecore-prefixed.txt")  # arguments 85G >> temps 16G
  assert d.rungs.index(D.RESHARD_FSDP) < d.rungs.index(D.LAYER_REMAT)


def test_vmem_is_not_an_hbm_scenario():
  d = diag("051_pytorch-xla-9524-vmem-compile-oom.txt")
  assert d.scenario is None and d.rungs == ()


def test_runtime_oom_says_so():
  d = diag("037_gemma-85-error-allocating-device-buffer.txt")
  assert d.scenario == "S3" and "run time" in d.advice[0].text


def test_every_advice_cites_a_section_of_e1000():
  sections = {"S1", "S2", "S3", "S3.A", "S3.B", "S3.C", "S3.D", "S3.E", "S3.F"}
  from tests.record.test_record_corpus import EXPECTED
  for name, want in EXPECTED.items():
    if not want:
      continue
    d = diag(name)
    json.dumps(d.to_dict())
    if d.scenario:
      assert all(a.section in sections for a in d.advice), name
      assert set(d.sections) <= sections


def test_gpu_runtime_oom_names_the_preallocation_settings():
  rec = hbm_guard.parse(body("044_jaxline-11-gpu-oom-bytes.txt"))
  assert rec.kind == "runtime_gpu"
  text = " ".join(a.text for a in hbm_guard.diagnose(rec).advice)
  assert "XLA_PYTHON_CLIENT_MEM_FRACTION" in text and "XLA_PYTHON_CLIENT_PREALLOCATE" in text
  tpu = hbm_guard.parse(body("032_pytorch-xla-1735-reserve-bottom-with-breakdown.txt"))
  assert "XLA_PYTHON_CLIENT" not in " ".join(a.text for a in hbm_guard.diagnose(tpu).advice)
