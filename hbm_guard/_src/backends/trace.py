"""What the guard learns from the arguments and from a trace: signatures and replaced state.

A signature is what makes jax trace anew (tree structure, shapes, dtypes, weak types,
static values). The same function computes it from concrete arguments (to dispatch) and
from tracers (inside the traced step), so both agree.
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable

import jax
from hbm_guard._src.plans import layout as layout_lib

try:
  from jax._src.array import ArrayImpl as _ArrayImpl  # jax.Array's concrete type: not public
except ImportError:  # pragma: no cover  (then every leaf by its aval)
  _ArrayImpl = None


def _leaf_key(x) -> Hashable:
  # Computed for every leaf at every call once signatures live on several jits: a concrete
  # array is keyed from its own attributes (0.14 us, where jax.typeof and str(dtype) took
  # 3.4 us a leaf: 1.4 ms a call for a 400-leaf state), to the key its aval gives.
  if type(x) is _ArrayImpl:
    return (x.shape, x.dtype, x.weak_type)
  if hasattr(x, "shape") and hasattr(x, "dtype") or isinstance(x, (bool, int, float, complex)):
    try:
      aval = jax.typeof(x)
      return (tuple(aval.shape), aval.dtype, bool(getattr(aval, "weak_type", False)))
    except TypeError:
      pass
  try:
    hash(x)
    return ("static", type(x).__name__, x)
  except TypeError:
    return ("unhashable", type(x).__name__, id(x))


def _static_key(x) -> Hashable:
  """A static argument by value, as jax.jit keys it (1 and 1.0 and True apart)."""
  try:
    hash(x)
    return ("static", type(x).__module__, type(x).__qualname__, x)
  except TypeError:
    return ("unhashable", type(x).__name__, id(x))


def signature(args: tuple, kwargs: dict, static_argnums: Iterable[int] = (),
              static_argnames: Iterable[str] = ()) -> Hashable:
  """The input signature: static arguments by value, the rest by abstract value."""
  static = set(static_argnums)
  names = set(static_argnames)
  statics = tuple((i, _static_key(a)) for i, a in enumerate(args) if i in static)
  static_kw = tuple(sorted((k, _static_key(v)) for k, v in kwargs.items() if k in names))
  dynamic = ([a for i, a in enumerate(args) if i not in static],
             {k: v for k, v in kwargs.items() if k not in names})
  leaves, treedef = jax.tree_util.tree_flatten(dynamic)
  return (statics, static_kw, treedef, tuple(_leaf_key(x) for x in leaves))


def describe_args(args: tuple, kwargs: dict, state_argnums: Iterable[int] = ()) -> str:
  """The arguments as a person reads them: each non-state array's shape, the state summed."""
  state = set(state_argnums)
  parts, state_leaves = [], []
  named = [(str(i), a) for i, a in enumerate(args)] + list(kwargs.items())
  for name, a in named:
    leaves = [x for x in jax.tree_util.tree_leaves(a) if hasattr(x, "shape")]
    if name.isdigit() and int(name) in state:
      state_leaves += leaves
    else:
      parts += [f"{x.dtype}{list(x.shape)}" for x in leaves[:4]]
      if len(leaves) > 4:
        parts.append(f"... ({len(leaves)} arrays)")
  if state_leaves:
    nbytes = layout_lib.nbytes(state_leaves)
    parts.append(f"state: {len(state_leaves)} arrays, {nbytes / 2**20:.1f} MiB")
  return ", ".join(parts)


def _avals_equal(a, b) -> bool:
  la, ta = jax.tree_util.tree_flatten(a)
  lb, tb = jax.tree_util.tree_flatten(b)
  return ta == tb and all(_leaf_key(x)[:2] == _leaf_key(y)[:2] for x, y in zip(la, lb))


def replaced_state(args, out, state_argnums: Iterable[int]) -> tuple[tuple[int, Any], ...]:
  """State arguments the step returns anew with the same structure: safe to donate.

  Returns (argnum, output index) pairs; the index is None when the whole output is it.
  """
  found = []
  for i in state_argnums:
    if i >= len(args):
      continue
    if _avals_equal(args[i], out):
      found.append((i, None))
    elif isinstance(out, (tuple, list)):
      j = next((j for j, o in enumerate(out) if _avals_equal(args[i], o)), None)
      if j is not None:
        found.append((i, j))
  return tuple(found)
