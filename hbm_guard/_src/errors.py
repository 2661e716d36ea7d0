"""hbm_guard's errors: one class per error, each with a message and a docs link.

Follows flax.errors: the class docstring explains, the message says what to do.
"""

from __future__ import annotations

import jax

_DOCS = "https://github.com/hbm-guard/hbm_guard/blob/main/README.md"


class HbmGuardError(Exception):
  """Base class: appends the link to the class's explanation."""

  def __init__(self, message: str):
    anchor = f"{_DOCS}#{type(self).__name__.lower()}"
    if anchor not in message:
      message = f"{message} ({anchor})"
    super().__init__(message)


class LadderExhaustedError(jax.errors.JaxRuntimeError):
  """No plan on the fallback ladder fits the step in memory.

  A subclass of jax's runtime error, so `except jax.errors.JaxRuntimeError` still catches
  it; raised from the compiler's last out-of-memory error. `report_path` names the
  post-mortem JSON, `attempts` holds every attempt.
  """

  def __init__(self, message: str, *, report_path=None, attempts=()):
    super().__init__(message)
    self.report_path = report_path
    self.attempts = tuple(attempts)

  def __reduce__(self):
    return (LadderExhaustedError, (str(self),))


class UnevenMicrobatchError(HbmGuardError, ValueError):
  """The batch does not split into the plan's number of microbatches.

  hbm_guard never drops examples to make a split even: pick a batch divisible by the
  microbatch count, or let the ladder choose a count that divides it.
  """


class InvalidLadderError(HbmGuardError, ValueError):
  """A ladder definition names an unknown rung kind or an invalid semantic class."""


class UnknownTargetError(HbmGuardError, ValueError):
  """`target=` or `capacity=` names no known device or topology."""
