"""Where a plan puts the step's state: FSDP shardings, host offload, abstract arguments.

Pure functions of the plan and the arguments; moving the caller's arrays (`place`) is the
one side effect, and it happens once: the step returns its state in the planned layout.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.plans import user_shardings

Layout = Mapping[int, Any]  # argnum -> a tree of NamedSharding like that argument


def default_offload_filter(path: str) -> bool:
  """Which state leaves are optimizer state, by their key path (flax TrainState, optax)."""
  return "opt_state" in path


def dtype_of(x) -> Any:
  """x's dtype: numpy's, or jax's own where numpy has none (typed PRNG keys, `key<fry>`)."""
  dtype = getattr(x, "dtype", np.float32)
  return dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else np.dtype(dtype)


def nbytes(tree) -> int:
  return sum(int(np.prod(np.shape(x))) * dtype_of(x).itemsize
             for x in jax.tree_util.tree_leaves(tree))


def offload_bytes(tree, offload_filter: Callable[[str], bool]) -> int:
  return sum(nbytes(leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
             if offload_filter(jax.tree_util.keystr(path)))


def fsdp_spec(shape, n: int) -> P:
  """Shard the largest dimension divisible by n over the 'fsdp' axis; else replicate."""
  for d in sorted(range(len(shape)), key=lambda d: -shape[d]):
    if shape[d] >= n and shape[d] % n == 0:
      spec = [None] * len(shape)
      spec[d] = "fsdp"
      return P(*spec)
  return P()


def plan_layout(plan: plan_lib.Plan, args, state_argnums: Iterable[int], devices,
                offload_filter: Callable[[str], bool], static_argnums: Iterable[int] = (),
                given: Mapping[int, Any] | None = None) -> dict[int, Any] | None:
  """Shardings under `plan`: the state FSDP-sharded and/or offloaded; with `shard_batch`,
  the batch over the same devices (data parallel: each takes its share of the examples)."""
  state_argnums = tuple(state_argnums)
  if not (plan.shard_state or plan.offload_optimizer) or not state_argnums:
    return None
  mesh = jax.sharding.Mesh(np.array(devices), ("fsdp",))
  n = len(devices) if plan.shard_state else 1

  def leaf(path, x):
    host = plan.offload_optimizer and offload_filter(jax.tree_util.keystr(path))
    spec = fsdp_spec(np.shape(x), n) if plan.shard_state else P()
    return NamedSharding(mesh, spec, memory_kind="pinned_host" if host else "device")

  given = given or {}

  def extended(path, x, s):
    host = plan.offload_optimizer and offload_filter(jax.tree_util.keystr(path))
    spec = user_shardings.extend_fsdp(s, np.shape(x)) if plan.shard_state else s.spec
    return NamedSharding(s.mesh, spec,
                         memory_kind="pinned_host" if host else (s.memory_kind or "device"))

  out = {i: (jax.tree_util.tree_map_with_path(extended, args[i], given[i]) if i in given
             else jax.tree_util.tree_map_with_path(leaf, args[i])) for i in state_argnums}
  if given:  # the user's layout: the batch stays where they put it
    return out
  if n > 1 and plan.shard_batch:
    out.update(batch_layout(args, set(state_argnums) | set(static_argnums), mesh, n))
  return out


def batch_size(args, skip: Iterable[int]) -> int | None:
  """The batch: the commonest leading size of the arguments outside `skip` (state, static)."""
  skip = set(skip)
  sizes = [int(np.shape(x)[0]) for i, a in enumerate(args) if i not in skip
           for x in jax.tree_util.tree_leaves(a) if np.ndim(x) >= 1 and hasattr(x, "dtype")]
  return max(set(sizes), key=sizes.count) if sizes else None


def batch_layout(args, skip: Iterable[int], mesh, n: int) -> dict[int, Any]:
  """The batch's leaves split over the mesh on their leading axis, when it divides."""
  skip = set(skip)
  size = batch_size(args, skip)
  if size is None or size % n:
    return {}

  def leaf(x):
    batched = np.ndim(x) >= 1 and hasattr(x, "dtype") and np.shape(x)[0] == size
    return NamedSharding(mesh, P("fsdp") if batched else P())

  return {i: jax.tree.map(leaf, a) for i, a in enumerate(args) if i not in skip}


def batch_mesh(layout: Layout | None, state_argnums: Iterable[int]):
  """The mesh the layout shards the batch over (data parallel), or None."""
  state = set(state_argnums)
  for i, tree in (layout or {}).items():
    if i in state:
      continue
    for s in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, NamedSharding)):
      if isinstance(s, NamedSharding) and tuple(s.spec)[:1] == ("fsdp",):
        return s.mesh
  return None


def batch_sharded(plan: plan_lib.Plan, args, skip: Iterable[int], n: int) -> bool:
  """Whether `plan_layout` shards the batch of these arguments over n devices."""
  size = batch_size(args, skip)
  return bool(plan.shard_state and plan.shard_batch and n > 1 and size and size % n == 0)


def out_shardings(layout: Layout, replaced: tuple[tuple[int, int | None], ...],
                  n_outputs: int | None):
  """The step returns its state where the layout keeps it; other outputs where jax likes."""
  whole = [i for i, j in replaced if j is None and i in layout]
  if whole:
    return layout[whole[0]]
  by_out = {j: layout[i] for i, j in replaced if i in layout}
  return tuple(by_out.get(j) for j in range(n_outputs or 0))


def abstract_args(args, kwargs, layout: Layout | None, static_argnums: Iterable[int],
                  static_argnames: Iterable[str], devices=None,
                  given: Mapping[int, Any] | None = None):
  """Arguments to lower with: state as planned; on a target's devices, the rest as `given`
  (the user's in_shardings, mapped there), else as the argument is placed, else replicated."""
  static, static_names = set(static_argnums), set(static_argnames)
  mesh = replicated_mesh(devices) if devices is not None else None

  def abstract(x, sharding):
    scalar = not hasattr(x, "dtype")  # a Python scalar traces weakly typed, as under jit
    if scalar and not isinstance(x, (bool, int, float, complex)):
      return x  # not an array: jax's own error names it (and static_argnums), as under jit
    weak = scalar or bool(getattr(x, "weak_type", False))
    return jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype if scalar else x.dtype,
                                sharding=sharding, weak_type=weak)

  def other(x):
    if mesh is None:
      return x
    own = user_shardings.own(x)
    return abstract(x, user_shardings.on_devices(own, devices) if own is not None
                    else NamedSharding(mesh, P()))

  out = []
  for i, a in enumerate(args):
    if i in static:
      out.append(a)
    elif layout and i in layout:
      out.append(jax.tree.map(abstract, a, layout[i]))
    elif given and i in given and mesh is not None:
      out.append(jax.tree.map(abstract, a, user_shardings.broadcast(given[i], a)))
    else:
      out.append(jax.tree.map(other, a))
  kw = {k: (v if k in static_names else jax.tree.map(other, v)) for k, v in kwargs.items()}
  return tuple(out), kw


def replicated_mesh(devices):
  """A mesh to replicate what is not laid out over: jax.set_mesh's, mapped onto `devices`,
  since jax checks each aval's mesh against the context's; else one axis of them all."""
  ctx = user_shardings.context_mesh()
  if ctx is not None and ctx.devices.size == len(devices):
    return user_shardings.mesh_on(ctx, devices)
  return jax.sharding.Mesh(np.array(devices), ("fsdp",))


def describe(args, state_argnums: Iterable[int], top: int = 2) -> tuple[str, ...]:
  """Where a compile put the batch and the largest state leaves, for the report."""
  state, out = set(state_argnums), []
  for i, a in enumerate(args):
    leaves = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(a)[0]
              if hasattr(x, "shape") and hasattr(x, "dtype")]
    if i in state:
      leaves = sorted(leaves, key=lambda px: -nbytes(px[1]))
    for path, x in leaves[:top]:
      s = getattr(x, "sharding", None)
      spec = getattr(s, "spec", None)
      where = ("one device" if spec is None else "replicated" if all(e is None for e in spec)
               else f"sharded {spec}")
      host = " (host)" if getattr(s, "memory_kind", None) == "pinned_host" else ""
      out.append(f"{'state' if i in state else 'argument'} {i}{jax.tree_util.keystr(path)} "
                 f"{dtype_of(x).name}{list(np.shape(x))}: {where}{host}")
  return tuple(out)


def place(args, layout: Layout | None):
  """Moves the caller's state arguments to the planned layout (a no-op once there)."""
  if not layout:
    return args
  args = list(args)
  for i, sharding in layout.items():
    args[i] = jax.device_put(args[i], sharding)
  return tuple(args)


def shapes_only(args, kwargs, static_argnums: Iterable[int], static_argnames: Iterable[str]):
  """Arguments as shapes and dtypes, without placement (committed or not, sharded or not)."""
  static, names = set(static_argnums), set(static_argnames)

  def strip(x):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      return x
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                weak_type=bool(getattr(x, "weak_type", False)))

  out = tuple(a if i in static else jax.tree.map(strip, a) for i, a in enumerate(args))
  kw = {k: (v if k in names else jax.tree.map(strip, v)) for k, v in kwargs.items()}
  return out, kw


def abstract_tree(tree):
  """Each array as its shape, dtype and placement: for a compile in another thread, which
  must not hold (or read) buffers the step may donate meanwhile."""
  def strip(x):
    if not isinstance(x, jax.Array):
      return x
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                weak_type=bool(getattr(x, "weak_type", False)))
  return jax.tree.map(strip, tree)
