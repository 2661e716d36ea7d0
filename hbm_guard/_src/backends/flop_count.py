"""A step's arithmetic, counted from its jaxpr: what prices one plan against another.

The planner ranks plans by compute. A lowering's `cost_analysis` counts it too, but at
real size lowering and costing the step again for each program took ~2 s of a ~5-s price
(368M parameters), on top of the trace every price needs; the jaxpr is what the trace
already holds. Counted as XLA's cost analysis of the unoptimised program counts: a dot
is 2 x its output x its contracted size, a convolution likewise, any other operation one
per output element; a `scan` its body times its length, a `cond` its dearest branch, a
`while` its body once (its trip count is not in the program); a checkpoint's recompute
is in the backward pass's own equations.
"""

from __future__ import annotations

import math
from typing import Any, Iterator

from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: not public
from jax.extend import core as jcore


def count(jaxpr: Any) -> float:
  """The flops of a `jax.jit(...).trace(...).jaxpr`, its dead code aside (as lowering
  drops it: `jax.grad` of a checkpoint traces a forward pass nothing reads)."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  try:
    jaxpr, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))
  except Exception:  # pylint: disable=broad-except  (a jax without it: counted as traced)
    pass
  return _count(jaxpr)


def _count(jaxpr: Any) -> float:
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  return float(sum(_equation(eqn) for eqn in jaxpr.eqns))


def _size(var) -> int:
  shape = getattr(getattr(var, "aval", None), "shape", ())
  return math.prod(shape)


def _inner(params: dict[str, Any]) -> Iterator[Any]:
  for value in params.values():
    for v in value if isinstance(value, (tuple, list)) else (value,):
      if isinstance(v, (jcore.ClosedJaxpr, jcore.Jaxpr)):
        yield v


def _equation(eqn) -> float:
  name, params = eqn.primitive.name, eqn.params
  if name == "scan":
    return params["length"] * _count(params["jaxpr"])
  if name == "cond":
    return max((_count(b) for b in params["branches"]), default=0.0)
  inner = list(_inner(params))
  if inner:  # jit, checkpoint, custom_jvp/vjp, while, shard_map, ...: their bodies, once
    return sum(_count(j) for j in inner)
  out = sum(_size(v) for v in eqn.outvars)
  if name == "dot_general":
    (contracting, _), _ = params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    return 2.0 * out * math.prod(lhs[d] for d in contracting)
  if name == "conv_general_dilated":
    rhs = eqn.invars[1].aval.shape
    out_features = rhs[params["dimension_numbers"].rhs_spec[0]]
    return 2.0 * out * math.prod(rhs) / max(1, out_features)
  return float(out)
