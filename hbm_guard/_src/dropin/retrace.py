"""The step traced again at a microbatch's shapes, to the gradient being analysed.

Where the loss alone does not trace on a microbatch as it does on the whole batch because
the step read a size before it (`b, t = pairs.shape`, then `pairs.reshape(2 * b, t)` in the
loss; DPO's `n = chosen.shape[0]`), the step itself is traced again with its batch
arguments at a microbatch's shapes, and the loss taken where the step calls the same
gradient (by the order of its calls): its program is then held against the whole batch's
like any microbatch program (`micro_program`), with the whole trace's constants.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Any, Callable

import jax

from hbm_guard._src.dropin import auto_grad
from hbm_guard._src.dropin import batch_axis
from hbm_guard._src.dropin import batch_context
from hbm_guard._src.dropin import micro_program
from hbm_guard._src.plans import plan as plan_lib


class _Reached(BaseException):
  """Stops the step's second trace at the gradient wanted (not an Exception: a step's own
  `except Exception` does not swallow it)."""

  def __init__(self, traced: auto_grad.Traced):
    super().__init__()
    self.traced = traced


class _Capture:
  """The gradient calls of one second trace, counted until the `index`th."""

  def __init__(self, index: int, template: auto_grad.Traced):
    self.index, self.template, self.calls = index, template, 0

  def skip(self) -> None:
    self.calls += 1

  def reached(self, fun: Callable, args, kwargs, own: Callable):
    """At the wanted call, stops the trace with its loss; before it, jax's own gradient."""
    token = _CAPTURE.set(None)  # (gradients inside the loss are not the step's calls)
    try:
      if self.calls == self.index:
        raise _Reached(auto_grad.trace_like(self.template, fun, args, kwargs))
      self.calls += 1
      return own(*args, **kwargs)
    finally:
      _CAPTURE.reset(token)


_CAPTURE: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar(
    "hbm_guard_retrace", default=None)


def capturing() -> _Capture | None:
  """The second trace in progress in this context, if any."""
  return _CAPTURE.get()


MAX_RETRACES = 3  # second traces of the step per gradient, across its readings


def again(reading: batch_context.Context, index: int, t: auto_grad.Traced, budget: list[int]
          ) -> Callable[[int], auto_grad.Traced] | None:
  """`k -> the loss of t` as the step traced at 1/k of the batch (as `reading` reads it)
  calls its `index`th gradient; None where the trace gave no step call. Traced once per k,
  and at most `budget[0]` times in all (a step's trace can take seconds: the readings of
  one gradient share the budget)."""
  call = reading.step_call
  if call is None:
    return None

  @functools.cache
  def traced(k: int) -> auto_grad.Traced:
    if budget[0] <= 0:
      raise ValueError("no second trace of the step left for this gradient")
    budget[0] -= 1
    return _traced_again(call, reading, index, t, k)
  return traced


def _traced_again(call: batch_context.StepCall, reading: batch_context.Context, index: int,
                  t: auto_grad.Traced, k: int) -> auto_grad.Traced:
  leaves, treedef = jax.tree_util.tree_flatten((call.args, call.kwargs))
  arrays = [i for i, x in enumerate(leaves) if hasattr(x, "shape") and hasattr(x, "dtype")]

  def run(*xs):
    given = list(leaves)
    for i, x in zip(arrays, xs):
      given[i] = x
    args, kwargs = jax.tree_util.tree_unflatten(treedef, given)
    return call.run(*args, **kwargs)

  shapes = [_at_microbatch(leaves[i], reading, k) for i in arrays]
  token = _CAPTURE.set(_Capture(index, t))
  try:
    with plan_lib.plan_scope(plan_lib.peek_plan()):  # (its notes and reads are not the step's)
      jax.make_jaxpr(run)(*shapes)
  except _Reached as reached:
    return reached.traced
  finally:
    _CAPTURE.reset(token)
  raise ValueError("the step traced again did not call its gradient as often")


def _at_microbatch(x, reading: batch_context.Context, k: int) -> Any:
  axis = reading.batch_axis_of(x)
  axis = axis.axis if isinstance(axis, batch_axis.Batched) else axis
  if axis is None:
    return micro_program.abstract_of(x)
  return micro_program.microbatch_of(x, x.shape[axis] // k, axis)
