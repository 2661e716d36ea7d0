"""The tags the batch analysis gives values (`batch_axis`), and how a refusal names the
primitive and the user's source line."""

from __future__ import annotations

import dataclasses
import enum
import os
import sys
import traceback

import jax
import numpy as np

from hbm_guard._src.dropin import jaxpr_flat as flat


class NotSplittable(Exception):
  """The loss is not a function of sums over the batch; the message says where."""


@dataclasses.dataclass(frozen=True)
class Batched:
  """Per example along `axis`: the batch is its major factor, or, with `segments` > 1, the
  axis holds that many segments one after another, each with the batch as its major factor
  (`concatenate([chosen, rejected])`: two segments of the batch)."""
  axis: int
  segments: int = 1

  def at(self, axis: int) -> "Batched":
    """The same layout on another axis (a transpose, a squeeze, a scan's slice)."""
    return Batched(axis, self.segments)


@dataclasses.dataclass(frozen=True)
class Position:
  axes: frozenset[int]


class Reduced(enum.Enum):
  SUM = "sum"
  COMBINED = "combined"
  # The largest (smallest) of per-example values of the parameters: split, the largest of
  # the microbatches' largest; only returned as it is (a metric in has_aux), never read.
  MAX = "max"
  MIN = "min"


SUM, COMBINED, MAX, MIN = Reduced.SUM, Reduced.COMBINED, Reduced.MAX, Reduced.MIN
EXTREMA = frozenset({MAX, MIN})


def batch_long(n: int, batch: int) -> bool:
  """Whether an axis of length n may hold the batch: n examples' worth of rows (the batch
  merged with a sequence, `[B * L]`, is as much a position as `[B]`)."""
  return batch >= 2 and n >= batch and n % batch == 0


def constant_tag(value, batch: int) -> Position | None:
  """A concrete constant's tag: a position along each axis a multiple of the batch's
  length along which it is not the same everywhere (`np.tile([1, .25], n // 2)` weighs by
  position)."""
  if isinstance(value, jax.core.Tracer) or not hasattr(value, "shape"):
    return None
  shape = tuple(getattr(value, "shape", ()))
  if not any(batch_long(d, batch) for d in shape):
    return None
  try:
    arr = np.asarray(value)
  except Exception:  # pylint: disable=broad-except  (not host-readable: assume the worst)
    return Position(frozenset(i for i, d in enumerate(shape) if batch_long(d, batch)))
  axes = frozenset(i for i, d in enumerate(shape) if batch_long(d, batch)
                   and not np.array_equal(arr, np.broadcast_to(
                       np.take(arr, [0], axis=i), arr.shape), equal_nan=arr.dtype.kind in "fc"))
  return Position(axes) if axes else None


def where(e) -> str:
  """The primitive, its name stack and the user's source line, for a refusal."""
  stack = f" in {e.name_stack}" if getattr(e, "name_stack", "") else ""
  line = _source_line(e)
  return f"`{e.primitive.name}`{stack}" + (f" at {line}" if line else "")


def _source_line(e: flat.Eqn) -> str:
  """The user's line of `e`, else of the call it was inlined from (`jax.nn.log_softmax`'s
  own equations carry jax's lines only)."""
  try:
    from jax._src import source_info_util  # pylint: disable=g-import-not-at-top
    line = source_info_util.summarize(e.eqn.source_info)
    site = getattr(e, "site", None)
    if (not line or _in_jax(line)) and site is not None:
      line = source_info_util.summarize(site) or line
    return line
  except Exception:  # pylint: disable=broad-except  (jax moved it: the name stack alone)
    return ""


def raised_at(error: BaseException) -> str:
  """The user's line an error was raised from in a trace (`file:line (function)`), or "":
  where a loss traced at a microbatch's shapes fails."""
  frames = traceback.extract_tb(error.__traceback__)
  return next((f"{f.filename}:{f.lineno} ({f.name})" for f in reversed(frames)
               if _users(f.filename)), "")


def called_at() -> str:
  """The user's line the running code was called from (`file:line (function)`), or "":
  where a step takes the gradient the drop-in intercepts."""
  frame = sys._getframe(1)  # pylint: disable=protected-access
  while frame is not None and not _users(frame.f_code.co_filename):
    frame = frame.f_back
  return "" if frame is None else (
      f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})")


# hbm_guard/ itself: this file is hbm_guard/_src/dropin/batch_tags.py
_OWN = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _users(filename: str) -> bool:
  return not (filename.startswith(_OWN) or _in_jax(filename) or "/site-packages/" in filename
              or filename.startswith(("<frozen", "<string>")) or "/lib/python3" in filename)


def _in_jax(line: str) -> bool:
  return any(part in line for part in ("/jax/_src/", "/jax/nn/", "/jax/numpy/", "/flax/",
                                        "/optax/"))


def shape_of(atom) -> tuple[int, ...]:
  return tuple(getattr(atom.aval, "shape", ())) if flat.is_var(atom) else tuple(
      getattr(flat.read(atom, {}), "shape", ()))
