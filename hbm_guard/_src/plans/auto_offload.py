"""Host offload of an unmodified step's optimizer state: its optax update, found.

An ordinary step updates through a flax `TrainState` (`state.apply_gradients`, which calls
`state.tx.update`) or an `nnx.Optimizer` (`optimizer.update`). While the guard traces, both
reach `offload.offload_aware(tx)`, which follows the plan's offload rung (streaming the state
through the device where the update allows) and is `tx` itself otherwise. The step's
outputs carry the user's own `tx` back, so the state's structure never changes.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Iterator, Sequence

import jax

from hbm_guard._src.plans import offload
from hbm_guard._src.plans import swap

_SWAP = swap.WhileTracing()


def _is_train_state(x) -> bool:
  return (hasattr(x, "apply_gradients") and hasattr(x, "replace")
          and offload.is_transformation(getattr(x, "tx", None)))


def wrap_states(args: tuple, state_argnums: Sequence[int]) -> tuple[tuple, dict[int, Any]]:
  """The arguments with each TrainState's `tx` streaming-aware; {id(new tx): user's tx}."""
  originals: dict[int, Any] = {}
  args = list(args)
  for i in state_argnums:
    if i < len(args) and _is_train_state(args[i]):
      tx = args[i].tx
      aware = offload.offload_aware(tx)
      originals[id(aware)] = tx
      args[i] = args[i].replace(tx=aware)
  return tuple(args), originals


def restore_states(out: Any, originals: dict[int, Any]) -> Any:
  """The step's outputs with the user's own `tx` in every TrainState it returns."""
  if not originals:
    return out

  def back(x):
    if _is_train_state(x) and id(x.tx) in originals:
      return x.replace(tx=originals[id(x.tx)])
    return x
  return jax.tree_util.tree_map(back, out, is_leaf=_is_train_state)


@contextlib.contextmanager
def nnx_optimizers() -> Iterator[None]:
  """While tracing: `nnx.Optimizer.update` goes through `offload_aware(tx)` (if nnx is in use)."""
  nnx = sys.modules.get("flax.nnx")
  cls = getattr(nnx, "Optimizer", None)
  if cls is None:
    yield
    return
  with _SWAP.swapped(cls, {"update": _aware_update}):
    yield


def _aware_update(self, *args, **kwargs):
  original = _SWAP.original("update")
  tx = getattr(self, "tx", None)
  if not offload.is_transformation(tx):
    return original(self, *args, **kwargs)
  object.__setattr__(self, "tx", offload.offload_aware(tx))
  try:
    return original(self, *args, **kwargs)
  finally:
    object.__setattr__(self, "tx", tx)
