"""An unmodified step's gradient, microbatched exactly and rematerialised per layer.

Called (by `intercept`) in place of `jax.value_and_grad(fun, ...)(*args)` while the guard
traces a step. The loss is traced once at the whole batch: `batch_axis` follows the batch
through it. When the loss is a function of sums over the batch (a mean, a token-weighted
`sum(l * w) / sum(w)`), each microbatch contributes its sums and their gradients, and the
function of the sums is applied once to the totals (chain rule over the sums): the whole
batch's value and gradient, however it is split. Repeated layers (`block_0`, `block_1`, ...
in the jaxpr's name stacks) are each checkpointed with the plan's remat policy.
Under the default plan the step's own `jax.value_and_grad` runs: the program is unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np

from hbm_guard._src.dropin import batch_context
from hbm_guard._src.dropin import closure
from hbm_guard._src.dropin import jaxpr_flat as flat
from hbm_guard._src.dropin import layers
from hbm_guard._src.plans import plan as plan_lib

Context = batch_context.Context


@dataclasses.dataclass
class Traced:
  """The loss traced at the whole batch, with where its inputs came from."""
  fun: Callable
  diff: tuple[int, ...]
  leaves: list  # args' and kwargs' leaves
  treedef: Any
  kinds: list[str]  # per leaf: "diff" | "batch" | "other" | "static" (not an array)
  captured: list  # batch values the loss closes over
  out_tree: list  # [treedef] of the loss's output, filled by tracing
  closed: Any = None
  prog: flat.Program | None = None
  state_ids: frozenset[int] = frozenset()  # the step's state leaves: never the batch
  axes: tuple[int, ...] = ()  # per batch value (`inputs()[2]`): the axis holding the batch
  # where `captured` sit among the arrays of the step's trace the loss closes over (how
  # many), to take them at the same places from another trace of the step
  captured_at: tuple[int, ...] = ()
  n_closure: int = 0
  # The loss traced again from the step's own call at a microbatch of 1/k of the batch
  # (`again(k)`: a Traced, or NotSplittable), where the step gives one (`intercept`).
  again: Callable[[int], "Traced"] | None = None

  @property
  def n_diff(self) -> int:
    return sum(k == "diff" for k in self.kinds)

  def inputs(self, batch_vals=None):
    diff = [x for x, k in zip(self.leaves, self.kinds) if k == "diff"]
    other = [x for x, k in zip(self.leaves, self.kinds) if k == "other"]
    batch = [x for x, k in zip(self.leaves, self.kinds) if k == "batch"] + self.captured
    return diff, other, batch if batch_vals is None else batch_vals

  def g(self, diff, other, batch):
    """The loss as a function of (differentiated, other, batch) leaves."""
    it = {"diff": iter(diff), "other": iter(other), "batch": iter(batch),
          "static": (x for x, k in zip(self.leaves, self.kinds) if k == "static")}
    leaves = [next(it[k]) for k in self.kinds]
    rest = list(it["batch"])
    fun = closure.substitute(closure.fresh(self.fun),
                             {id(c): v for c, v in zip(self.captured, rest)})
    args, kwargs = jax.tree_util.tree_unflatten(self.treedef, leaves)
    out_leaves, tree = jax.tree_util.tree_flatten(fun(*args, **kwargs))
    self.out_tree[:] = [tree]
    return out_leaves


def normalized_argnums(argnums, n_args: int) -> tuple[int, ...]:
  """jax's `argnums` as non-negative positions (`-1`: the last argument)."""
  diff = (argnums,) if isinstance(argnums, int) else tuple(argnums)
  return tuple(i % n_args if -n_args <= i < 0 else i for i in diff)


def trace(fun, argnums, args, kwargs, ctx: Context) -> Traced:
  diff = normalized_argnums(argnums, len(args))
  kinds, leaves = [], []
  for i, a in enumerate(args):
    for x in jax.tree.leaves(a):
      leaves.append(x)
      kinds.append("diff" if i in diff else _kind(x, ctx))
  for x in jax.tree.leaves(kwargs):
    leaves.append(x)
    kinds.append(_kind(x, ctx))
  treedef = jax.tree_util.tree_structure((args, kwargs))
  explicit = {id(x) for x in leaves}
  anyway = dataclasses.replace(ctx, inputs_only=False)
  tracers = _closed_over(fun, explicit)
  sized = [x for x in tracers if anyway.is_batch(x)]
  captured = [x for x in sized if ctx.is_batch(x)]
  # batch-sized values this reading takes as not the batch: constants of the loss
  not_batch = frozenset(id(x) for x in sized if not ctx.is_batch(x))
  batch = [x for x, k in zip(leaves, kinds) if k == "batch"] + captured
  at = {id(x): i for i, x in enumerate(tracers)}
  t = Traced(fun, diff, leaves, treedef, kinds, captured, [],
             state_ids=ctx.state_ids | ctx.apart_ids | not_batch,
             axes=tuple(ctx.batch_axis_of(x) for x in batch),
             captured_at=tuple(at[id(x)] for x in captured), n_closure=len(tracers))
  t.closed = jax.make_jaxpr(t.g)(*t.inputs())
  t.prog = flat.flatten(t.closed)
  return t


def trace_like(t: Traced, fun, args, kwargs) -> Traced:
  """The loss of `t` as another trace of the step calls it (at a microbatch's shapes):
  its inputs taken where `t` took them. Raises ValueError where the call differs."""
  leaves = jax.tree.leaves((args, kwargs))
  treedef = jax.tree_util.tree_structure((args, kwargs))
  tracers = _closed_over(fun, {id(x) for x in leaves})
  if treedef != t.treedef or len(tracers) != t.n_closure:
    raise ValueError("the step calls its gradient with other arguments on a microbatch")
  u = Traced(fun, t.diff, leaves, treedef, list(t.kinds), [tracers[i] for i in t.captured_at],
             [], state_ids=t.state_ids, axes=t.axes)
  u.closed = jax.make_jaxpr(u.g)(*u.inputs())
  u.prog = flat.flatten(u.closed)
  return u


def _closed_over(fun, explicit: set) -> list:
  """The traced arrays `fun` closes over (not among its arguments), in a stable order."""
  return [x for x in closure.find(fun, lambda x: isinstance(x, jax.core.Tracer))
          if id(x) not in explicit]


def _kind(x, ctx: Context) -> str:
  """A leaf the loss is not differentiated by: the batch, another array, or, as jax.grad
  passes it, anything else unchanged (a function, a module, a config, a Python number)."""
  if ctx.is_batch(x):
    return "batch"
  if isinstance(x, (jax.Array, np.ndarray, np.generic, jax.core.Tracer)):
    return "other"
  return "static"


def wrap_policy(policy_name: str | None):
  if policy_name is None or policy_name == "everything_saveable":
    return None
  policy = plan_lib.checkpoint_policy(policy_name)
  return lambda f: jax.checkpoint(f, policy=policy, prevent_cse=True)


def whole_batch(t: Traced, policy: str | None, vg: Callable, constrain=None):
  """(outputs, gradient leaves) over the whole batch: each repeated layer checkpointed with
  `policy`, per-example values kept where `constrain` puts them."""
  prog = t.prog
  indices = list(range(len(prog.eqns)))
  segments, _ = layers.segments(prog, indices, prog.invars[:t.n_diff])
  diff, other, batch_vals = t.inputs()
  wrap = wrap_policy(policy)

  def f(d):
    env = dict(zip(prog.constvars, t.closed.consts))
    env.update(zip(prog.invars, [*d, *other, *batch_vals]))
    vals = flat.evaluate(prog, env, indices, list(prog.outvars), segments, wrap, constrain)
    return vals[0], vals

  (_, vals), grads = vg(f, has_aux=True)(diff)
  return vals, grads


def unflatten(t: Traced, out_leaves, grad_leaves, args):
  """The loss's outputs and the gradients in the structures jax's own would have."""
  out = jax.tree_util.tree_unflatten(t.out_tree[0], out_leaves)
  structs = [jax.tree_util.tree_structure(args[i]) for i in t.diff]
  it = iter(grad_leaves)
  grads = [jax.tree_util.tree_unflatten(s, [next(it) for _ in range(s.num_leaves)])
           for s in structs]
  return out, grads
