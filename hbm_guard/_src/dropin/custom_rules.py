"""Custom derivative rules, read by their own backward pass.

A `jax.custom_jvp` rule or a `jax.custom_vjp` backward may mix examples where its primal
does not (a tangent centred over the batch, a cotangent normalised over it). The batch
analysis reads primals; for each custom rule met on per-example values it also traces the
rule's backward pass on its own, with per-example cotangents, and asks the same analysis
whether each per-example operand gets a per-example cotangent and each other operand a batch
sum. The answer depends only on the rule, the operands' types and their tags, so it is
remembered (a softmax is met once per layer, at every trace of every plan).
"""

from __future__ import annotations

import collections
import contextvars
import threading
from typing import Any, Callable

import jax
import numpy as np

from hbm_guard._src.dropin import jaxpr_flat as flat

NAMES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
_RULE_PARAMS = ("jvp_jaxpr_fun", "jvp_jaxpr_thunk", "fwd_jaxpr_thunk", "bwd", "fwd")
_MAX_REMEMBERED = 1024

# `_IN_RULE` keeps a rule's backward from checking itself again; `SEEN` collects the
# custom_vjp rules met on per-example values (they need the cotangent jax.jit would give
# them: see auto_grad).
_IN_RULE: contextvars.ContextVar[bool] = contextvars.ContextVar("hbm_guard_in_rule",
                                                                default=False)
SEEN: contextvars.ContextVar[list | None] = contextvars.ContextVar("hbm_guard_rules_seen",
                                                                   default=None)
_remembered: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()


def check(e: flat.Eqn, ins: list, outs: list, batch: int, analyse: Callable,
          refusal: type[Exception], where: str) -> None:
  """Raises `refusal` where the rule of `e` (tags `ins` -> `outs`) mixes examples."""
  seen = SEEN.get()
  if seen is not None and e.primitive.name != "custom_jvp_call":
    seen.append(e.eqn)
  if _IN_RULE.get():
    return
  key = _key(e, ins, outs, batch)
  with _lock:
    why = _remembered.get(key, ()) if key is not None else ()
  if why == ():
    why = _why_not(e, ins, outs, batch, analyse, refusal)
    if key is not None:
      with _lock:
        _remembered[key] = why
        while len(_remembered) > _MAX_REMEMBERED:
          _remembered.popitem(last=False)
  if why is not None:
    raise refusal(f"the derivative rule of {where} {why}")


def _key(e: flat.Eqn, ins: list, outs: list, batch: int) -> tuple | None:
  """The rule's own functions (held, so their ids stay theirs), types and tags."""
  rules = tuple(getattr(e.params.get(p), "f", e.params.get(p)) for p in _RULE_PARAMS
                if e.params.get(p) is not None)
  if not rules:
    return None
  try:
    avals = tuple((tuple(v.aval.shape), str(v.aval.dtype)) if flat.is_var(v)
                  else ("literal", repr(flat.read(v, {}))) for v in e.invars)
    inner = e.params.get("call_jaxpr")
    body = tuple(x.primitive.name for x in getattr(getattr(inner, "jaxpr", inner), "eqns", ()))
    key = (e.primitive.name, rules, avals, body, tuple(ins), tuple(outs), batch)
    hash(key)
    return key
  except Exception:  # pylint: disable=broad-except  (unhashable: not remembered)
    return None


def _why_not(e: flat.Eqn, ins: list, outs: list, batch: int, analyse: Callable,
             refusal: type[Exception]) -> str | None:
  operands = [v for v in e.invars if flat.is_var(v)]
  tags_in = [t for v, t in zip(e.invars, ins) if flat.is_var(v)]
  diff = [i for i, v in enumerate(operands) if _is_float(v.aval)]
  out_diff = [i for i, v in enumerate(e.outvars) if _is_float(v.aval)]

  def backward(vals, cts):
    def primal(*xs):
      env = dict(zip(operands, vals))
      env.update(zip((operands[i] for i in diff), xs))
      flat.bind(e, env)
      return [env[e.outvars[i]] for i in out_diff]
    _, pull = jax.vjp(primal, *[vals[i] for i in diff])
    return pull(list(cts))

  token = _IN_RULE.set(True)
  try:
    closed = jax.make_jaxpr(backward)([v.aval for v in operands],
                                      [e.outvars[i].aval for i in out_diff])
    prog = flat.flatten(closed)
    given = {v: t for v, t in zip(prog.invars, [*tags_in, *(outs[i] for i in out_diff)])
             if t is not None}
    tags = analyse(prog, given, batch, closed.consts)
  except refusal as err:
    return f"mixes examples ({err})"
  except Exception as err:  # pylint: disable=broad-except  (a rule that cannot be traced alone)
    return f"could not be read ({type(err).__name__})"
  finally:
    _IN_RULE.reset(token)
  for i, v in zip(diff, prog.outvars):
    got = tags.get(v) if flat.is_var(v) else None
    want = tags_in[i]
    if not (got == want or (want is None and _is_sum(got))):
      return f"gives operand {i} a cotangent that is not per example ({got} for {want})"
  return None


def _is_sum(tag: Any) -> bool:
  return tag is None or getattr(tag, "value", None) == "sum"


def _is_float(aval) -> bool:
  try:
    return jax.dtypes.issubdtype(aval.dtype, np.inexact)
  except (AttributeError, TypeError):
    return False
