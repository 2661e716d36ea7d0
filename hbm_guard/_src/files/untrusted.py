"""Reading files other people wrote (cache entries, plan files, reports) at bounded cost.

Such a file may be a symlink to `/dev/zero`, a FIFO nobody writes, gigabytes, or JSON
nested 200,000 deep. `read_json` opens regular files only, never follows a link, never
blocks, reads at most `max_bytes`, and turns every way of failing into one `ValueError`
(`UntrustedFileError`) that says why.
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

MiB = 1 << 20


class UntrustedFileError(ValueError):
  """A file that is not a readable, bounded, regular JSON file."""


def read_bytes(path: str | os.PathLike, *, max_bytes: int) -> bytes:
  """The bytes of a regular file of at most `max_bytes`; never a link, FIFO or device."""
  flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
  try:
    fd = os.open(path, flags)
  except OSError as e:
    raise UntrustedFileError(f"cannot open {os.fspath(path)!r}: {e.strerror or e}") from e
  try:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
      raise UntrustedFileError(f"{os.fspath(path)!r} is not a regular file")
    if info.st_size > max_bytes:
      raise UntrustedFileError(
          f"{os.fspath(path)!r} is {info.st_size} bytes, over the {max_bytes}-byte limit")
    chunks, total = [], 0
    while True:  # the size may change under us: bound what is read, not what was stat'ed
      chunk = os.read(fd, min(1 * MiB, max_bytes + 1 - total))
      if not chunk:
        break
      chunks.append(chunk)
      total += len(chunk)
      if total > max_bytes:
        raise UntrustedFileError(f"{os.fspath(path)!r} grew over the {max_bytes}-byte limit")
    return b"".join(chunks)
  except OSError as e:
    raise UntrustedFileError(f"cannot read {os.fspath(path)!r}: {e.strerror or e}") from e
  finally:
    os.close(fd)


def loads(text: str | bytes, *, where: str = "the input") -> Any:
  """JSON, with every way of failing (syntax, nesting depth, encoding) as one error."""
  try:
    return json.loads(text)
  except (ValueError, RecursionError, MemoryError) as e:
    raise UntrustedFileError(f"{where} is not valid JSON: {type(e).__name__}: "
                             f"{str(e)[:200]}") from None


def read_json(path: str | os.PathLike, *, max_bytes: int) -> Any:
  """JSON from a regular file of at most `max_bytes` (see `read_bytes`)."""
  return loads(read_bytes(path, max_bytes=max_bytes), where=repr(os.fspath(path)))
