"""Where a step must fit: device generations, their HBM, and TPU topologies to compile for.

A target such as "v5e:2x2" is compiled for ahead of time with libtpu on the local machine
(`jax.experimental.topologies`), so a CPU-only host sees the TPU compiler's real E1000.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import importlib.resources
import json
import re
import threading
from typing import Any

import jax

from hbm_guard._src.backends import step_time
from hbm_guard._src.plans import thread_context
from hbm_guard._src.record import errors
from hbm_guard._src.record import record as record_lib


@functools.cache
def device_table() -> dict[str, dict[str, Any]]:
  text = importlib.resources.files("hbm_guard.configs").joinpath("devices.json").read_text()
  return json.loads(text)["devices"]


def hbm_bytes(name: str) -> int:
  """HBM per device for a generation name ("v5e") or a JAX device_kind ("TPU v5 lite")."""
  table = device_table()
  key = name.lower().split(":")[0]
  if key in table:
    return int(table[key]["hbm_gib"] * 2**30)
  for entry in table.values():
    if name in entry["kinds"]:
      return int(entry["hbm_gib"] * 2**30)
  raise errors.UnknownTargetError(
      f"Unknown device {name!r}; known: {', '.join(sorted(table))}.")


def parse_capacity(capacity: int | str | None) -> int | None:
  """16 * 2**30, "16GiB", "16G" or a device name ("v5e") -> bytes (a positive int)."""
  if capacity is None:
    return None
  if isinstance(capacity, bool) or not isinstance(capacity, (int, str)):
    raise errors.UnknownTargetError(
        f"capacity={capacity!r}: give bytes (an int), a size such as '16GiB', or a device "
        "name such as 'v5e'.")
  if isinstance(capacity, int):
    size = capacity
  else:
    size = record_lib.parse_size(capacity)
    if size is None:
      return hbm_bytes(capacity)
  if size <= 0:
    raise errors.UnknownTargetError(f"capacity={capacity!r} must be positive.")
  return size


@dataclasses.dataclass(frozen=True)
class Target:
  """A TPU topology to compile for: "v5e:2x2", "v5p:2x2x1", "v6e:1x1"."""
  name: str
  generation: str
  chips: tuple[int, ...]

  @property
  def hbm_bytes(self) -> int:
    return hbm_bytes(self.generation)

  @property
  def speed(self) -> step_time.DeviceSpeed | None:
    """The chip's peaks and clock, for estimating a step's time from its program."""
    return step_time.DeviceSpeed.from_entry(device_table().get(self.generation.lower()) or {})

  @classmethod
  def parse(cls, name: str) -> "Target":
    m = re.fullmatch(r"\s*(\w+):(\d+(?:x\d+)*)\s*", name)
    if not m or m.group(1).lower() not in device_table():
      raise errors.UnknownTargetError(
          f"Target {name!r} is not GENERATION:TOPOLOGY such as 'v5e:2x2' or 'v5p:2x2x1'.")
    chips = tuple(int(x) for x in m.group(2).split("x"))
    return cls(name=name.strip(), generation=m.group(1).lower(), chips=chips)

  def devices(self) -> list[Any]:
    return list(_topology(self.name, self.chips))


@functools.cache
def _topology(name: str, chips: tuple[int, ...]):
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  bounds = tuple(min(c, 2) for c in (chips + (1, 1, 1))[:2]) + (1,)
  try:
    topo = topologies.get_topology_desc(
        platform="tpu", topology_name=name, chip_config_name="default",
        chips_per_host_bounds=bounds, num_slices=1)
  except Exception as e:  # libtpu missing or busy, or a topology it does not know
    text = str(e)
    if "lockfile" in text or "already in use" in text:
      raise errors.TpuCompilerBusyError(
          f"Cannot compile for {name!r}: another process holds libtpu ({text.strip()}). "
          "Set ALLOW_MULTIPLE_LIBTPU_LOAD=1 in each process that loads it, or wait for the "
          "other process to finish.") from e
    import importlib.util  # pylint: disable=g-import-not-at-top
    if importlib.util.find_spec("libtpu") is None:
      hint = "Install the 'tpu' extra (pip install 'hbm_guard[tpu]') for libtpu."
    else:
      hint = "Check the topology name (e.g. 'v5e:2x2', 'v5p:2x2x1', 'v6e:1x1')."
    raise errors.UnknownTargetError(f"Cannot compile for {name!r} here: {text}. {hint}") from e
  return tuple(topo.devices)


def quiet_libtpu_on_cpu_host() -> None:
  """Keeps libtpu's start-up warnings (TPU_ACCELERATOR_TYPE, worker hostnames) off a host
  with no TPU, where it is loaded only to compile for topologies. Call before jax starts
  its backends; a TPU host, or settings the user made, are left alone."""
  import glob  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
    return
  for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                     ("TPU_ACCELERATOR_TYPE", "v5litepod-4")):
    os.environ.setdefault(key, value)


def compiler_counts_arguments(target: Target) -> bool:
  """Whether libtpu's verdict at `xla_tpu_max_hbm_size_mib` counts the arguments.

  libtpu 0.0.50 does ("Used" = program + arguments), so the guard's own total check would
  only disagree with it by its accounting; older releases were seen to check program
  memory only. Asked once per process (64 MiB of arguments against a 32 MiB limit), and
  ahead where `ask_ahead` was called.
  """
  future, in_thread = _asked(target, in_thread=False)
  try:
    return future.result()
  except BaseException as e:  # pylint: disable=broad-except
    _forget(target, future)  # a failed asking is asked again next time
    if not in_thread or not isinstance(e, Exception):
      raise
    return _asked(target, in_thread=False)[0].result()  # failed in its thread: ask here


def ask_ahead(target: Target) -> None:
  """Starts `compiler_counts_arguments` in a daemon thread: a tiny compile (0.25 s), else
  on the first fit's path; the step's own trace and lowering hide it."""
  _asked(target, in_thread=True)


# target -> (its answer, whether asked in a thread)
_answers: dict[Target, tuple[concurrent.futures.Future, bool]] = {}
_answers_lock = threading.Lock()


def _asked(target: Target, in_thread: bool) -> tuple[concurrent.futures.Future, bool]:
  """The answer for `target`, asked once, and whether it was asked in a thread."""
  ask = functools.partial(_counts_arguments, target)
  with _answers_lock:
    if target in _answers:
      return _answers[target]
    future = (thread_context.submit(ask, "hbm_guard-ask") if in_thread
              else concurrent.futures.Future())
    _answers[target] = future, in_thread
  if not in_thread:
    try:
      future.set_result(ask())
    except BaseException as e:  # pylint: disable=broad-except  (raised to whoever reads it)
      future.set_exception(e)
  return future, in_thread


def _forget(target: Target, future: concurrent.futures.Future) -> None:
  with _answers_lock:
    entry = _answers.get(target)
    if entry is not None and entry[0] is future:
      del _answers[target]


def _counts_arguments(target: Target) -> bool:
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(np.array(target.devices()[:1]), ("x",))
  arg = jax.ShapeDtypeStruct((16 << 20,), jax.numpy.float32,
                             sharding=NamedSharding(mesh, PartitionSpec()))
  try:
    with jax.set_mesh(mesh):  # not the user's jax.set_mesh mesh, if any: the target's
      jax.jit(lambda x: x[:8] * 2).lower(arg).compile({"xla_tpu_max_hbm_size_mib": 32})
  except jax.errors.JaxRuntimeError as e:
    return record_lib.parse(e) is not None
  return False


@functools.cache
def accepts_options(target: Target, options: tuple[tuple[str, Any], ...]) -> bool:
  """Whether this jax and libtpu take these compile options (jax 0.10's compile rejects
  `optimization_level` with a TypeError). Asked once per process with a tiny program."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=g-import-not-at-top
  mesh = jax.sharding.Mesh(np.array(target.devices()[:1]), ("x",))
  arg = jax.ShapeDtypeStruct((8,), jax.numpy.float32, sharding=NamedSharding(mesh, PartitionSpec()))
  try:
    with jax.set_mesh(mesh):
      jax.jit(lambda x: x * 2).lower(arg).compile(dict(options))
  except Exception:  # pylint: disable=broad-except  (any refusal means: do not send them)
    return False
  return True


def capacity_from_stats(stats: dict[str, int] | None, step_argument_bytes: int) -> int | None:
  """What a step may use on a device by its allocator's stats: the limit (what JAX may
  allocate; 75% of the GPU by default) less live arrays other than the step's arguments,
  which `memory_analysis()` counts itself."""
  if not stats or not stats.get("bytes_limit"):
    return None
  others = max(0, int(stats.get("bytes_in_use", 0)) - int(step_argument_bytes))
  return max(1, int(stats["bytes_limit"]) - others)


def local_backend() -> str:
  return jax.default_backend()
