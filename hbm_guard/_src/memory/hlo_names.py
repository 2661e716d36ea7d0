"""What a compiled program's names and shapes say, read from XLA's dump: the Flax module
path in an op's name stack, the layer it is in, the operation; a value's shape without its
layout, and the bytes its tiled layout adds (padding, S3.C); the compiler's own remat copies.
Pure string functions: a name that does not parse reads as none, never an error.
"""

from __future__ import annotations

import math
import re

_NUMBERED = re.compile(r"^(.*?)_?(\d+)$")
_REMAT_COPY = re.compile(r"\.remat\d*$")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
_SHAPE = re.compile(r"^(\w+)\[([\d,]*)\]")


_TRANSFORM = re.compile(r"^(?:jvp|transpose|vmap|remat|checkpoint|rematted_computation)\((.*)\)$")
_JITTED = re.compile(r"^p?jit\((.*)\)$")
# control flow and the guard's own evaluation in a name stack: no module of the user's
# (a microbatched step's ops run under "while/body/eval_jaxpr", "closed_call" in jax 0.10)
_CONTROL = frozenset({"while", "body", "cond", "scan", "eval_jaxpr", "closed_call",
                      "core_call", "checkpoint", "remat",
                      "rematted_computation", "shard_map", "branch", "custom_jvp_call",
                      "custom_vjp_call"})


def module(op_name: str) -> str | None:
  """The Flax module path in a jax name stack: "jit(step)/jvp(LM)/block_2/Dense_0/dot"
  -> "LM/block_2/Dense_0" (transforms unwrapped, jitted functions such as jnp's left out)."""
  parts = [p for p in op_name.split("/") if p]
  out = []
  for p in parts[1:-1]:
    while (m := _TRANSFORM.match(p)):
      p = m.group(1)
    if p and not _JITTED.match(p) and p not in _CONTROL:
      out.append(p)
  return "/".join(out) or None


def layer(path: str) -> str:
  """The layer a module path is in: up to its first numbered component (`LM/block_2`)."""
  out = []
  for p in path.split("/"):
    out.append(p)
    if _NUMBERED.match(p):
      break
  return "/".join(out)


def order(layer: str):
  m = _NUMBERED.match(layer)
  return (m.group(1), int(m.group(2))) if m else (layer, -1)


def op(op_name: str) -> str:
  """The operation a name stack ends with, without its parameters."""
  return op_name.rsplit("/", 1)[-1].split("[", 1)[0] if op_name else ""


def shape(text: str) -> str:
  """A value's shape without XLA's layout: "f32[8192,256]{1,0:T(8,128)}" -> "f32[8192,256]"."""
  m = _SHAPE.match(text.strip())
  return m.group(0) if m else text.split("{")[0]


def padding(text: str, size: int) -> int:
  """Bytes a tiled layout adds to a value's own (0 where its shape is not an array's)."""
  m = _SHAPE.match(text.strip())
  if not m or m.group(1) not in _DTYPE_BYTES:
    return 0
  dims = [int(d) for d in m.group(2).split(",") if d]
  logical = math.prod(dims) * _DTYPE_BYTES[m.group(1)]
  return max(0, size - logical) if logical else 0




def is_compiler_remat(name: str) -> bool:
  """Whether a value is a copy XLA's own rematerialization pass made (`fusion.141.remat2`)."""
  return bool(_REMAT_COPY.search(name))
