"""Plan-aware building blocks: a step written with these gets the whole ladder.

They read the plan at trace time, so the guard can rebuild the step under a new plan:
- `value_and_grad`: gradient accumulation over the plan's microbatches (same global batch).
- `checkpoint` / `current_remat_policy`: per-layer rematerialisation with the plan's policy.
- `compute_dtype`: the plan's compute dtype for modules that take a `dtype`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from hbm_guard._src.dropin import intercept
from hbm_guard._src.plans import argnums as argnums_lib
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.record import errors

# Plan names for jax.checkpoint_policies; "everything_saveable" is remat that saves all,
# i.e. the same memory as no remat: what a planned layer does before the remat rung.
_NO_REMAT = "everything_saveable"


def current_remat_policy() -> Callable[..., bool]:
  """The `jax.checkpoint` policy of the plan in force, recording that the step follows it.

  Call it at trace time, where the layer is applied, and pass the result to
  `jax.checkpoint`: each plan gets its own policy object. (jax caches remat decisions keyed
  on the policy object, so one policy whose answer changed with the plan would be served
  the decisions of an earlier trace.) Names are those of `jax.checkpoint_policies`; an
  "offload_*" name saves to pinned host memory instead of recomputing.
  """
  return _policy(plan_lib.plan_value("remat_policy") or _NO_REMAT)


_policy = plan_lib.checkpoint_policy


def checkpoint(fun: Callable, **kwargs) -> Callable:
  """`jax.checkpoint` with the plan's policy. Wrap each layer, not the whole step.

  The policy is resolved each time the layer is traced, so a layer wrapped once (at import)
  follows every plan the guard traces it under, even after a plain `jax.jit` trace.
  """
  @functools.wraps(fun)
  def planned(*args, **kw):
    return jax.checkpoint(fun, policy=current_remat_policy(), **kwargs)(*args, **kw)
  return planned


def compute_dtype(default: Any = None) -> Any:
  """The plan's compute dtype (e.g. bfloat16 after the bf16 rung), else `default`."""
  name = plan_lib.plan_value("compute_dtype")
  return jnp.dtype(name) if name else default


def _is_per_example(x, micro: int) -> bool:
  return getattr(x, "ndim", 0) >= 2 and x.shape[1] == micro  # stacked: (k, micro, ...)


def _combine_aux(stacked, micro: int, weights=None):
  """Microbatch aux outputs, stacked on a leading k axis, back to the whole batch's.

  Per-example arrays (leading axis = the microbatch) are concatenated; float scalars and
  other float arrays are averaged (weighted by each microbatch's loss weight when the
  loss is weighted); integer and bool arrays are summed (counts).
  """
  def one(x):
    if _is_per_example(x, micro):
      return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])
    if jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.complexfloating):
      if weights is None:
        return x.mean(axis=0)
      w = (weights / weights.sum()).reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype)
      return (x * w).sum(axis=0)
    return x.sum(axis=0)
  return jax.tree.map(one, stacked)


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, *,
                   batch_argnums: int | Sequence[int] | None = None,
                   batch_argnames: Sequence[str] = (), has_aux: bool = False,
                   weighted: bool = False, rng_argnums: int | Sequence[int] = (),
                   reduce_aux: Callable[[Any], Any] | None = None) -> Callable:
  """`jax.value_and_grad` that splits the batch into the plan's microbatches.

  With k microbatches the batch arguments (leading axis = examples; by position
  `batch_argnums` and/or keyword `batch_argnames`) are split into k equal parts and the
  gradients accumulated with `lax.scan`, so the global batch is the same.

  The loss, two forms:
  - `weighted=False`: `fun` returns the mean over examples. The mean of the microbatch
    means is the batch mean for equal microbatches: exact to float rounding. A weighted
    mean written inside `fun` (`sum(loss * w) / sum(w)`, the usual token-weighted LM loss)
    is NOT exact under microbatching: each microbatch divides by its own weight.
  - `weighted=True`: `fun` returns `(sum_of_losses, sum_of_weights)` (with `has_aux`:
    `((sum, weight), aux)`). Sums and weights are accumulated and divided once: the result
    is the weighted mean over the whole batch and its exact gradient, however the batch is
    split. Migrating is one line: return `(jnp.sum(loss * w), jnp.sum(w))` instead of
    `jnp.sum(loss * w) / jnp.sum(w)`.

  Aux outputs come back as for the whole batch: per-example arrays are concatenated to the
  global batch; float arrays averaged (weighted by the loss weights when `weighted`);
  integer and bool arrays summed. `reduce_aux(stacked)` replaces that for everything: it
  gets the aux with a leading microbatch axis. Random keys in `rng_argnums` are folded with
  the microbatch index, so each microbatch draws its own dropout mask: the masks differ
  from those the whole batch would draw (the same distribution, other samples).
  Layers with batch statistics (BatchNorm) see microbatches. Raises UnevenMicrobatchError
  when the batch does not divide into k.
  """
  if batch_argnums is None and not batch_argnames:
    raise TypeError("hbm_guard.value_and_grad: say which arguments hold the batch "
                    "(batch_argnums=... or batch_argnames=...).")
  split = _Split(argnums_lib.as_tuple(batch_argnums), tuple(batch_argnames),
                 argnums_lib.as_tuple(rng_argnums), argnums, weighted, has_aux, reduce_aux)
  vg = _value_and_grad(fun, argnums, has_aux, weighted)

  @functools.wraps(fun)
  def wrapped(*args, **kwargs):
    with intercept.suspended():  # the step splits its own batch: no drop-in analysis
      return split_call(*args, **kwargs)

  def split_call(*args, **kwargs):
    k = plan_lib.plan_value("microbatches")
    plan_lib.note(loss_form="weighted_sum" if weighted else "mean")
    batch = split.batch_size(args, kwargs)
    plan_lib.note(batch_size=batch)
    if k == 1 or batch is None:
      out, grads = vg(*args, **kwargs)
      loss, weight, aux = split.unpack(out)
      if not weighted:
        return split.pack(loss, aux), grads
      grads = jax.tree.map(lambda g: g / weight.astype(g.dtype), grads)
      return split.pack(loss / weight, aux), grads
    if batch % k:
      raise errors.UnevenMicrobatchError.of(batch, k)
    return split.accumulate(vg, args, kwargs, k, batch // k)

  return wrapped


def _value_and_grad(fun, argnums, has_aux: bool, weighted: bool):
  """jax.value_and_grad of `fun`; a weighted loss's weight travels in the aux."""
  if not weighted:
    return jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)

  def summed(*args, **kwargs):
    out = fun(*args, **kwargs)
    (total, weight), aux = out if has_aux else (out, None)
    return total, (weight, aux)
  return jax.value_and_grad(summed, argnums=argnums, has_aux=True)


@dataclasses.dataclass(frozen=True)
class _Split:
  """How `value_and_grad` splits a batch and puts the microbatches' results together."""
  batch_argnums: tuple[int, ...]
  batch_argnames: tuple[str, ...]
  rng_argnums: tuple[int, ...]
  argnums: int | Sequence[int]
  weighted: bool
  has_aux: bool
  reduce_aux: Callable[[Any], Any] | None

  @property
  def diff(self) -> tuple[int, ...]:
    return argnums_lib.as_tuple(self.argnums)

  def unpack(self, out):
    """(loss sum or mean, weight or None, aux or None) from one value_and_grad output."""
    if self.weighted:
      total, (weight, aux) = out
      return total, weight, aux
    if self.has_aux:
      return out[0], None, out[1]
    return out, None, None

  def pack(self, loss, aux):
    return (loss, aux) if self.has_aux else loss

  def batch_size(self, args, kwargs) -> int | None:
    leaves = [x for i in self.batch_argnums for x in jax.tree.leaves(args[i])]
    leaves += [x for n in self.batch_argnames if n in kwargs for x in jax.tree.leaves(kwargs[n])]
    sizes = {x.shape[0] for x in leaves if getattr(x, "ndim", 0) >= 1}
    if len(sizes) > 1:
      raise ValueError(f"hbm_guard.value_and_grad: batch arguments have different leading "
                       f"sizes {sorted(sizes)}.")
    return sizes.pop() if sizes else None

  def accumulate(self, vg, args, kwargs, k: int, micro: int):
    """Loss and gradients over k microbatches of `micro` examples, by `lax.scan`."""
    def split(tree):
      return jax.tree.map(lambda x: x.reshape((k, micro) + x.shape[1:]), tree)

    parts = ({i: split(args[i]) for i in self.batch_argnums},
             {n: split(kwargs[n]) for n in self.batch_argnames if n in kwargs})

    def grads_like(i):
      return jax.tree.map(
          lambda x: jnp.zeros(jnp.shape(x), _acc_dtype(jnp.result_type(x))), args[i])

    single = isinstance(self.argnums, int)
    zero = grads_like(self.diff[0]) if single else tuple(grads_like(i) for i in self.diff)
    loss_dtype = []

    def body(carry, xs):
      (pos, named), index = xs
      loss_sum, weight_sum, grad_sum = carry
      call, call_kw = list(args), dict(kwargs)
      for i in self.batch_argnums:
        call[i] = pos[i]
      call_kw.update(named)
      for i in self.rng_argnums:
        call[i] = jax.random.fold_in(args[i], index)
      out, g = vg(*call, **call_kw)
      loss, weight, aux = self.unpack(out)
      loss_dtype.append(loss.dtype)
      grad_sum = jax.tree.map(lambda a, b: a + b.astype(a.dtype), grad_sum, g)
      weight = jnp.zeros((), jnp.float32) if weight is None else weight.astype(jnp.float32)
      return ((loss_sum + loss.astype(jnp.float32), weight_sum + weight, grad_sum),
              (aux, weight))

    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zero)
    (loss_sum, weight_sum, grad_sum), (auxs, weights) = jax.lax.scan(
        body, init, (parts, jnp.arange(k)))
    denom = weight_sum if self.weighted else jnp.float32(k)
    ref = args[self.diff[0]] if single else tuple(args[i] for i in self.diff)
    grads = jax.tree.map(lambda s, r: (s / denom.astype(s.dtype)).astype(jnp.result_type(r)),
                         grad_sum, ref)
    loss = (loss_sum / denom).astype(loss_dtype[0])
    if not self.has_aux:
      return loss, grads
    if self.reduce_aux is not None:
      return (loss, self.reduce_aux(auxs)), grads
    return (loss, _combine_aux(auxs, micro, weights if self.weighted else None)), grads


def _acc_dtype(dtype):
  """Accumulate low-precision gradients in float32."""
  if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
    return jnp.float32
  return dtype
