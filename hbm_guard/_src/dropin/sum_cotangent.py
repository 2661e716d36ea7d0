"""The cotangent jax.jit gives a loss's batch sums, where it is known before the totals.

A loss combined from batch sums, `L(S_1, ..., S_n, params)`, pulls back through each sum with
the cotangent `dL/dS_j`. For a mean that is `1/B`; for a token-weighted mean
`sum(l * w) / sum(w)` it is `1/sum(w)`, which needs only the sums that do not depend on the
parameters. Where the cotangent reads neither the parameters nor the sums that depend on
them, each microbatch can be differentiated with the very cotangent jax.jit would give it:
a custom derivative rule inside then sees what it sees under jax.jit, and one pullback per
microbatch replaces one per element of the sums.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from hbm_guard._src.dropin import jaxpr_flat as flat


def combined_fn(prog: flat.Program, consts: Sequence[Any], frontier: Sequence[Any],
                dep: Sequence[bool], n_diff: int, other: Sequence[Any],
                batch_vals: Sequence[Any]) -> Callable:
  """`(dep sums, other sums, differentiated leaves) -> loss`: the part after the sums."""
  target = prog.outvars[0]
  indices = flat.needed(prog, [target], given=frontier)
  dep_slots = [v for v, d in zip(frontier, dep) if d]
  free_slots = [v for v, d in zip(frontier, dep) if not d]

  def loss(dep_sums, free_sums, diff):
    env = dict(zip(prog.constvars, consts))
    env.update(zip(prog.invars, [*diff, *other, *batch_vals]))
    env.update(zip(dep_slots, dep_sums))
    env.update(zip(free_slots, free_sums))
    return flat.evaluate(prog, env, indices, [target])[0]
  return loss


def known_in_advance(loss: Callable, dep_avals, free_avals, diff) -> bool:
  """Whether `dL/d(dep sums)` reads neither the dependent sums nor the parameters: read
  from the gradient's own program, so a `where` or a `log` of a dependent sum says no."""
  if not dep_avals:
    return True
  grad = jax.grad(loss, argnums=0)
  try:
    closed = jax.make_jaxpr(grad)(list(dep_avals), list(free_avals), list(diff))
  except Exception:  # pylint: disable=broad-except  (not differentiable alone: not known)
    return False
  prog = flat.flatten(closed)
  n_dep = len(dep_avals)
  n_free = len(free_avals)
  roots = set(prog.invars[:n_dep]) | set(prog.invars[n_dep + n_free:])
  reached = set(roots)
  for e in prog.eqns:
    if any(flat.is_var(v) and v in reached for v in e.invars):
      reached.update(e.outvars)
  return not any(flat.is_var(v) and v in reached for v in prog.outvars)


def value(loss: Callable, dep_avals, free_totals, diff, dep_totals=None) -> list:
  """The cotangent of the dependent sums at their totals (`dep_totals`); known in advance,
  it reads none of them, and is evaluated at zero sums."""
  at = dep_totals if dep_totals is not None else [jnp.zeros(a.shape, a.dtype) for a in dep_avals]
  return list(jax.grad(loss, argnums=0)(list(at), list(free_totals), list(diff)))
