"""jax-style argument selectors (`0`, `(0, 2)`, `"name"`, `None`) as tuples."""

from __future__ import annotations

from typing import Any


def as_tuple(x: Any, kind: type = int) -> tuple:
  """None -> (); a single `kind` -> (x,); any other iterable -> tuple(x)."""
  if x is None:
    return ()
  return (x,) if isinstance(x, kind) else tuple(x)
