"""Where hbm_guard's API meets the user's code: its frames hidden from tracebacks, as jax
hides its own (equinox's `filter_jit` does too), and a guarded step bound as a method."""

from __future__ import annotations

import functools
import os

try:
  from jax._src import traceback_util  # pylint: disable=g-import-not-at-top
  # all of hbm_guard/_src: this file is in one of its folders
  traceback_util.register_exclusion(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  api_boundary = traceback_util.api_boundary
except (ImportError, AttributeError):  # a private API: without it, tracebacks are longer
  api_boundary = lambda fun: fun  # noqa: E731


class Bound:
  """A guarded step bound to an instance, as a method (`GuardedFunction.__get__`)."""

  def __init__(self, guarded, instance):
    self._guarded, self._instance = guarded, instance
    functools.update_wrapper(self, guarded.__wrapped__)

  @api_boundary
  def __call__(self, *args, **kwargs):
    return self._guarded(self._instance, *args, **kwargs)

  def __getattr__(self, name):
    attr = getattr(self._guarded, name)
    if name in ("fit", "lower", "trace", "eval_shape"):  # each takes the step's arguments
      return functools.partial(attr, self._instance)
    return attr
