"""The search's tuned constants, each with the measurement it came from (BENCHMARKS.md,
and docs/planner.md for the runs named here: "368M" is bench_scale's LM on v5e:1x1)."""

from hbm_guard._src.plans import rungs as rungs_lib

HEADROOM = rungs_lib.HEADROOM  # aim below the capacity: estimates are estimates
# Host link against compute on a TPU: ~25 GB/s against ~100 TFLOP/s.
FLOPS_PER_HOST_BYTE = 4000.0
# Per extra microbatch: a sequential loop that reads the weights again.
MICROBATCH_OVERHEAD = 0.01
MAX_MICROBATCHES = 256
# Real need / probe figure before any compile measured it: libtpu's early figure ran
# 0.67-0.95 of the real need (bench_models, v5e).
PROBE_SCALE = 1.3
# The same where the failed compile was slow (a large program): 1.125 at 937M on v5e:2x2
# (9.11 -> 10.25 GiB), 1.15-1.20 at 368M; 1.3 there ruled out data parallel at 937M.
LARGE_PROGRAM_PROBE_SCALE = 1.15
# A probe costing this share of a compile, or more, is dear (368M: probes of 95-336 s
# against compiles of 44-110 s).
DEAR_PROBE_RATIO = 0.5
DEAR_PROBE_MIN_SECONDS = 10.0  # below this a probe is cheap, whatever a compile costs
DEAR_COMPILE_SECONDS = 10.0  # a failed compile this slow: its probes will be dear too
# XLA's remat flags and donation cut a failed compile's figure to no less than 0.67 of it
# where measured (bench_models, v5e; 0.74-0.78 at 368M): half is assumed.
FLAGS_FLOOR = 0.5
# A failed unsplit compile bounds a split plan loosely: the README job's microbatch(8),
# bounded at 113 MiB, fits in 96 (1.18x); 368M's microbatch(4), bounded 1.42x over, needs ~33
# GiB of 15.75. A bound is believed only this far over the capacity.
BOUND_SLACK = 1.3
# A family's top counts that say nothing of fewer, searched below before the family is
# given up (a one-example microbatch: optax's integer-label cross-entropy, a padded ViT).
MAX_PASSED_OVER = 2
# Once a family's most microbatches is compiling (taken to fit), a fewer count is probed
# only where it is this much cheaper: a probe beside that compile slows it (a 420M LM's
# remat at 1 probed beside remat at 2: 39 s where it takes 30-34 alone), and where it fits
# it costs a compile more, for a plan 1-2% faster by the model.
BESIDE_GAIN = 0.03
