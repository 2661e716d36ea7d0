"""Host offload of optimizer state that actually lowers the device peak.

Bringing the whole optimizer state to the device for the update (`load_offloaded`) keeps
all of it there at once, next to the parameters and gradients: where the update is the
peak, offload then costs memory instead of saving it. `offload_aware(tx)` streams it
instead: the parameters are cut into parts of about equal state bytes; each part's state
comes in, is updated, and goes back to the host before the next part's comes in, so the
device holds about 1/MAX_PARTS of the state at a time (one parameter's, for few).

Streaming is exact only when the update of parameter i reads nothing of parameter j (Adam,
SGD, momentum, weight decay: yes; global-norm clipping: no). That is checked, not assumed:
the dependencies of `tx.update`'s jaxpr decide, and an update that mixes parameters is
brought in whole, as before, and the step's facts say so.
"""

from __future__ import annotations

import enum
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax.extend import core as jex_core

from hbm_guard._src.plans import layout as layout_lib
from hbm_guard._src.plans import plan as plan_lib

MAX_PARTS = 16  # the state streams in at most this many parts


class Streaming(enum.Enum):
  """How an offloaded optimizer state reached the device for the update."""
  STREAMED = "streamed"  # a part at a time (at most 1/MAX_PARTS of it, by bytes)
  WHOLE = "whole"  # all of it at once: the update mixes parameters, or nothing to stream


def load_offloaded(tree):
  """In a step: bring state the plan keeps on host (pinned_host) to the device, whole.

  Call it where the state is first needed, so the device holds it only then. Identity when
  the plan does not offload. For an optax optimizer prefer `offload_aware(tx)`, which
  streams the state in parts.
  """
  if not plan_lib.plan_value("offload_optimizer"):
    return tree
  return jax.device_put(tree, jax.memory.Space.Device)


def store_offloaded(tree):
  """In a step: send state the plan keeps on host back there (pairs with load_offloaded)."""
  if not plan_lib.plan_value("offload_optimizer"):
    return tree
  return jax.device_put(tree, jax.memory.Space.Host)


def offload_aware(tx):
  """An optax transformation whose update streams host-offloaded state through the device.

  Without the offload rung it is `tx`. With it, the state arrives on the host (the guard
  places it there) and `update` brings it in a part at a time, updates it and stores it
  back, in order, after the gradients exist. Use it where the step calls
  `tx.update` (`hg_flax.train_step` and `nnx_train_step` do this for you):

      updates, opt_state = hbm_guard.offload_aware(tx).update(grads, opt_state, params)
  """
  def update(updates, state, params=None, **extra_args):
    if not plan_lib.plan_value("offload_optimizer"):
      return tx.update(updates, state, params, **extra_args)
    return streamed_update(tx, updates, state, params, **extra_args)
  if hasattr(tx, "_replace"):  # optax's GradientTransformation: a NamedTuple
    return tx._replace(update=update)
  return _Updating(tx, update)


def is_transformation(tx) -> bool:
  """Whether `tx` updates as optax's do: `init` and `update` (a GradientTransformation, or
  an object such as `optax.MultiSteps`)."""
  return callable(getattr(tx, "init", None)) and callable(getattr(tx, "update", None))


class _Updating:
  """`tx` with another `update`; everything else is `tx`'s own (`optax.MultiSteps`'s
  `has_updated`, `inner_opt`, ...), so a step that reads them traces as it would."""

  def __init__(self, tx, update):
    self._tx, self.update = tx, update

  def __getattr__(self, name):
    if name == "_tx":  # not yet set (a copy being made): no recursion
      raise AttributeError(name)
    return getattr(self._tx, name)


def streamed_update(tx, grads, state, params=None, **extra_args):
  """`tx.update` with `state` on the host, streamed in parts where that is exact."""
  owner = None if extra_args else _owners(tx, grads, state, params)
  if owner is None:
    plan_lib.note(optimizer_streaming=Streaming.WHOLE.value)
    updates, new = tx.update(grads, jax.device_put(state, jax.memory.Space.Device),
                             params, **extra_args)
    return updates, _store(new, state)
  plan_lib.note(optimizer_streaming=Streaming.STREAMED.value)

  g_leaves, g_def = jax.tree.flatten(grads)
  p_leaves = None if params is None else jax.tree.leaves(params)
  s_leaves, s_def = jax.tree.flatten(state)
  shared = [j for j, o in enumerate(owner) if o is None]
  shared_dev = {j: _to_device(s_leaves[j]) for j in shared}
  new_s: list[Any] = [None] * len(s_leaves)
  new_u: list[Any] = [None] * len(g_leaves)
  previous: Any = grads  # the first part comes in after the backward pass
  for number, part in enumerate(_parts(owner, s_leaves, len(g_leaves))):
    mine = [j for j, o in enumerate(owner) if o in part]
    # Each part comes in only after the previous one went out.
    loaded, _ = jax.lax.optimization_barrier(([s_leaves[j] for j in mine], previous))
    call_s = [_empty(x) for x in s_leaves]
    for j, x in zip(mine, loaded):
      call_s[j] = _to_device(x)
    for j in shared:
      call_s[j] = shared_dev[j]
    u, n = tx.update(jax.tree.unflatten(g_def, _only(g_leaves, part)),
                     jax.tree.unflatten(s_def, call_s),
                     None if params is None else jax.tree.unflatten(g_def, _only(p_leaves, part)))
    u_leaves, n_leaves = jax.tree.leaves(u), jax.tree.leaves(n)
    for i in part:
      new_u[i] = u_leaves[i]
    for j in mine + (shared if number == 0 else []):
      new_s[j] = _to_space(n_leaves[j], s_leaves[j])
    previous = ([new_s[j] for j in mine], [new_u[i] for i in part])
  return jax.tree.unflatten(g_def, new_u), jax.tree.unflatten(s_def, new_s)


def _parts(owner: Sequence[int | None], s_leaves, n: int) -> list[frozenset[int]]:
  """Parameters in consecutive parts of about equal state bytes, at most MAX_PARTS of them:
  each part is one `tx.update` in the program, so a model with thousands of parameter
  arrays is not traced thousands of times, yet the device holds about 1/MAX_PARTS of the
  state at once. A parameter is never split."""
  size = [0] * n
  for o, x in zip(owner, s_leaves):
    if o is not None:
      size[o] += layout_lib.nbytes(x)
  budget = max(1, -(-sum(size) // MAX_PARTS))
  parts, current, filled = [], [], 0
  for i in range(n):
    current.append(i)
    filled += size[i]
    if filled >= budget:
      parts.append(frozenset(current))
      current, filled = [], 0
  if current and len(parts) == MAX_PARTS:  # only parameters without state are left
    parts[-1] = parts[-1] | frozenset(current)
  elif current:
    parts.append(frozenset(current))
  return parts


def _owners(tx, grads, state, params) -> list[int | None] | None:
  """For each state leaf, the parameter whose update alone reads and writes it (None:
  shared, like a step count); None when the update mixes parameters, so cannot stream."""
  n = len(jax.tree.leaves(grads))
  s_leaves, s_def = jax.tree.flatten(state)
  if n < 2 or (params is not None and jax.tree.structure(params) != jax.tree.structure(grads)):
    return None
  try:
    closed = jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(
        *(_on_device(t) for t in (grads, state, params)))
  except Exception:  # pylint: disable=broad-except  # the real update will say what is wrong
    return None
  bits = [1 << i for i in range(n)]
  p_bits = [] if params is None else bits
  u_count = n
  # Pass 1: what each new state leaf reads of gradients and parameters names its owner.
  out = _dependencies(closed.jaxpr, bits + [0] * len(s_leaves) + p_bits)
  owner = []
  for dep in out[u_count:u_count + len(s_leaves)]:
    if dep & (dep - 1):
      return None  # one state leaf mixes two parameters
    owner.append(dep.bit_length() - 1 if dep else None)
  # Pass 2: with owners on the old state too, every output must read only its own.
  labels = bits + [0 if o is None else 1 << o for o in owner] + p_bits
  out = _dependencies(closed.jaxpr, labels)
  want = bits + [0 if o is None else 1 << o for o in owner]
  if len(out) != len(want) or any(d & ~w for d, w in zip(out, want)):
    return None
  return owner if any(o is not None for o in owner) else None


def _dependencies(jaxpr, in_labels: Sequence[int]) -> list[int]:
  """Bitsets of labelled inputs each output reads. Calls (jit, custom_jvp, ...) are
  followed inside; any other equation's outputs read all of its inputs. Linear in the
  equations."""
  env = dict(zip(jaxpr.invars, in_labels))

  def read(v):
    return 0 if isinstance(v, jex_core.Literal) else env.get(v, 0)
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    inner = _called_jaxpr(eqn)
    if inner is not None:
      outs = _dependencies(inner, ins)
    else:
      dep = 0
      for d in ins:
        dep |= d
      outs = [dep] * len(eqn.outvars)
    for v, d in zip(eqn.outvars, outs):
      env[v] = d
  return [read(v) for v in jaxpr.outvars]


def _called_jaxpr(eqn):
  """The jaxpr an equation calls with its own inputs and outputs one to one, if any."""
  for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
    inner = eqn.params.get(key)
    inner = getattr(inner, "jaxpr", inner)
    if (isinstance(inner, jex_core.Jaxpr) and len(inner.invars) == len(eqn.invars)
        and len(inner.outvars) == len(eqn.outvars)):
      return inner
  return None


def _on_device(tree):
  """Shapes and dtypes only: host-resident state would not mix with device gradients."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def _only(leaves, part):
  return [x if j in part else _empty(x) for j, x in enumerate(leaves)]


def _empty(x):
  """A stand-in for another parameter's leaf: same dtype, no elements, no memory."""
  return jnp.zeros((0,), jnp.result_type(x))


def _space(x):
  return getattr(jax.typeof(x), "memory_space", None)


def _to_device(x):
  return x if _space(x) == jax.memory.Space.Device else jax.device_put(x, jax.memory.Space.Device)


def _to_space(new, old):
  """Back where the old leaf lived (the host, when jax cannot tell)."""
  space = _space(old)
  return jax.device_put(new, jax.memory.Space.Host if space in (None, jax.memory.Space.Host)
                        else space)


def _store(new, old):
  return jax.tree.map(_to_space, new, old)
