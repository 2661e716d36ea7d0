"""Values a function closes over, found and replaced: how the batch reaches a loss.

`def loss_fn(params): ... inputs ...` closes over the batch; to trace it on one microbatch
the guard rebuilds the function with the microbatch in place of the batch. Reached: closure
cells, defaults, `functools.partial` arguments, the fields of callable dataclasses (flax's
nnx wraps the loss in one), and pytrees of those; a bounded walk.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import types
from typing import Any, Callable

import jax

_MAX_OBJECTS = 4096
_MAX_DEPTH = 8


def find(fun: Any, wanted: Callable[[Any], bool]) -> list[Any]:
  """The distinct leaves satisfying `wanted` that `fun` reaches, in a stable order."""
  found: dict[int, Any] = {}
  _walk(fun, wanted, found, set(), 0)
  return list(found.values())


def _children(obj) -> list[Any]:
  if isinstance(obj, types.FunctionType):
    cells = [c.cell_contents for c in (obj.__closure__ or ()) if _filled(c)]
    return cells + list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
  if isinstance(obj, functools.partial):
    return [obj.func, *obj.args, *obj.keywords.values()]
  if callable(obj) and dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    return list(vars(obj).values())
  return []


def _filled(cell) -> bool:
  try:
    cell.cell_contents  # pylint: disable=pointless-statement
    return True
  except ValueError:  # an empty cell (a name assigned after the function was made)
    return False


def _is_leafy(obj) -> bool:
  return isinstance(obj, (types.FunctionType, functools.partial)) or (
      callable(obj) and dataclasses.is_dataclass(obj) and not isinstance(obj, type))


def _walk(obj, wanted, found, seen, depth) -> None:
  if id(obj) in seen or len(seen) > _MAX_OBJECTS or depth > _MAX_DEPTH:
    return
  seen.add(id(obj))
  if _is_leafy(obj):
    for child in _children(obj):
      _walk(child, wanted, found, seen, depth + 1)
    return
  try:
    leaves = jax.tree_util.tree_leaves(obj, is_leaf=_is_leafy)
  except Exception:  # pylint: disable=broad-except  (an object pytrees cannot flatten)
    return
  for leaf in leaves:
    if _is_leafy(leaf):
      _walk(leaf, wanted, found, seen, depth + 1)
    elif wanted(leaf):
      found.setdefault(id(leaf), leaf)


def fresh(fun: Any) -> Any:
  """`fun` as it was before a call consumed it: a callable dataclass's queues and lists
  copied (flax's nnx `GradFn` pops per-call state from a deque), so it can be called again."""
  if not (callable(fun) and dataclasses.is_dataclass(fun) and not isinstance(fun, type)):
    return fun
  new = copy.copy(fun)
  for name, value in vars(fun).items():
    if isinstance(value, (collections.deque, list)):
      object.__setattr__(new, name, copy.copy(value))
  return new


def substitute(fun: Any, mapping: dict[int, Any]) -> Any:
  """`fun` rebuilt with each reached leaf `x` whose id is in `mapping` replaced."""
  return _sub(fun, mapping, {}, 0)


def _sub(obj, mapping, memo, depth):
  if id(obj) in mapping:
    return mapping[id(obj)]
  if id(obj) in memo:
    return memo[id(obj)]
  if depth > _MAX_DEPTH:
    return obj
  memo[id(obj)] = obj  # cycles resolve to the original
  if isinstance(obj, types.FunctionType):
    new = _sub_function(obj, mapping, memo, depth)
  elif isinstance(obj, functools.partial):
    func = _sub(obj.func, mapping, memo, depth + 1)
    args = [_sub(a, mapping, memo, depth + 1) for a in obj.args]
    kw = {k: _sub(v, mapping, memo, depth + 1) for k, v in obj.keywords.items()}
    changed = func is not obj.func or any(a is not b for a, b in zip(args, obj.args)) or any(
        kw[k] is not v for k, v in obj.keywords.items())
    new = functools.partial(func, *args, **kw) if changed else obj
  elif _is_leafy(obj):
    new = _sub_object(obj, mapping, memo, depth)
  else:
    new = _sub_tree(obj, mapping, memo, depth)
  memo[id(obj)] = new
  return new


def _sub_function(fn, mapping, memo, depth):
  cells = fn.__closure__ or ()
  contents = [_sub(c.cell_contents, mapping, memo, depth + 1) if _filled(c) else None
              for c in cells]
  defaults = tuple(_sub(d, mapping, memo, depth + 1) for d in fn.__defaults__ or ())
  if all(not _filled(c) or v is c.cell_contents for c, v in zip(cells, contents)) and all(
      a is b for a, b in zip(defaults, fn.__defaults__ or ())):
    return fn
  closure = tuple(types.CellType(v) if _filled(c) else c for c, v in zip(cells, contents))
  new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, defaults or None, closure)
  new.__kwdefaults__ = fn.__kwdefaults__
  new.__dict__.update(fn.__dict__)
  new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
  return new


def _sub_object(obj, mapping, memo, depth):
  changed = {}
  for name, value in vars(obj).items():
    new = _sub(value, mapping, memo, depth + 1)
    if new is not value:
      changed[name] = new
  if not changed:
    return obj
  new = copy.copy(obj)
  for name, value in changed.items():
    object.__setattr__(new, name, value)
  return new


def _sub_tree(obj, mapping, memo, depth):
  try:
    leaves, treedef = jax.tree_util.tree_flatten(obj, is_leaf=_is_leafy)
  except Exception:  # pylint: disable=broad-except
    return obj
  if len(leaves) == 1 and leaves[0] is obj:
    return obj
  new = [_sub(x, mapping, memo, depth + 1) for x in leaves]
  if all(a is b for a, b in zip(new, leaves)):
    return obj
  return jax.tree_util.tree_unflatten(treedef, new)
