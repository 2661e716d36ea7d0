"""Plans that fit, remembered across restarts: a preempted job does not climb again.

An entry is keyed by everything that decides the answer: the step's program under the
default plan, the input signature, where it must fit (target or device kind, capacity), the
ladder and allowed class, and the jax/jaxlib/libtpu versions. It holds the plan that fit
(or that nothing did) and the attempts that led there. Files are written atomically, so
concurrent writers are safe; a damaged entry is a miss, never an error.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
from typing import Any, Mapping

from hbm_guard._src import plan as plan_lib
from hbm_guard._src import report as report_lib

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


def digest(parts: Mapping[str, Any]) -> str:
  text = json.dumps(parts, sort_keys=True, default=repr)
  return hashlib.sha256(text.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class Entry:
  status: str  # "fits" | "exhausted"
  plan: plan_lib.Plan  # the plan that fit, or the last one tried
  attempts: tuple[dict[str, Any], ...] = ()  # as in the report
  parts: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # what the key covers

  def to_dict(self) -> dict[str, Any]:
    return {"schema": SCHEMA, "status": self.status, "plan": self.plan.to_dict(),
            "attempts": list(self.attempts), "parts": dict(self.parts)}

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "Entry":
    if d.get("schema") != SCHEMA or d.get("status") not in ("fits", "exhausted"):
      raise ValueError("not a plan cache entry")
    return cls(status=d["status"], plan=plan_lib.Plan.from_dict(d["plan"]),
               attempts=tuple(d.get("attempts") or ()), parts=dict(d.get("parts") or {}))


class PlanCache:
  """A directory of entries, one JSON file per key."""

  def __init__(self, directory: str):
    self.directory = os.path.abspath(directory)

  def path(self, key: str) -> str:
    return os.path.join(self.directory, key + ".json")

  def get(self, key: str) -> Entry | None:
    try:
      with open(self.path(key), encoding="utf-8") as f:
        return Entry.from_dict(json.load(f))
    except (OSError, ValueError, TypeError, KeyError):
      return None

  def put(self, key: str, entry: Entry) -> bool:
    try:
      report_lib.write_atomic(self.path(key), entry.to_dict())
    except (OSError, TypeError, ValueError) as e:
      from absl import logging  # pylint: disable=g-import-not-at-top
      logging.warning("hbm_guard: could not write the plan cache %s: %s", self.path(key), e)
      return False
    return True
