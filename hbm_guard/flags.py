"""absl flags that switch hbm_guard on for a training binary.

Defined here, not in the core, so `import hbm_guard` registers no flags. A binary does

    from hbm_guard import flags as hbm_flags
    step = hbm_guard.guarded_jit(train_step, state_argnums=0, **hbm_flags.guard_options())

and is run with `--hbm_guard_auto_fallback --hbm_guard_target=v5e:2x2 ...`.
"""

import dataclasses

from absl import flags

from hbm_guard._src.backends import options as _options


def _define(field) -> flags.FlagHolder:
  """`--hbm_guard_<field>` from a GuardOptions field: its default, help and bounds are the
  option's own (options.py), written once."""
  spec: _options.Flag = field.metadata["flag"]
  name, default = f"hbm_guard_{field.name}", _options.flag_default(field)
  kind = _options.FlagKind
  if spec.kind is kind.ENUM:
    return flags.DEFINE_enum(name, default, [m.value for m in type(field.default)], spec.help)
  define = {kind.BOOL: flags.DEFINE_bool, kind.INTEGER: flags.DEFINE_integer,
            kind.FLOAT: flags.DEFINE_float, kind.STRING: flags.DEFINE_string}[spec.kind]
  return define(name, default, spec.help, **spec.bounds)


_HOLDERS = {f.name: _define(f) for f in dataclasses.fields(_options.GuardOptions)
            if "flag" in f.metadata}

AUTO_FALLBACK = _HOLDERS["auto_fallback"]
MAX_CLASS = _HOLDERS["max_class"]
MAX_ATTEMPTS = _HOLDERS["max_attempts"]
TARGET = _HOLDERS["target"]
CAPACITY = _HOLDERS["capacity"]
REPORT_DIR = _HOLDERS["report_dir"]
LADDER = _HOLDERS["ladder"]
PLAN_CACHE = _HOLDERS["plan_cache"]
RETRY_EXHAUSTED = _HOLDERS["plan_cache_retry_exhausted"]
HEADROOM = _HOLDERS["headroom"]
MAX_FIT_SECONDS = _HOLDERS["max_fit_seconds"]
PROGRESS = _HOLDERS["progress"]
TIMED_RIVALS = _HOLDERS["timed_rivals"]
ESTIMATED_RIVALS = _HOLDERS["estimated_rivals"]
AUTO_PLAN_AWARE = _HOLDERS["auto_plan_aware"]
MEMORY_BREAKDOWN = _HOLDERS["memory_breakdown"]


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
  return _options.make(**{**guard_options(defaults), **overrides})
