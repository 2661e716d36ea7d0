"""The tags the batch analysis gives values (`batch_axis`), and how a refusal names the
primitive and the user's source line."""

from __future__ import annotations

import dataclasses
import enum

import jax
import numpy as np

from hbm_guard._src import jaxpr_flat as flat


class NotSplittable(Exception):
  """The loss is not a function of sums over the batch; the message says where."""


@dataclasses.dataclass(frozen=True)
class Batched:
  axis: int


@dataclasses.dataclass(frozen=True)
class Position:
  axes: frozenset[int]


class Reduced(enum.Enum):
  SUM = "sum"
  COMBINED = "combined"


SUM, COMBINED = Reduced.SUM, Reduced.COMBINED


def constant_tag(value, batch: int) -> Position | None:
  """A concrete constant's tag: a position along each axis of the batch's length along
  which it is not the same everywhere (`np.tile([1, .25], n // 2)` weighs by position)."""
  if isinstance(value, jax.core.Tracer) or not hasattr(value, "shape"):
    return None
  shape = tuple(getattr(value, "shape", ()))
  if batch not in shape or batch < 2:
    return None
  try:
    arr = np.asarray(value)
  except Exception:  # pylint: disable=broad-except  (not host-readable: assume the worst)
    return Position(frozenset(i for i, d in enumerate(shape) if d == batch))
  axes = frozenset(i for i, d in enumerate(shape) if d == batch
                   and not np.array_equal(arr, np.broadcast_to(
                       np.take(arr, [0], axis=i), arr.shape), equal_nan=arr.dtype.kind in "fc"))
  return Position(axes) if axes else None


def where(e) -> str:
  """The primitive, its name stack and the user's source line, for a refusal."""
  stack = f" in {e.name_stack}" if getattr(e, "name_stack", "") else ""
  line = _source_line(e)
  return f"`{e.primitive.name}`{stack}" + (f" at {line}" if line else "")


def _source_line(e: flat.Eqn) -> str:
  try:
    from jax._src import source_info_util  # pylint: disable=g-import-not-at-top
    return source_info_util.summarize(e.eqn.source_info)
  except Exception:  # pylint: disable=broad-except  (jax moved it: the name stack alone)
    return ""


def shape_of(atom) -> tuple[int, ...]:
  return tuple(getattr(atom.aval, "shape", ())) if flat.is_var(atom) else tuple(
      getattr(flat.read(atom, {}), "shape", ()))
