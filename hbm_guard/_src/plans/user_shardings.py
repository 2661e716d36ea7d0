"""The user's own shardings, on the devices a compile is for.

A multi-chip step passes `in_shardings` / `out_shardings` (NamedShardings over a Mesh) or
arguments already placed. Compiled ahead of time for a target, the same mesh shape and axis
names are built over the target's devices, by position, and the user's PartitionSpecs kept:
the layout the job asked for, on the chips it will run on. A mesh of another size than the
target is an error naming both.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from hbm_guard._src.record import errors

_KEYS = ("in_shardings", "out_shardings")


def _is_sharding(x) -> bool:
  return isinstance(x, jax.sharding.Sharding)


def _is_leaf(x) -> bool:
  return x is None or _is_sharding(x)


def on_devices(sharding: Any, devices: Sequence[Any], what: str = "in_shardings") -> Any:
  """`sharding` (a Sharding, or a pytree of them and None) over `devices`."""
  mapped = {}

  def one(s):
    if not _is_sharding(s):
      return s
    if id(s) not in mapped:
      mapped[id(s)] = _one(s, devices, what)
    return mapped[id(s)]
  return jax.tree.map(one, sharding, is_leaf=_is_leaf)


def _one(s, devices, what):
  devices = list(devices)
  if isinstance(s, SingleDeviceSharding):
    return NamedSharding(jax.sharding.Mesh(np.array(devices), ("x",)), P(),
                         memory_kind=s.memory_kind)
  if not isinstance(s, NamedSharding):
    raise errors.InvalidOptionError(
        f"hbm_guard: {what} holds a {type(s).__name__}; with target= give NamedShardings "
        f"over a Mesh, which the guard rebuilds over the target's devices.")
  mesh = s.mesh
  if set(mesh.devices.flat) <= set(devices):
    return s  # already over the target's devices
  if mesh.devices.size != len(devices):
    raise errors.InvalidOptionError(
        f"hbm_guard: {what} use a mesh of {mesh.devices.size} devices "
        f"{dict(mesh.shape)}; the target has {len(devices)}: build the mesh with as many "
        f"devices as the target has chips.")
  return NamedSharding(mesh_on(mesh, devices), s.spec, memory_kind=s.memory_kind)


def mesh_on(mesh, devices):
  """The same mesh shape, axis names and axis types over `devices`, by position."""
  return jax.sharding.Mesh(np.array(list(devices)).reshape(mesh.devices.shape),
                           mesh.axis_names, axis_types=mesh.axis_types)


def explicit(tree) -> bool:
  """Whether any NamedSharding in `tree` is over a mesh with Explicit axes: there the
  shardings are part of the step's types (jax.set_mesh, jax.sharding.reshard)."""
  explicit_axis = getattr(jax.sharding.AxisType, "Explicit", None)
  return any(isinstance(s, NamedSharding) and explicit_axis in (s.mesh.axis_types or ())
             for s in jax.tree.leaves(tree, is_leaf=_is_sharding))


def context_mesh():
  """The mesh the user set with `jax.set_mesh`, or None."""
  mesh = jax.sharding.get_mesh()
  return None if mesh is None or mesh.empty else mesh


@contextlib.contextmanager
def context_on(devices: Sequence[Any]) -> Iterator[None]:
  """The user's `jax.set_mesh` mesh over `devices` while a compile for them traces: jax
  checks every aval's mesh against the context's. Without one, nothing changes."""
  mesh = context_mesh()
  if mesh is None or set(mesh.devices.flat) <= set(devices):
    yield
    return
  if mesh.devices.size != len(devices):
    raise errors.InvalidOptionError(
        f"hbm_guard: jax.set_mesh set a mesh of {mesh.devices.size} devices "
        f"{dict(mesh.shape)}; the target has {len(devices)}: build the mesh with as many "
        f"devices as the target has chips.")
  with jax.set_mesh(mesh_on(mesh, devices)):
    yield


def jit_kwargs_on(kw: dict[str, Any], devices: Sequence[Any]) -> dict[str, Any]:
  """jax.jit's keyword arguments with the user's shardings over `devices`."""
  out = dict(kw)
  for key in _KEYS:
    if out.get(key) is not None:
      out[key] = on_devices(out[key], devices, key)
  return out


def for_args(kw: dict[str, Any], args: tuple, static: Sequence[int]) -> dict[int, Any]:
  """argnum -> the user's in_shardings for it (a prefix tree), where they are given."""
  given = kw.get("in_shardings")
  if given is None:
    return {}
  dynamic = [i for i in range(len(args)) if i not in set(static)]
  if _is_sharding(given):
    return {i: given for i in dynamic}
  given = tuple(given)
  return {i: s for i, s in zip(dynamic, given) if s is not None}


def per_leaf(kw: dict[str, Any], args: tuple, static: Sequence[int]) -> dict[int, Any]:
  """argnum -> a tree of NamedShardings like that argument: the user's in_shardings, else
  the shardings its arrays already carry (every leaf placed on a mesh)."""
  given = for_args(kw, args, static)
  out = {i: broadcast(s, args[i]) for i, s in given.items()}
  ctx = context_mesh()  # under jax.set_mesh, what is not placed is replicated over it
  carried = lambda x: own(x) or (NamedSharding(ctx, P()) if ctx is not None else None)  # noqa: E731
  for i, a in enumerate(args):
    if i in out or i in set(static):
      continue
    leaves = jax.tree.leaves(a)
    owns = [carried(x) for x in leaves]
    if leaves and all(s is not None and s.mesh.devices.size > 1 for s in owns):
      out[i] = jax.tree.map(carried, a)
  return out


def extendable(kw: dict[str, Any]) -> bool:
  """Whether the guard can build on the user's in_shardings: NamedShardings (or none)."""
  given = kw.get("in_shardings")
  return all(isinstance(s, NamedSharding)
             for s in jax.tree.leaves(given, is_leaf=_is_sharding) if s is not None)


def extend_fsdp(s: NamedSharding, shape: Sequence[int]) -> P:
  """The user's spec with the mesh axes it leaves a leaf replicated over sharding the
  leaf's largest dimension they divide (FSDP over what the user did not use)."""
  spec = list(s.spec) + [None] * (len(shape) - len(s.spec))
  used = {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}
  free = tuple(a for a in s.mesh.axis_names if a not in used and s.mesh.shape[a] > 1)
  if not free:
    return s.spec
  n = int(np.prod([s.mesh.shape[a] for a in free]))
  for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
    entry = spec[d]
    have = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    size = int(np.prod([s.mesh.shape[a] for a in have])) if have else 1
    if shape[d] % (size * n) == 0:
      axes = have + free
      spec[d] = axes[0] if len(axes) == 1 else axes
      return P(*spec)
  return s.spec


def merge_outputs(planned, user):
  """The plan's out_shardings (its state) with the user's for the other outputs."""
  if user is None or not isinstance(planned, tuple) or not isinstance(user, (tuple, list)):
    return planned
  return tuple(p if p is not None else u for p, u in zip(planned, user))


def own(x) -> Any:
  """The sharding an argument already carries (a placed array or ShapeDtypeStruct)."""
  s = getattr(x, "sharding", None)
  return s if isinstance(s, NamedSharding) else None


def broadcast(prefix, tree):
  """A sharding prefix tree (one sharding for a whole argument, or one per leaf) spread
  over `tree`'s leaves."""
  return jax.tree.map(lambda s, sub: jax.tree.map(lambda _: s, sub), prefix, tree,
                      is_leaf=_is_leaf)
