"""Attributes of a module or class swapped while a guard traces, restored after the last.

Counted under a lock: nested and concurrent traces swap once and restore once, so another
thread never sees a half-restored module.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Mapping


class WhileTracing:
  """One set of swaps (one per patched object)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._depth = 0
    self._saved: dict[str, Any] = {}

  def original(self, name: str) -> Any:
    """The attribute as it was before the swap (while swapped)."""
    return self._saved[name]

  @contextlib.contextmanager
  def swapped(self, target: Any, replacements: Mapping[str, Any]) -> Iterator[None]:
    with self._lock:
      if self._depth == 0:
        self._saved = {name: getattr(target, name) for name in replacements}
        for name, value in replacements.items():
          setattr(target, name, value)
      self._depth += 1
    try:
      yield
    finally:
      with self._lock:
        self._depth -= 1
        if self._depth == 0:
          for name, value in self._saved.items():
            setattr(target, name, value)
