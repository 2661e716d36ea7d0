"""Whether the drop-in can follow the installed jax's gradient functions: checked once
per process against the shape of jax's own `value_and_grad_f` (the names `intercept._vjp`
reads from its frame), and said where it cannot, never a silent fallback."""

from __future__ import annotations

import dataclasses
import inspect
import types
from typing import Any, Callable

import jax

# what `intercept._vjp` reads from jax's value_and_grad_f frame: the call it intercepts
FRAME_NAMES = frozenset({"fun", "argnums", "has_aux", "args", "kwargs", "holomorphic",
                         "allow_int"})


def nested_code(fun: Callable, name: str) -> types.CodeType | None:
  """The code of the function `name` defined inside `fun` (None where jax moved it)."""
  code = getattr(inspect.unwrap(fun), "__code__", None)
  return next((c for c in (code.co_consts if code else ())
               if isinstance(c, types.CodeType) and c.co_name == name), None)


@dataclasses.dataclass(frozen=True)
class Following:
  """Whether the drop-in follows this jax's gradient functions: `jax.value_and_grad` /
  `jax.grad` by attribute always; bound before the trace (`from jax import grad`) only
  where jax's own `value_and_grad_f` is the one it knows. Checked once per process, and
  said (the progress log, each gradient's note) where it is not: never a silent fallback."""
  bound_names: bool
  why_not: str | None = None

  def message(self) -> str | None:
    if self.bound_names:
      return None
    return (f"the drop-in could not follow `jax.value_and_grad` / `jax.grad` bound before "
            f"the trace in jax {jax.__version__} ({self.why_not}): a step that imported "
            f"them by name runs jax's own gradient, not split; call them as `jax.grad`, "
            f"use `hbm_guard.value_and_grad`, or pin jax to a version hbm_guard knows")


def check(api: Any, value_and_grad_f: types.CodeType | None) -> Following:
  """`Following` for jax's api module (`jax._src.api`) and its value_and_grad_f's code."""
  if api is None or not hasattr(api, "vjp"):
    return Following(False, "jax._src.api has no `vjp`")
  if value_and_grad_f is None:
    return Following(False, "jax.value_and_grad defines no `value_and_grad_f`")
  code = value_and_grad_f
  missing = FRAME_NAMES - {*code.co_varnames, *code.co_cellvars, *code.co_freevars}
  if missing:
    return Following(False, f"its value_and_grad_f has no {', '.join(sorted(missing))}")
  return Following(True)
