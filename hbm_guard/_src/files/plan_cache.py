"""Plans that fit, remembered across restarts: a preempted job does not climb again.

An entry is keyed by everything that decides the answer: the step's program under the
default plan, the input signature, where it must fit (target or device kind, capacity), the
ladder and allowed class, and the jax/jaxlib/libtpu versions. It holds the plan that fit
(or that nothing did) and the attempts that led there. Files are written atomically, so
concurrent writers are safe.

Entries are untrusted (a cache may sit in a shared checkpoint directory): one is read only
if it is a small regular file, its `parts` must hash to its key, and its plan must pass
the guard's own checks (`GuardOptions.trusted`). Anything else is a miss, logged, never an
error. "Nothing fits" is advice with an age, not a wall (`EXHAUSTED_MAX_AGE_S`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import re
import time
from typing import Any, Callable, Mapping

from absl import logging

from hbm_guard._src.files import report as report_lib
from hbm_guard._src.files import untrusted
from hbm_guard._src.plans import plan as plan_lib

ENV = "HBM_GUARD_PLAN_CACHE"
_OFF = ("", "0", "off", "false", "no", "none")
SCHEMA = "hbm_guard.plan_cache/1"


def default_dir() -> str:
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "hbm_guard", "plans")


def resolve(setting: str | os.PathLike | bool | None) -> "PlanCache | None":
  """`plan_cache=`: a directory, True/None (the env var, else the user cache), False: off."""
  if setting is False:
    return None
  if setting is None or setting is True:
    env = os.environ.get(ENV)
    if env is not None:
      return None if env.strip().lower() in _OFF else PlanCache(env)
    return PlanCache(default_dir())
  if isinstance(setting, str) and setting.strip().lower() in _OFF:
    return None
  return PlanCache(os.fspath(setting))


def versions() -> dict[str, str | None]:
  out = {}
  for name in ("jax", "jaxlib", "libtpu", "hbm_guard"):
    try:
      out[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      out[name] = None
  return out


# What decides a compile outside the program text, so it is in every key: a user who sets
# an XLA flag because nothing fit gets a fresh climb, and a plan is never reused under
# flags it was not checked with.
ENV_FLAGS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
JAX_CONFIG = ("jax_default_matmul_precision", "jax_compiler_enable_remat_pass",
              "jax_optimization_level", "jax_memory_fitting_level",
              "jax_disable_most_optimizations", "jax_use_shardy_partitioner",
              "jax_enable_x64", "jax_remat3", "jax_numpy_dtype_promotion")


def compile_environment() -> dict[str, Any]:
  """The compiler flags in the environment and the jax config values that change
  lowering or compiling (those this jax has), as JSON-ready values."""
  import jax  # pylint: disable=g-import-not-at-top
  config = {}
  for name in JAX_CONFIG:
    try:
      value = getattr(jax.config, name)
    except AttributeError:
      continue
    config[name] = value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
  return {"env": {name: os.environ.get(name) for name in ENV_FLAGS}, "jax_config": config}


def digest(parts: Mapping[str, Any]) -> str:
  text = json.dumps(parts, sort_keys=True, default=repr)
  return hashlib.sha256(text.encode()).hexdigest()


MAX_ENTRY_BYTES = 4 << 20  # attempts with their records; far more than any real entry
EXHAUSTED_MAX_AGE_S = 7 * 24 * 3600.0  # "nothing fits" older than this is not believed
Status = report_lib.Status
_STATUSES = (Status.FITS, Status.EXHAUSTED)


@dataclasses.dataclass(frozen=True)
class Entry:
  status: report_lib.Status  # FITS or EXHAUSTED
  plan: plan_lib.Plan  # the plan that fit, or the last one tried
  attempts: tuple[dict[str, Any], ...] = ()  # as in the report
  parts: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # what the key covers
  written_at: float | None = None  # seconds since the epoch

  def to_dict(self) -> dict[str, Any]:
    return {"schema": SCHEMA, "status": self.status, "plan": self.plan.to_dict(),
            "attempts": list(self.attempts), "parts": dict(self.parts),
            "written_at": self.written_at if self.written_at is not None else time.time()}

  @classmethod
  def from_dict(cls, d: Any) -> "Entry":
    """An entry from its JSON form; anything malformed is a ValueError."""
    if not isinstance(d, Mapping) or d.get("schema") != SCHEMA:
      raise ValueError("not a plan cache entry")
    if d.get("status") not in _STATUSES:
      raise ValueError(f"unknown status {d.get('status')!r:.40}")
    attempts, parts, written = d.get("attempts") or [], d.get("parts") or {}, d.get("written_at")
    if not isinstance(attempts, list) or not all(isinstance(a, Mapping) for a in attempts):
      raise ValueError("'attempts' is not a list of objects")
    if not isinstance(parts, Mapping):
      raise ValueError("'parts' is not an object")
    if written is not None and (isinstance(written, bool)
                                or not isinstance(written, (int, float))):
      raise ValueError("'written_at' is not a time")
    return cls(status=d["status"], plan=plan_lib.Plan.from_dict(d["plan"]),
               attempts=tuple(dict(a) for a in attempts), parts=dict(parts),
               written_at=None if written is None else float(written))

  def age_seconds(self, now: float | None = None) -> float | None:
    if self.written_at is None:
      return None
    return (time.time() if now is None else now) - self.written_at


class PlanCache:
  """A directory of entries, one JSON file per key. Entries are untrusted: another job,
  or another person, may have written any of them."""

  def __init__(self, directory: str):
    self.directory = os.path.abspath(directory)

  def path(self, key: str) -> str:
    return os.path.join(self.directory, key + ".json")

  def read(self, key: str) -> Entry:
    """The entry stored under `key`, as it claims to be; a ValueError saying why not."""
    data = untrusted.read_json(self.path(key), max_bytes=MAX_ENTRY_BYTES)
    try:
      entry = Entry.from_dict(data)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
      raise ValueError(f"not a valid entry: {e}") from None
    if digest(entry.parts) != key:
      raise ValueError("its 'parts' do not hash to the key it is stored under")
    return entry

  def get(self, key: str, check: Callable[[Entry], Entry] | None = None) -> Entry | None:
    """The entry under `key`, passed through `check` (which raises ValueError to refuse
    it); a missing, damaged or refused entry is a miss, logged with why. Never raises."""
    if not os.path.lexists(self.path(key)):
      return None
    try:
      entry = self.read(key)
      return check(entry) if check is not None else entry
    except Exception as e:  # pylint: disable=broad-except  (an entry must never break a job)
      logging.warning("hbm_guard: ignoring the plan cache entry %s: %s", self.path(key),
                      str(e)[:300])
      return None

  def put(self, key: str, entry: Entry) -> bool:
    try:
      report_lib.write_atomic(self.path(key), entry.to_dict())
    except (OSError, TypeError, ValueError) as e:
      logging.warning("hbm_guard: could not write the plan cache %s: %s", self.path(key), e)
      return False
    return True

  def keys(self) -> list[str]:
    """The keys of the entries in the directory (file names; nothing is read)."""
    try:
      names = os.listdir(self.directory)
    except OSError:
      return []
    return sorted(n[:-5] for n in names if n.endswith(".json") and _KEY.fullmatch(n[:-5]))

  def remove(self, key: str) -> bool:
    try:
      os.unlink(self.path(key))
    except OSError:
      return False
    return True


_KEY = re.compile(r"[0-9a-f]{64}")
