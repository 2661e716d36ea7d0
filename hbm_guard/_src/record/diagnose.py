"""Which scenario of the E1000 document a record is, and what to do about it.

Every finding and every piece of advice cites its section of the E1000 page (S1, S2,
S3.A ... S3.F). Rung names are the ladder's (`configs/ladder.json`), so a diagnosis can say
which fallbacks the guard will try.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from typing import Any

from hbm_guard._src.record import record as record_lib

E1000_DOCS = "https://openxla.org/xla/errors/error_1000"

# Rung names shared with the ladder.
DONATE = "donate"
LAYER_REMAT = "layer_remat"
MICROBATCH = "microbatch"
OFFLOAD_OPTIMIZER = "offload_optimizer"
RESHARD_FSDP = "reshard_fsdp"
XLA_REMAT_PEAK_PRIORITY = "xla_remat_peak_priority"
XLA_REMAT_AGGRESSIVE = "xla_remat_aggressive"
XLA_PRE_FUSION_REMAT = "xla_pre_fusion_remat"
BF16 = "bf16"

LARGE_FRACTION = 0.5  # S2: "allocations larger than 50% of the HBM limit"
PADDING_FRACTION = 0.2  # S3.C: padding worth naming when it is this share of a buffer

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1,
                "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_DEBUG_HINT = re.compile(r"debug_callback|debug_print|host_callback|io_callback|outfeed|"
                         r"pure_callback", re.I)
_ARGUMENT_HINT = re.compile(r"XLA_Args|params|Argument \d+|parameter", re.I)


class Scenario(enum.StrEnum):
  """The scenarios of E1000.md."""
  S1 = "S1"  # balance TensorCore and SparseCore usage
  S2 = "S2"  # one unexpectedly large allocation
  S3 = "S3"  # the total of all allocations is too large


@dataclasses.dataclass(frozen=True)
class Advice:
  section: str
  text: str
  rung: str | None = None
  may_change_behaviour: bool = False


@dataclasses.dataclass(frozen=True)
class LargeAllocation:
  """An allocation above half the capacity (S2), with where it comes from."""
  index: int
  size_bytes: int
  fraction_of_capacity: float
  op_name: str | None
  source: str | None  # "file:line"
  shape_text: str | None
  suspects: tuple[str, ...]  # "debug_print", "missing_sharding"


@dataclasses.dataclass(frozen=True)
class PaddingFinding:
  """A buffer that the TPU layout pads (S3.C)."""
  index: int
  shape: tuple[int, ...]
  padded_shape: tuple[int, ...]
  aligned_shape: tuple[int, ...]
  padded_dims: tuple[int, ...]
  padding_bytes: int
  expansion: float


@dataclasses.dataclass(frozen=True)
class Diagnosis:
  scenario: Scenario | None  # None when E1000's advice does not apply
  variant: str | None  # S1: "sc_high", "tc_high", "balanced"
  sections: tuple[str, ...]
  summary: str
  advice: tuple[Advice, ...]
  rungs: tuple[str, ...]
  large_allocations: tuple[LargeAllocation, ...] = ()
  padding: tuple[PaddingFinding, ...] = ()
  docs: str = E1000_DOCS

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def format_bytes(n: int | None) -> str:
  """68504728371 -> '63.80 GiB'."""
  if n is None:
    return "unknown"
  sign, n = ("-", -n) if n < 0 else ("", n)
  for unit, scale in (("EiB", 1 << 60), ("TiB", 1 << 40), ("GiB", 1 << 30),
                      ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if n >= scale:
      return f"{sign}{n / scale:.2f} {unit}"
  return f"{sign}{n} B"


def _tiles(layout: str | None) -> tuple[list[int], tuple[int, ...]] | None:
  """'1,2,0:T(8,128)(2,1)' -> ([1, 2, 0], (8, 128))."""
  if not layout or ":" not in layout:
    return None
  order_text, rest = layout.split(":", 1)
  tile = re.search(r"T\(([\d,]+)\)", rest)
  if not tile:
    return None
  try:
    order = [int(x) for x in order_text.split(",") if x.strip()]
    dims = tuple(int(x) for x in tile.group(1).split(","))
  except ValueError:
    return None
  return order, dims


def padding_of(alloc: record_lib.Allocation) -> PaddingFinding | None:
  """How the TPU tile pads this buffer: which dimensions, to what, and the fix."""
  if alloc.shape is None or not alloc.shape:
    return None
  tiles = _tiles(alloc.layout)
  if tiles is None:
    return None
  order, tile = tiles
  if sorted(order) != list(range(len(alloc.shape))):
    return None
  padded = list(alloc.shape)
  aligned = list(alloc.shape)
  padded_dims = []
  # The tile covers the most-minor dimensions: the last tile entry the most minor.
  for k, multiple in enumerate(reversed(tile)):
    if k >= len(order) or multiple <= 1:
      continue
    dim = order[k]
    size = alloc.shape[dim]
    rounded = math.ceil(size / multiple) * multiple
    if rounded != size:
      padded[dim] = rounded
      padded_dims.append(dim)
      down = (size // multiple) * multiple
      aligned[dim] = down if down else multiple
  if not padded_dims:
    return None
  if alloc.padding_bytes is not None and alloc.size_bytes:
    waste = alloc.padding_bytes
    expansion = alloc.size_bytes / max(1, alloc.size_bytes - waste)
  else:
    expansion = math.prod(padded) / max(1, math.prod(alloc.shape))
    itemsize = _DTYPE_BYTES.get(alloc.dtype or "", 0)
    waste = int((math.prod(padded) - math.prod(alloc.shape)) * itemsize)
  return PaddingFinding(index=0, shape=tuple(alloc.shape), padded_shape=tuple(padded),
                        aligned_shape=tuple(aligned), padded_dims=tuple(padded_dims),
                        padding_bytes=waste, expansion=round(expansion, 2))


_SYSTEM = re.compile(r"^(overlays?|reserved|program|scoped|global)$", re.I)


def is_system(a: record_lib.Allocation) -> bool:
  """Program code (overlays) and runtime reservations: nothing the user's code allocates."""
  return any(_SYSTEM.match((x or "").strip()) for x in (a.xla_label, a.allocation_type))


def _large(rec: record_lib.E1000Record) -> tuple[LargeAllocation, ...]:
  cap = rec.capacity_bytes
  if not cap:
    return ()
  out = []
  for i, a in enumerate(rec.allocations + rec.arguments_and_outputs, start=1):
    if a.size_bytes is None or a.size_bytes <= LARGE_FRACTION * cap or is_system(a):
      continue
    text = " ".join(filter(None, (a.op_name, a.op_type, a.xla_label)))
    suspects = []
    if _DEBUG_HINT.search(text):
      suspects.append("debug_print")
    if _ARGUMENT_HINT.search(text) or a in rec.arguments_and_outputs:
      suspects.append("missing_sharding")
    source = (f"{a.source_file}:{a.source_line}" if a.source_file and a.source_line
              else a.source_file)
    out.append(LargeAllocation(index=i, size_bytes=a.size_bytes,
                               fraction_of_capacity=round(a.size_bytes / cap, 3),
                               op_name=a.op_name, source=source, shape_text=a.shape_text,
                               suspects=tuple(suspects)))
  return tuple(out)


def _padding(rec: record_lib.E1000Record) -> tuple[PaddingFinding, ...]:
  out = []
  for i, a in enumerate(rec.allocations + rec.arguments_and_outputs, start=1):
    finding = padding_of(a)
    if finding is None or not a.size_bytes:
      continue
    if finding.padding_bytes >= PADDING_FRACTION * a.size_bytes:
      out.append(dataclasses.replace(finding, index=i))
  return tuple(out)


def _program_padding_waste(rec: record_lib.E1000Record) -> int | None:
  padded = rec.breakdown.get("HLO temp padded")
  unpadded = rec.breakdown.get("HLO temp unpadded")
  if padded and unpadded is not None and padded - unpadded >= PADDING_FRACTION * padded:
    return padded - unpadded
  return None


_REMAT_FLAGS = ("--xla_tpu_rematerialization_algo=PEAK_PRIORITY, "
                "--xla_tpu_rematerialization_max_block_size_limit=32, "
                "--xla_tpu_rematerialization_block_effort_factor=10.0, "
                "--xla_tpu_pre_fusion_remat=true")


def _s3_advice(rec: record_lib.E1000Record) -> list[Advice]:
  args = rec.breakdown.get("arguments") or 0
  temps = rec.temp_bytes or rec.breakdown.get("program") or 0
  state_heavy = args > temps
  donate = Advice("S3.A", "Donate the buffers the step replaces (donate_argnums on jax.jit), "
                  "so outputs reuse the inputs' memory.", DONATE)
  remat = Advice("S3.E", "Rematerialise per layer (jax.checkpoint with a checkpoint policy "
                 "on each layer, not the whole step) to trade recompute for activations.",
                 LAYER_REMAT)
  micro = Advice("S3.A", "Cut the per-step batch, keeping the global batch by accumulating "
                 "gradients over microbatches: activations scale with batch.", MICROBATCH)
  offload = Advice("S3.B", "Offload optimizer state (or activations) to host memory.",
                   OFFLOAD_OPTIMIZER)
  shard = Advice("S3.B", "Shard parameters and optimizer state over more chips (FSDP), or "
                 "use a larger topology or a newer TPU generation with more HBM per chip.",
                 RESHARD_FSDP)
  flags = Advice("S3.E", "Push XLA's rematerialisation pass (" + _REMAT_FLAGS + "); a last "
                 "resort (S3.D): slower compiles and steps.", XLA_REMAT_PEAK_PRIORITY)
  bf16 = Advice("S3.A", "Mixed precision (bfloat16) or quantisation for the largest "
                "tensors.", BF16, may_change_behaviour=True)
  profile = Advice("S3.F", "Look at the peak in XProf's memory viewer to see which buffers "
                   "are live there.")
  if state_heavy:
    order = [donate, shard, offload, remat, micro, flags, bf16, profile]
  else:
    order = [donate, remat, micro, offload, shard, flags, bf16, profile]
  return order


def diagnose(rec: record_lib.E1000Record) -> Diagnosis:
  """The scenario of E1000.md a record falls under, with ranked advice."""
  large = _large(rec)
  padding = _padding(rec)
  short = rec.shortfall_bytes
  over = f" by {format_bytes(short)}" if short and short > 0 else ""
  if rec.kind == record_lib.COMPILE_OTHER_MEMORY:
    return _other_memory(rec, over)
  padding_advice = _padding_advice(padding, _program_padding_waste(rec))
  if rec.kind == record_lib.COMPILE_HBM_TC_SC:
    return _tensorcore_sparsecore(rec, large, padding)
  if large:
    return _large_allocations(large, padding, padding_advice, rec)
  return _total_too_large(rec, large, padding, padding_advice, over)


def _rungs_of(advice) -> tuple[str, ...]:
  return tuple(dict.fromkeys(a.rung for a in advice if a.rung))


def _other_memory(rec: record_lib.E1000Record, over: str) -> Diagnosis:
  return Diagnosis(
      scenario=None, variant=None, sections=(),
      summary=(f"Compile-time out-of-memory in {rec.memory_space or 'a non-HBM memory'}"
               f"{' (' + rec.error_code + ')' if rec.error_code else ''}{over}: not HBM, so "
               "E1000's scenarios and the HBM ladder do not apply."),
      advice=(Advice("-", "Reduce the kernel's block sizes or scoped memory limit "
                     "(e.g. --xla_tpu_scoped_vmem_limit_kib); see the error code's page."),),
      rungs=())


def _padding_advice(padding, program_waste) -> list[Advice]:
  if not (padding or program_waste):
    return []
  where = ", ".join(f"#{p.index} {list(p.shape)} pads to {list(p.padded_shape)} ({p.expansion}x)"
                    for p in padding[:3])
  if program_waste and not where:
    where = f"{format_bytes(program_waste)} of HLO temp is padding"
  return [Advice(
      "S3.C", "Padding wastes memory (" + where + "). Keep large dimensions (batch, "
      "embedding, hidden) multiples of 128 (minor-most) and 8 (second-minor), or move small "
      "dimensions away from the two minor-most positions.", may_change_behaviour=True)]


def _tensorcore_sparsecore(rec: record_lib.E1000Record, large, padding) -> Diagnosis:
  """S1: TensorCore and SparseCore figures, and which of them is over."""
  tc, sc, cap = rec.tensorcore_bytes or 0, rec.sparsecore_bytes or 0, rec.capacity_bytes
  if cap and sc > cap and tc <= cap:
    variant = "sc_high"
  elif cap and tc > cap and sc <= cap:
    variant = "tc_high"
  elif cap and tc > cap and sc > cap:
    variant = "sc_high" if sc >= tc else "tc_high"
  else:
    variant = "balanced"
  sc_advice = [
      Advice("S1", "SparseCore stack: raise --xla_sc_num_serialized_tables_to_optimize_hbm "
             "to serialise table processing (costs parallelism); stack use grows with "
             "feature_width, max_unique_nz_per_row and logical_replica_count."),
      Advice("S1", "SparseCore padding: tables narrower than 8 floats (32 bytes) waste HBM; "
             "widen or combine them."),
      Advice("S1", "SparseCore heap: lower maximum_parallel_iterations so less input is "
             "prefetched into HBM."),
      Advice("S1", "Check that embedding tables are mod-sharded across all chips.",
             RESHARD_FSDP)]
  if variant == "sc_high":
    advice = sc_advice
    summary = (f"SparseCore HBM use ({format_bytes(sc)}) alone exceeds the "
               f"{format_bytes(cap)} available; TensorCore uses {format_bytes(tc)} (S1, SC high).")
  elif variant == "tc_high":
    advice = _s3_advice(rec)
    summary = (f"TensorCore HBM use ({format_bytes(tc)}) alone exceeds the "
               f"{format_bytes(cap)} available (S1, TC high: follow S3).")
  else:
    advice = sc_advice + _s3_advice(rec)
    summary = (f"TensorCore {format_bytes(tc)} + SparseCore {format_bytes(sc)} exceed "
               f"{format_bytes(cap)}; neither alone does (S1, balanced: reduce both).")
  sections = ("S1",) + (("S3",) if variant != "sc_high" else ())
  return Diagnosis(Scenario.S1, variant, sections, summary, tuple(advice),
                   _rungs_of(advice),
                   large, padding)


def _large_allocations(large, padding, padding_advice, rec: record_lib.E1000Record
                       ) -> Diagnosis:
  """S2: single allocations above half the capacity."""
  top = large[0]
  src = f" from {top.op_name or top.shape_text}" + (f" at {top.source}" if top.source else "")
  summary = (f"{len(large)} allocation(s) above half of the {format_bytes(rec.capacity_bytes)}"
             f" capacity; the largest is {format_bytes(top.size_bytes)}{src} (S2).")
  advice = []
  if any("debug_print" in l.suspects for l in large):
    advice.append(Advice("S2", "Remove jax.debug.print / host callbacks from the step: they "
                         "force whole tensors into HBM to ship them to the host."))
  advice.append(Advice("S2", "Check the mesh shape and that sharding is specified and "
                       "propagated for these tensors: a missing annotation replicates a "
                       "huge tensor onto one chip.", RESHARD_FSDP))
  if not any("debug_print" in l.suspects for l in large):
    advice.append(Advice("S2", "Remove debugging artefacts (jax.debug.print) that break "
                         "fusion and materialise whole tensors."))
  advice += padding_advice
  advice.append(Advice("S2", "Use the XLA labels of these allocations to find their JAX "
                       "source (XProf memory viewer, S3.F)."))
  sections = ("S2",) + (("S3.C",) if padding_advice else ())
  return Diagnosis(Scenario.S2, None, sections, summary, tuple(advice),
                   _rungs_of(advice), large, padding)


def _total_too_large(rec: record_lib.E1000Record, large, padding, padding_advice,
                     over: str) -> Diagnosis:
  """S3: no single allocation is to blame; the total is too large."""
  what = {
      record_lib.COMPILE_HBM_EARLY: "the compiler's early check",
      record_lib.RUNTIME_HBM: "the TPU runtime (loading or allocating)",
      record_lib.RUNTIME_GPU: "the GPU runtime",
      record_lib.BUDGET: "hbm_guard's capacity check",
  }.get(rec.kind, "buffer assignment")
  need, have = rec.required_bytes, rec.available_bytes
  if need is not None and have is not None:
    summary = (f"The total of all allocations is too large ({what}): needs {format_bytes(need)}"
               f", has {format_bytes(have)}{over} (S3).")
  else:
    summary = f"The total of all allocations is too large ({what}){over} (S3)."
  advice = padding_advice + _s3_advice(rec) if padding else _s3_advice(rec) + padding_advice
  sections = ("S3",) + (("S3.C",) if padding_advice else ())
  if rec.kind in (record_lib.RUNTIME_HBM, record_lib.RUNTIME_GPU):
    advice.insert(0, Advice("S3", "This failed at run time, not compile time: other live "
                            "buffers (earlier steps, other programs) hold memory too; free "
                            "them or leave headroom."))
  if rec.kind == record_lib.RUNTIME_GPU:
    advice[1:1] = [
        Advice("S3", "JAX preallocates 75% of GPU memory at start "
               "(XLA_PYTHON_CLIENT_MEM_FRACTION=.75): the step can use only that fraction. "
               "Raise it (e.g. XLA_PYTHON_CLIENT_MEM_FRACTION=.95) when this process is the "
               "GPU's only user."),
        Advice("S3", "Another process on the same GPU (a second job, a notebook) also "
               "preallocates: give each its fraction, or set XLA_PYTHON_CLIENT_PREALLOCATE=false "
               "(allocate on demand; fragmentation can then cost memory)."),
        Advice("S3", "XLA_PYTHON_CLIENT_ALLOCATOR=platform frees memory as soon as it is "
               "unused (slow; for debugging what holds memory)."),
    ]
  return Diagnosis(Scenario.S3, None, sections, summary, tuple(advice),
                   _rungs_of(advice), large, padding)
