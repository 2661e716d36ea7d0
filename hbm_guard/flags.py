"""absl flags that switch hbm_guard on for a training binary.

Defined here, not in the core, so `import hbm_guard` registers no flags. A binary does

    from hbm_guard import flags as hbm_flags
    step = hbm_guard.guarded_jit(train_step, state_argnums=0, **hbm_flags.guard_options())

and is run with `--hbm_guard_auto_fallback --hbm_guard_target=v5e:2x2 ...`.
"""

from absl import flags

AUTO_FALLBACK = flags.DEFINE_bool(
    "hbm_guard_auto_fallback", False,
    "On a compile-time out-of-memory (E1000), recompile down the fallback ladder. Off: the "
    "error is diagnosed and reported, then raised as the compiler raised it.")
MAX_CLASS = flags.DEFINE_enum(
    "hbm_guard_max_class", "exact", ["exact", "numerics", "behaviour"],
    "Highest rung class allowed: exact (same math), numerics (same math, other rounding, "
    "e.g. microbatching), behaviour (may change training, e.g. bf16).")
MAX_ATTEMPTS = flags.DEFINE_integer(
    "hbm_guard_max_attempts", 8, "Most compiles per input signature.", lower_bound=1)
TARGET = flags.DEFINE_string(
    "hbm_guard_target", None, "Compile for this TPU topology (e.g. v5e:2x2) with libtpu.")
CAPACITY = flags.DEFINE_string(
    "hbm_guard_capacity", None,
    "Memory per device the step must fit: bytes, '16GiB', or a device name ('v5e').")
REPORT_DIR = flags.DEFINE_string(
    "hbm_guard_report_dir", None, "Where the post-mortem JSON report is written.")
LADDER = flags.DEFINE_string(
    "hbm_guard_ladder", None, "A ladder JSON file replacing configs/ladder.json.")

PLAN_CACHE = flags.DEFINE_string(
    "hbm_guard_plan_cache", None,
    "Directory remembering the plan that fit each program and input signature, so a "
    "restart compiles once; 'off' disables. Default: $HBM_GUARD_PLAN_CACHE, else "
    "~/.cache/hbm_guard/plans.")
RETRY_EXHAUSTED = flags.DEFINE_bool(
    "hbm_guard_plan_cache_retry_exhausted", False,
    "Climb again even when the plan cache remembers that nothing fit this program (after "
    "changing something the cache cannot see).")
HEADROOM = flags.DEFINE_float(
    "hbm_guard_headroom", 0.95,
    "Fraction of the capacity a predicted figure must stay under; the compiler's exact "
    "figure is held against the capacity itself.", lower_bound=0.5, upper_bound=1.0)

MAX_FIT_SECONDS = flags.DEFINE_float(
    "hbm_guard_max_fit_seconds", None,
    "Time budget of one fit, in seconds: no compile or probe starts that the budget cannot "
    "pay for (by what earlier ones cost); the fit then stops and says so.", lower_bound=1.0)
PROGRESS = flags.DEFINE_bool(
    "hbm_guard_progress", True,
    "Once a step does not fit, print a line to stderr for each compile and probe.")

TIMED_RIVALS = flags.DEFINE_integer(
    "hbm_guard_timed_rivals", 6,
    "Where the step runs on this host's devices: how many plans that fit near the search's "
    "choice are timed against it on the first steps (the fastest is kept and remembered); "
    "0: the search's choice, priced by flops.", lower_bound=0)

ESTIMATED_RIVALS = flags.DEFINE_integer(
    "hbm_guard_estimated_rivals", 0,
    "For a target (--hbm_guard_target): how many plans that may fit near the search's choice "
    "are compiled, the one the compiled programs estimate fastest kept (each costs a "
    "compile); 0: the search's choice, priced by flops.", lower_bound=0)

AUTO_PLAN_AWARE = flags.DEFINE_bool(
    "hbm_guard_auto_plan_aware", True,
    "Give an unmodified step the microbatch and remat rungs: its jax.value_and_grad / "
    "jax.grad is split into microbatches where the loss is a function of batch sums (exact), "
    "and its repeated layers checkpointed. False: only steps built with the helpers.")

MEMORY_BREAKDOWN = flags.DEFINE_bool(
    "hbm_guard_memory_breakdown", True,
    "Each compile and probe dumps its program, and the report says where its memory goes "
    "(by kind, by layer, by buffer and source line, each part with the rung that removes "
    "it).")

_HOLDERS = {"auto_fallback": AUTO_FALLBACK, "max_class": MAX_CLASS, "max_attempts": MAX_ATTEMPTS,
            "target": TARGET, "capacity": CAPACITY, "report_dir": REPORT_DIR, "ladder": LADDER,
            "plan_cache": PLAN_CACHE, "plan_cache_retry_exhausted": RETRY_EXHAUSTED,
            "headroom": HEADROOM, "max_fit_seconds": MAX_FIT_SECONDS, "progress": PROGRESS,
            "auto_plan_aware": AUTO_PLAN_AWARE, "timed_rivals": TIMED_RIVALS,
            "estimated_rivals": ESTIMATED_RIVALS, "memory_breakdown": MEMORY_BREAKDOWN}


def guard_options(defaults: dict | None = None) -> dict:
  """guarded_jit keyword arguments from the parsed flags.

  `defaults` (e.g. a job's config) fill in what was not given on the command line: a flag
  set explicitly wins, then the default, then the flag's own default.
  """
  defaults = defaults or {}
  return {key: (holder.value if holder.present or key not in defaults else defaults[key])
          for key, holder in _HOLDERS.items()}


def options(defaults: dict | None = None, **overrides):
  """The parsed flags as one checked `GuardOptions` (`guarded_jit(step, options=...)`);
  `overrides` (state_argnums=0, jax.jit's options) are the binary's own."""
  from hbm_guard._src import options as options_lib  # pylint: disable=g-import-not-at-top
  return options_lib.make(**{**guard_options(defaults), **overrides})
