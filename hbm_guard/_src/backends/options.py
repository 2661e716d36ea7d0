"""GuardOptions: everything `guarded_jit` is told, checked once, as one frozen value.

As jax's `pjit` parses its arguments once into a frozen value, the guard's options are
normalised and validated here, when the step is built, with a message naming the option
and what it accepts. Flags and configs produce the same value (`hbm_guard.flags`);
`dataclasses.replace` changes one and checks again. A `plan=` from a file or a report is
data: it is parsed strictly and must stay within these options (`plan_trust`).
"""

from __future__ import annotations

import dataclasses
import enum
import numbers
import os
import types
from typing import Any, Callable, Mapping

from hbm_guard._src.backends import targets as targets_lib
from hbm_guard._src.files import report as report_lib
from hbm_guard._src.files import untrusted
from hbm_guard._src.plans import argnums as argnums_lib
from hbm_guard._src.plans import ladder as ladder_lib
from hbm_guard._src.plans import layout as layout_lib
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.plans import plan_trust
from hbm_guard._src.plans import rungs as rungs_lib
from hbm_guard._src.record import errors

PLAN_FILE_MAX_BYTES = 16 << 20  # a plan file, or a whole report holding one


RungClass = rungs_lib.RungClass


class Search(enum.StrEnum):
  PROBES = "probes"  # price candidate plans by probes; compile the cheapest predicted to fit
  LADDER = "ladder"  # the next rung, one compile each


def _bad(option: str, accepts: str, value: Any) -> errors.InvalidOptionError:
  return errors.InvalidOptionError(f"{option}={value!r:.100} is not accepted: {accepts}.")


def _plan_count(option: str, value: Any) -> int:
  if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
    raise _bad(option, "a number of plans, 0 or more", value)
  return int(value)


def _strict_bool(option: str, value: Any) -> bool:
  if isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy's bool too
    return bool(value)
  raise _bad(option, "True or False (strings such as 'False' are not booleans)", value)


def _argnums(option: str, value: Any) -> tuple[int, ...]:
  if value is None:
    return ()
  items = (value,) if isinstance(value, numbers.Integral) else value
  if isinstance(items, (str, bytes, Mapping)) or not hasattr(items, "__iter__"):
    raise _bad(option, "an int or a sequence of ints", value)
  items = tuple(items)
  if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in items):
    raise _bad(option, "an int or a sequence of ints", value)
  return tuple(int(i) for i in items)


def _argnames(option: str, value: Any) -> tuple[str, ...]:
  items = argnums_lib.as_tuple(value, str)
  if not all(isinstance(n, str) and n.isidentifier() for n in items):
    raise _bad(option, "a name or a sequence of names", value)
  return items


def _capacity(value: Any) -> int | None:
  if value is None:
    return None
  if isinstance(value, numbers.Integral) and not isinstance(value, bool):
    value = int(value)
  try:
    return targets_lib.parse_capacity(value)
  except errors.UnknownTargetError as e:
    raise _bad("capacity", "bytes (a positive int), a size such as '16GiB', or a device "
               "name such as 'v5e'", value) from e


def _target(value: Any) -> targets_lib.Target | None:
  if value is None or isinstance(value, targets_lib.Target):
    return value
  if not isinstance(value, str):
    raise _bad("target", "a TPU topology name such as 'v5e:2x2'", value)
  return targets_lib.Target.parse(value)


def _enum(option: str, kind: type[enum.StrEnum], value: Any) -> Any:
  try:
    return kind(value)
  except ValueError:
    raise _bad(option, "one of " + ", ".join(repr(m.value) for m in kind), value) from None


def read_plan(value: Any) -> plan_lib.Plan | None:
  """`plan=`: a Plan, its dict, a JSON file of one, or a report (its `final_plan`)."""
  if value is None or isinstance(value, plan_lib.Plan):
    return value
  if isinstance(value, (str, os.PathLike)):
    try:
      value = untrusted.read_json(value, max_bytes=PLAN_FILE_MAX_BYTES)
    except untrusted.UntrustedFileError as e:
      raise errors.InvalidPlanError(f"plan={os.fspath(value)!r}: {e}.") from None
  if report_lib.is_report(value):
    if not value.get("final_plan"):
      raise errors.InvalidPlanError(
          "plan= got a report with no final_plan (its step did not fit): nothing to start from.")
    value = value["final_plan"]
  if not isinstance(value, Mapping):
    raise _bad("plan", "a hbm_guard.Plan, its dict, a JSON file of one, or a report", value)
  return plan_lib.Plan.from_dict(value)


class FlagKind(enum.Enum):
  """Which absl `DEFINE_*` an option's flag is (`hbm_guard.flags` defines them)."""
  BOOL = "bool"
  ENUM = "enum"
  INTEGER = "integer"
  FLOAT = "float"
  STRING = "string"  # parsed by the option, as a keyword given as a string would be


_OWN_DEFAULT = object()  # a flag whose default is its option's


@dataclasses.dataclass(frozen=True)
class Flag:
  """How an option is an absl flag `--hbm_guard_<option>`: its help, its kind, its bounds.
  Its default is the option's own unless `default` says otherwise (`auto_fallback`: a
  binary switches the climb on by flag)."""
  help: str
  kind: FlagKind = FlagKind.STRING
  bounds: Mapping[str, float] = dataclasses.field(default_factory=dict)
  default: Any = _OWN_DEFAULT


def _option(default: Any, help_: str, kind: FlagKind = FlagKind.STRING, *,
            flag_default: Any = _OWN_DEFAULT, **bounds: float) -> Any:
  """A field of GuardOptions that is also a flag: its default and help written once."""
  return dataclasses.field(default=default, metadata={
      "flag": Flag(help_, kind, types.MappingProxyType(bounds), flag_default)})


def flag_default(field: dataclasses.Field) -> Any:
  """The flag's default for an option field: its own, an enum by its value."""
  spec: Flag = field.metadata["flag"]
  value = field.default if spec.default is _OWN_DEFAULT else spec.default
  return value.value if isinstance(value, enum.Enum) else value


@dataclasses.dataclass(frozen=True)
class GuardOptions:
  """The options of one guarded step, parsed: each field holds its parsed type, whatever
  form it was given in (a size string for `capacity`, a topology name for `target`, a
  class name, a ladder file, a plan file...). See `guarded_jit` for what each does. Each
  field's default is written here only: `guarded_jit`'s keywords and `hbm_guard.flags`
  (the fields with a `Flag`) take theirs from it."""
  capacity: int | None = _option(  # given as bytes, '16GiB' or a device name
      None, "Memory per device the step must fit: bytes, '16GiB', or a device name ('v5e').")
  target: targets_lib.Target | None = _option(  # given as a topology name
      None, "Compile for this TPU topology (e.g. v5e:2x2) with libtpu.")
  max_class: RungClass = _option(  # given as its name
      RungClass.EXACT, "Highest rung class allowed: exact (same math), numerics (same math, "
      "other rounding, e.g. microbatching), behaviour (may change training, e.g. bf16).",
      FlagKind.ENUM)
  max_attempts: int = _option(8, "Most compiles per input signature.", FlagKind.INTEGER,
                              lower_bound=1)
  ladder: tuple[rungs_lib.Rung, ...] = _option(  # given as a path or rungs; None: default
      None, "A ladder JSON file replacing configs/ladder.json.")
  state_argnums: tuple[int, ...] = ()  # given as an int or ints
  report_dir: str | os.PathLike | None = _option(
      None, "Where the post-mortem JSON report is written.")
  auto_fallback: bool = _option(
      True, "On a compile-time out-of-memory (E1000), recompile down the fallback ladder. "
      "Off: the error is diagnosed and reported, then raised as the compiler raised it.",
      FlagKind.BOOL, flag_default=False)
  offload_filter: Callable[[Any], bool] = layout_lib.default_offload_filter
  plan_cache: str | os.PathLike | bool | None = _option(
      None, "Directory remembering the plan that fit each program and input signature, so a "
      "restart compiles once; 'off' disables. Default: $HBM_GUARD_PLAN_CACHE, else "
      "~/.cache/hbm_guard/plans.")
  plan: plan_lib.Plan | None = None  # given as a Plan, its dict, a file or a report
  search: Search = Search.PROBES  # given as its name
  headroom: float = _option(
      rungs_lib.HEADROOM, "Fraction of the capacity a predicted figure must stay under; the "
      "compiler's exact figure is held against the capacity itself.", FlagKind.FLOAT,
      lower_bound=0.5, upper_bound=1.0)
  plan_cache_retry_exhausted: bool = _option(
      False, "Climb again even when the plan cache remembers that nothing fit this program "
      "(after changing something the cache cannot see).", FlagKind.BOOL)
  max_fit_seconds: float | None = _option(
      None, "Time budget of one fit, in seconds: no compile or probe starts, or is waited "
      "for, that the budget cannot pay for (by what earlier ones cost); the fit then stops "
      "and says so.", FlagKind.FLOAT, lower_bound=1.0)
  progress: bool = _option(
      True, "Once a step does not fit, print a line to stderr for each compile and probe.",
      FlagKind.BOOL)
  auto_plan_aware: bool = _option(
      True, "Give an unmodified step the microbatch and remat rungs: its jax.value_and_grad / "
      "jax.grad is split into microbatches where the loss is a function of batch sums "
      "(exact), and its repeated layers checkpointed. False: only steps built with the "
      "helpers.", FlagKind.BOOL)
  timed_rivals: int = _option(
      6, "Where the step runs on this host's devices: how many plans that fit near the "
      "search's choice are timed against it on the first steps (the fastest is kept and "
      "remembered); 0: the search's choice, priced by flops.", FlagKind.INTEGER, lower_bound=0)
  estimated_rivals: int = _option(
      0, "For a target (--hbm_guard_target): how many plans that may fit near the search's "
      "choice are compiled, the one the compiled programs estimate fastest kept (each costs a "
      "compile); 0: the search's choice, priced by flops.", FlagKind.INTEGER, lower_bound=0)
  memory_breakdown: bool = _option(
      True, "Each compile and probe dumps its program, and the report says where its memory "
      "goes (by kind, by layer, by buffer and source line, each part with the rung that "
      "removes it).", FlagKind.BOOL)
  jit_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
    put("capacity", _capacity(self.capacity))
    put("target", _target(self.target))
    put("max_class", _enum("max_class", RungClass, self.max_class))
    put("search", _enum("search", Search, self.search))
    if (not isinstance(self.max_attempts, numbers.Integral) or isinstance(self.max_attempts, bool)
        or self.max_attempts < 1):
      raise _bad("max_attempts", "a positive int", self.max_attempts)
    put("max_attempts", int(self.max_attempts))
    put("ladder", ladder_lib.load_ladder(self.ladder))
    put("state_argnums", _argnums("state_argnums", self.state_argnums))
    put("auto_fallback", _strict_bool("auto_fallback", self.auto_fallback))
    put("plan_cache_retry_exhausted",
        _strict_bool("plan_cache_retry_exhausted", self.plan_cache_retry_exhausted))
    if not callable(self.offload_filter):
      raise _bad("offload_filter", "a function of a key path returning a bool",
                 self.offload_filter)
    if self.report_dir is not None and not isinstance(self.report_dir, (str, os.PathLike)):
      raise _bad("report_dir", "a directory path", self.report_dir)
    if not (self.plan_cache is None or isinstance(self.plan_cache, (bool, str, os.PathLike))):
      raise _bad("plan_cache", "a directory, True, False or 'off'", self.plan_cache)
    if (not isinstance(self.headroom, numbers.Real) or isinstance(self.headroom, bool)
        or not 0.5 <= float(self.headroom) <= 1.0):
      raise _bad("headroom", "a fraction of the capacity from 0.5 to 1.0", self.headroom)
    put("headroom", float(self.headroom))
    if self.max_fit_seconds is not None:
      if (not isinstance(self.max_fit_seconds, numbers.Real)
          or isinstance(self.max_fit_seconds, bool) or not self.max_fit_seconds > 0):
        raise _bad("max_fit_seconds", "None or a positive number of seconds",
                   self.max_fit_seconds)
      put("max_fit_seconds", float(self.max_fit_seconds))
    for name in ("timed_rivals", "estimated_rivals"):
      put(name, _plan_count(name, getattr(self, name)))
    put("progress", _strict_bool("progress", self.progress))
    put("auto_plan_aware", _strict_bool("auto_plan_aware", self.auto_plan_aware))
    put("memory_breakdown", _strict_bool("memory_breakdown", self.memory_breakdown))
    put("jit_kwargs", types.MappingProxyType(self._normalised_jit_kwargs()))
    if not self.state_argnums:  # what the caller donates to jax.jit, it has given up:
      put("state_argnums", self.user_donate)  # the step's state (a drop-in's train state)
    plan = read_plan(self.plan)
    if plan is not None:
      plan = plan_trust.check(plan, rungs=self.ladder, max_class=self.max_class,
                              donatable=plan_trust.donatable(self.state_argnums,
                                                             self.user_donate, None))
    put("plan", plan)

  def _normalised_jit_kwargs(self) -> dict[str, Any]:
    if not isinstance(self.jit_kwargs, Mapping):
      raise _bad("jit_kwargs", "keyword arguments of jax.jit", self.jit_kwargs)
    kw = dict(self.jit_kwargs)
    for key in ("static_argnums", "donate_argnums"):
      if kw.get(key) is not None:
        kw[key] = _argnums(key, kw[key])
    for key in ("static_argnames", "donate_argnames"):
      if kw.get(key) is not None:
        kw[key] = _argnames(key, kw[key])
    options = kw.get("compiler_options")
    if options is not None and not (isinstance(options, Mapping)
                                    and all(isinstance(k, str) for k in options)):
      raise _bad("compiler_options", "a dict of XLA option names to values", options)
    return kw

  # -- derived --------------------------------------------------------------------------

  @property
  def budget(self) -> int | None:
    """The bytes a device has for the step: capacity=, else the target's HBM."""
    if self.capacity is not None:
      return self.capacity
    return self.target.hbm_bytes if self.target is not None else None

  @property
  def user_donate(self) -> tuple[int, ...]:
    return tuple(self.jit_kwargs.get("donate_argnums") or ())

  @property
  def static_argnums(self) -> tuple[int, ...]:
    return tuple(self.jit_kwargs.get("static_argnums") or ())

  @property
  def static_argnames(self) -> tuple[str, ...]:
    return tuple(self.jit_kwargs.get("static_argnames") or ())

  def jax_jit_kwargs(self) -> dict[str, Any]:
    """What goes to `jax.jit` whatever the plan (donation is merged per plan)."""
    return {k: v for k, v in self.jit_kwargs.items() if k != "donate_argnums"}

  def start(self, current: plan_lib.Plan, *, nargs: int) -> plan_lib.Plan:
    """Where a new signature's climb starts: `current` (the latest fit's plan; the pinned
    `plan=` checked again now that negative argnums resolve), or plain jit when fallback
    is off."""
    if not (self.auto_fallback or self.plan is not None):
      return plan_lib.Plan()
    if self.plan is not None and current is self.plan:
      return self.trusted(current, nargs=nargs, source="plan=")
    return current

  def trusted(self, plan: plan_lib.Plan, *, nargs: int | None, source: str) -> plan_lib.Plan:
    """`plan` if these options allow all of it, else an UntrustedPlanError."""
    return plan_trust.check(plan, rungs=self.ladder, max_class=self.max_class,
                            donatable=plan_trust.donatable(self.state_argnums,
                                                           self.user_donate, nargs),
                            source=source)

  def as_kwargs(self) -> dict[str, Any]:
    """guarded_jit keyword arguments that rebuild these options."""
    kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
          if f.name != "jit_kwargs"}
    kw.update(self.jit_kwargs)
    return kw


def make(**kwargs) -> GuardOptions:
  """GuardOptions from guarded_jit's keyword arguments (jax.jit's go to `jit_kwargs`)."""
  names = {f.name for f in dataclasses.fields(GuardOptions)} - {"jit_kwargs"}
  own = {k: v for k, v in kwargs.items() if k in names}
  return GuardOptions(**own, jit_kwargs={k: v for k, v in kwargs.items() if k not in names})
