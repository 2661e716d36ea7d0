"""Every real message in tests/data/corpus parses, with the numbers a person reads off it.

Expected values are typed from the text ("63.80G" -> G(63.80)), never copied from the
parser's output. A corpus file without an entry here fails `test_every_corpus_file_is_covered`.
"""

import pathlib

import pytest

import hbm_guard
from hbm_guard._src.record import record as R
from tests import paths

CORPUS = paths.DATA / "corpus"  # copied from the project's shared corpus, sources in INDEX.md


def K(x): return round(x * 2**10)
def M(x): return round(x * 2**20)
def G(x): return round(x * 2**30)
def T(x): return round(x * 2**40)
def E(x): return round(x * 2**60)


def body(name: str) -> str:
  text = (CORPUS / name).read_text()
  lines = text.split("\n")
  i = 0
  while i < len(lines) and lines[i].startswith("# "):
    i += 1
  return "\n".join(lines[i + 1:])  # after the header block and its blank line


# file -> fields of the record (top level), "breakdown" sub-dict, "alloc0" first allocation,
# "n_allocs". Everything read off the message text.
EXPECTED = {
    "001_easydel-166-falcon-v4-32.txt": dict(
        kind=R.COMPILE_HBM, error_code=None, memory_space="hbm", used_bytes=G(63.80),
        capacity_bytes=G(30.75), exceeded_bytes=G(33.05), temp_bytes=G(63.79),
        breakdown={"total": G(65.05), "reserved": G(1.25), "program": G(63.80),
                   "arguments": 0, "output": 0, "global": M(1.14), "scoped": M(4.56),
                   "HLO temp": G(63.79), "HLO temp unpadded": G(63.58),
                   "fragmentation": M(210.89)},
        alloc0=dict(size_bytes=G(2.00), shape=(32, 4096, 4096), dtype="f32",
                    source_line=1059, allocation_type="HLO temp", unpadded_bytes=G(2.00),
                    source_file="/home/air/workspace/EasyDel/src/easydel/modules/"
                                "attention_module.py")),
    "003_colabfold-62-alphafold-colab-tpu.txt": dict(
        kind=R.COMPILE_HBM, used_bytes=G(9.08), capacity_bytes=G(7.48),
        exceeded_bytes=G(1.60), breakdown={"reserved": M(530.00), "global": K(420.0),
                                           "HLO temp padded": G(9.06)},
        alloc0=dict(size_bytes=M(124.00), shape=(512, 245, 256), unpadded_bytes=M(122.50),
                    padding_bytes=M(1.50), op_name=None)),
    "004_flax-1733-conv-padding.txt": dict(
        kind=R.COMPILE_HBM, memory_space="hbm", used_bytes=G(10.96), capacity_bytes=None,
        breakdown={"total": G(11.47), "HLO temp unpadded": M(140.25),
                   "HLO temp padded": G(10.96), "global": K(4.0)},
        alloc0=dict(size_bytes=G(8.77))),
    "005_tensor2tensor-1382-lstm-tpu.txt": dict(
        kind=R.COMPILE_HBM, used_bytes=G(8.83), capacity_bytes=G(8.00),
        exceeded_bytes=M(848.88),
        breakdown={"arguments": M(64.32), "output": M(64.32), "output aliased": M(64.25),
                   "program reserved": K(4.0), "global": K(65.0), "HLO temp": G(8.25),
                   "fragmentation": M(1.01)},
        alloc0=dict(size_bytes=G(4.00), op_name="XLA_Args", shape=(256, 2048, 4096),
                    dtype="bf16")),
    "006_flowpm-27-cic-padding-32x.txt": dict(
        kind=R.COMPILE_HBM, used_bytes=G(41.74), capacity_bytes=G(16.00),
        exceeded_bytes=G(25.74), breakdown={"arguments": None, "output": None,
                                            "global": M(29.82), "HLO temp": G(41.19)},
        alloc0=dict(size_bytes=G(32.00), op_type="FloorMod",
                    op_name="slicewise_79/cic_update/FloorMod", shape=(8388608, 8, 4),
                    dtype="s32", unpadded_bytes=G(1.00), padding_bytes=G(31.00))),
    "008_tpu-inference-pr1882-enginecore-prefixed.txt": dict(
        kind=R.COMPILE_HBM, used_bytes=G(15.87),
        breakdown={"total": G(101.25), "reserved": M(260.00), "arguments": G(85.12),
                   "output": G(60.29), "output aliased": G(60.29), "global": 512,
                   "fragmentation": M(23.87)},
        alloc0=dict(size_bytes=M(384.00), shape=(128, 4096, 352), dtype="bf16",
                    unpadded_bytes=M(352.00), padding_bytes=M(32.00),
                    layout="2,1,0:T(16,128)(2,1)")),
    "009_pytorch-xla-6674-padding-4x.txt": dict(
        kind=R.COMPILE_HBM, used_bytes=G(15.45),
        breakdown={"global": M(2.36), "scoped": M(3.88), "HLO temp unpadded": G(9.40),
                   "fragmentation": M(5.52)},
        n_allocs=2,
        alloc0=dict(size_bytes=G(4.00), shape=(2048, 1, 2048, 128), dtype="bf16",
                    unpadded_bytes=G(1.00), padding_bytes=G(3.00), allocation_type="HLO temp",
                    xla_label="broadcast.6042.remat3 = broadcast(bitcast.26), "
                              "dimensions={2,3}")),
    "011_easydel-78-tinyllama-v2-8.txt": dict(
        kind=R.COMPILE_HBM, used_bytes=G(21.90), capacity_bytes=G(7.48),
        exceeded_bytes=G(14.42), n_allocs=0),
    "012_tensorflow-tpu-385-efficientnet-status.txt": dict(
        kind=R.COMPILE_HBM, used_bytes=G(8.38), capacity_bytes=G(8.00),
        exceeded_bytes=M(385.25)),
    "014_trax-270-reformer-colab.txt": dict(
        kind=R.COMPILE_HBM, used_bytes=G(18.74), capacity_bytes=G(8.00),
        exceeded_bytes=G(10.74)),
    "015_transformers-21363-markdown-mangled.txt": dict(
        kind=R.COMPILE_HBM, used_bytes=G(17.91), capacity_bytes=G(15.48),
        exceeded_bytes=G(2.43)),
    "017_gke-samples-pr1467-vllm-statusor.txt": dict(
        kind=R.COMPILE_HBM, used_bytes=G(20.44), capacity_bytes=G(15.75),
        exceeded_bytes=G(4.70)),
    "018_enzyme-jax-pr2422-e1000-prefixed.txt": dict(
        kind=R.COMPILE_HBM, error_code="E1000", used_bytes=G(215.17),
        capacity_bytes=G(31.25), exceeded_bytes=G(183.92)),
    "019_jax-7822-early-abort.txt": dict(
        kind=R.COMPILE_HBM_EARLY, used_bytes=E(3.47), capacity_bytes=G(14.49)),
    "021_au2018-detection-tpu-full-20-entries.txt": dict(
        kind=R.COMPILE_HBM, used_bytes=G(17.60), capacity_bytes=G(16.00),
        exceeded_bytes=G(1.60), n_allocs=20,
        breakdown={"program reserved": K(12.0), "scoped": M(5.41), "arguments": None},
        alloc0=dict(size_bytes=M(512.00), op_type="OneHot", op_name="one_hot",
                    shape=(4, 128, 128, 9, 18), unpadded_bytes=M(40.50),
                    padding_bytes=M(471.50))),
    "022_trax-1343-reformer-head-fragment.txt": dict(
        kind=R.COMPILE_HBM, used_bytes=G(97.92), n_allocs=2,
        breakdown={"program": G(97.92), "arguments": 0, "HLO temp unpadded": G(87.45)},
        alloc0=dict(size_bytes=G(1.00), op_type="add_any",
                    op_name="pmap(mapped_update)/add_any", source_line=711,
                    shape=(1, 524288, 512))),
    "023_trax-1343-reformer-tail-fragment.txt": dict(
        kind=R.COMPILE_HBM, n_allocs=1,
        alloc0=dict(size_bytes=M(512.00), op_name="DUMMY_47", shape=(524288, 256))),
    "024_easydel-95-header-no-entries.txt": dict(
        kind=R.COMPILE_HBM, used_bytes=G(8.98), n_allocs=0,
        breakdown={"total": G(9.50), "scoped": M(9.56), "fragmentation": M(36.60)}),
    "025_notes-e1000-prefixed-single-line-681M.txt": dict(
        kind=R.COMPILE_HBM, error_code="E1000", used_bytes=G(31.91),
        capacity_bytes=G(31.25), exceeded_bytes=M(681.08)),
    "027_xla-docs-e1000-early-abort-sample.txt": dict(
        kind=R.COMPILE_HBM_EARLY, used_bytes=T(3.84), capacity_bytes=G(90.96)),
    "028_xla-docs-e1000-tc-sc-sample.txt": dict(
        kind=R.COMPILE_HBM_TC_SC, tensorcore_bytes=G(34.82), sparsecore_bytes=G(174.10),
        capacity_bytes=G(95.74)),
    "029_notes-hlo-temporaries-verbatim-test-string.txt": dict(
        kind=R.COMPILE_HBM_EARLY, temp_bytes=G(98.58), capacity_bytes=G(94.74),
        hlo_module="jit_fwd_bwd", error_code=None),
    "031_notes-hlo-temporaries-dsv3-ironwood.txt": dict(
        kind=R.COMPILE_HBM_EARLY, temp_bytes=G(105.73), capacity_bytes=G(94.74)),
    "032_pytorch-xla-1735-reserve-bottom-with-breakdown.txt": dict(
        kind=R.RUNTIME_HBM, requested_bytes=G(3.95), free_bytes=G(1.92),
        capacity_bytes=G(8.00), largest_free_bytes=G(1.92),
        breakdown={"Top-of-Memory reserved": 554_696_704,
                   "Available after request": -2_735_391_744, "arguments": M(478.07),
                   "output": G(5.06), "scoped": M(17.43)}),
    "033_transformers-22328-xrt-reserve-bottom.txt": dict(
        kind=R.RUNTIME_HBM, requested_bytes=G(10.51), free_bytes=G(8.97),
        breakdown={"reservable": G(8.97)}),
    "035_pytorch-xla-4847-error-loading-program-fatal.txt": dict(
        kind=R.RUNTIME_HBM, requested_bytes=G(7.04), free_bytes=G(6.90)),
    "036_vllm-16521-reserve-with-compaction-note.txt": dict(
        kind=R.RUNTIME_HBM, requested_bytes=G(1.04), free_bytes=M(905.37),
        breakdown={"max reservable after compaction": M(905.37)}),
    "037_gemma-85-error-allocating-device-buffer.txt": dict(
        kind=R.RUNTIME_HBM, requested_bytes=G(15.65), free_bytes=G(11.08),
        device="0x0x0_HBM0"),
    "039_pytorch-xla-2569-attempting-to-allocate-hbm1.txt": dict(
        kind=R.RUNTIME_HBM, requested_bytes=M(180.59), free_bytes=M(142.58),
        device="0x3x0_HBM1"),
    "041_pytorch-xla-2371-xrt-failed-to-allocate-request.txt": dict(
        kind=R.RUNTIME_HBM, requested_bytes=15_360_000_000),
    "042_xla-docs-e0101-program-load-sample.txt": dict(
        kind=R.RUNTIME_HBM, requested_bytes=G(29.49), free_bytes=M(147.64),
        hlo_module="jit_embedding_pipeline_step_fn"),
    "043_xla-docs-e0100-device-buffer-sample.txt": dict(
        kind=R.RUNTIME_HBM, requested_bytes=M(8.00), free_bytes=M(6.43),
        device="0x0x1_HBM0"),
    "044_jaxline-11-gpu-oom-bytes.txt": dict(kind=R.RUNTIME_GPU, requested_bytes=285212672),
    "045_afprofile-8-gpu-bufferassignment-stats.txt": dict(
        kind=R.RUNTIME_GPU, requested_bytes=4770354232,
        breakdown={"parameter allocation": M(372.76), "constant allocation": K(48.5),
                   "maybe_live_out allocation": G(9.64),
                   "preallocated temp allocation": G(4.44), "total allocation": G(14.44),
                   "fragmentation": M(680.30)}),
    "048_jax-788-gpu-2019-wrapped.txt": dict(kind=R.RUNTIME_GPU, requested_bytes=5520758552),
    "049_mesh-transformer-jax-66-failed-to-allocate-request.txt": dict(
        kind=R.RUNTIME_GPU, requested_bytes=33554432),
    "050_diffusers-1427-oom-bytes-colab.txt": dict(
        kind=R.RUNTIME_GPU, requested_bytes=21760049152),
    "051_pytorch-xla-9524-vmem-compile-oom.txt": dict(
        kind=R.COMPILE_OTHER_MEMORY, memory_space="vmem", used_bytes=M(32.42),
        capacity_bytes=M(16.00), exceeded_bytes=M(16.42)),
    "053_tpu-inference-2458-e1001-vmem-enginecore.txt": dict(
        kind=R.COMPILE_OTHER_MEMORY, memory_space="vmem", error_code="E1001"),
    "054_jax-20008-pallas-shared-memory-limit.txt": None,
    "055_rocm-jax-404-shared-memory-title.txt": None,
    "057_meta-dataset-24-tf-too-many-open-files.txt": None,
}


def test_every_corpus_file_is_covered():
  assert CORPUS.is_dir(), f"corpus not found at {CORPUS}"
  files = {p.name for p in CORPUS.glob("[0-9]*.txt")}
  assert files == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_file_parses_to_what_it_says(name):
  rec = hbm_guard.parse(body(name))
  want = EXPECTED[name]
  if want is None:
    assert rec is None
    return
  assert rec is not None
  want = dict(want)
  breakdown = want.pop("breakdown", {})
  alloc0 = want.pop("alloc0", None)
  n_allocs = want.pop("n_allocs", None)
  for key, value in want.items():
    assert getattr(rec, key) == value, key
  for key, value in breakdown.items():
    assert rec.breakdown.get(key, "missing") == value, key
  if n_allocs is not None:
    assert len(rec.allocations) == n_allocs
  if alloc0 is not None:
    for key, value in alloc0.items():
      assert getattr(rec.allocations[0], key) == value, key
  assert rec.raw.strip() and len(rec.raw) <= len(body(name))


@pytest.mark.parametrize("name", sorted(k for k, v in EXPECTED.items() if v))
def test_record_round_trips_through_json(name):
  import json
  rec = hbm_guard.parse(body(name))
  d = json.loads(json.dumps(rec.to_dict()))
  assert hbm_guard.E1000Record.from_dict(d) == rec
  assert set(d) >= {
      "kind", "error_code", "memory_space", "used_bytes", "capacity_bytes",
      "exceeded_bytes", "temp_bytes", "tensorcore_bytes", "sparsecore_bytes",
      "requested_bytes", "free_bytes", "largest_free_bytes", "hlo_module", "breakdown",
      "allocations", "arguments_and_outputs", "raw"}


def test_full_listing_keeps_all_twenty_entries_in_order():
  rec = hbm_guard.parse(body("021_au2018-detection-tpu-full-20-entries.txt"))
  sizes = [a.size_bytes for a in rec.allocations]
  assert sizes[:2] == [M(512.00), M(256.00)] and sizes[-1] == M(128.00)
  assert rec.allocations[1].op_name is None  # entry 2 has no Operator line
  assert rec.allocations[19].op_name == "resnet152/MaxPool_36"


def test_wrappers_around_the_message():
  msg = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
         "space hbm. Used 20.44G of 15.75G hbm. Exceeded hbm capacity by 4.70G.")
  variants = [
      msg,
      "W1110 07:24:24.123456 1234 compiler.cc:99] " + msg,
      "> " + msg,
      "(EngineCore_DP0 pid=42) " + msg.replace("Used", "\n(EngineCore_DP0 pid=42) Used"),
      "Traceback (most recent call last):\n  File \"x.py\", line 1\n" + msg + "\n",
      msg.replace(" Used", "\n      Used").replace(" Exceeded", "\nExceeded"),
  ]
  for v in variants:
    rec = hbm_guard.parse(v)
    assert rec is not None, v
    assert (rec.used_bytes, rec.capacity_bytes, rec.exceeded_bytes) == (
        G(20.44), G(15.75), G(4.70)), v


def test_exception_and_bytes_inputs():
  msg = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1024 bytes."
  assert hbm_guard.parse(RuntimeError(msg)).requested_bytes == 1024
  assert hbm_guard.parse(msg.encode()).requested_bytes == 1024
  try:
    try:
      raise RuntimeError(msg)
    except RuntimeError as e:
      raise ValueError("wrapped") from e
  except ValueError as outer:
    assert hbm_guard.parse(outer).requested_bytes == 1024


@pytest.mark.parametrize("text", [
    None, "", "hello", "RESOURCE_EXHAUSTED: grpc: received message larger than max "
    "(8388608 vs. 4194304)", "RESOURCE_EXHAUSTED: Too many open files",
    "Ran out of memory in memory space", "Used 1G of 2G hbm", 12345, object()])
def test_non_oom_inputs_return_none(text):
  assert hbm_guard.parse(text) is None


def test_parse_size_units_are_binary():
  assert R.parse_size("1K") == 1024
  assert R.parse_size("1.5M") == 1572864
  assert R.parse_size("0B") == 0
  assert R.parse_size("14.30GiB") == round(14.30 * 2**30)
  assert R.parse_size("-2.55G") == -round(2.55 * 2**30)
  assert R.parse_size("unknown") is None


def test_big_log_with_false_anchors_before_the_message():
  noise = "I1130 10:00:00.000000 1 data.py:7] shard size: 12 files, largest program ok\n"
  text = noise * 90000 + body("025_notes-e1000-prefixed-single-line-681M.txt") + noise * 1000
  assert len(text) > 4 << 20  # the large-input path
  rec = hbm_guard.parse(text)
  assert (rec.kind, rec.used_bytes, rec.exceeded_bytes) == (R.COMPILE_HBM, G(31.91), M(681.08))
  assert hbm_guard.parse(noise * 90000) is None


def test_runtime_reserve_needs_more_than_is_free():
  # corpus 032: 3.95G requested, 1.92G free on an 8.00G chip mostly held by other buffers.
  rec = hbm_guard.parse(body("032_pytorch-xla-1735-reserve-bottom-with-breakdown.txt"))
  assert rec.kind == R.RUNTIME_HBM
  assert rec.required_bytes == G(3.95) and rec.available_bytes == G(1.92)
  assert rec.shortfall_bytes == G(3.95) - G(1.92) > 0
  assert "by 2.03 GiB" in hbm_guard.diagnose(rec).summary


def test_record_pickles():
  import pickle
  rec = hbm_guard.parse(body("021_au2018-detection-tpu-full-20-entries.txt"))
  again = pickle.loads(pickle.dumps(rec))
  assert again == rec and again.breakdown == rec.breakdown and again.allocations
