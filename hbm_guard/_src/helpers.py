"""Plan-aware building blocks: a step written with these gets the whole ladder.

They read the plan at trace time, so the guard can rebuild the step under a new plan:
- `value_and_grad`: gradient accumulation over the plan's microbatches (same global batch).
- `checkpoint` / `current_remat_policy`: per-layer rematerialisation with the plan's policy.
- `compute_dtype`: the plan's compute dtype for modules that take a `dtype`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from hbm_guard._src import errors
from hbm_guard._src import plan as plan_lib

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


@functools.cache
def _policy(name: str):
  policy = getattr(jax.checkpoint_policies, name)
  if name.startswith("offload_"):
    return policy("device", "pinned_host")
  return policy


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


def _combine_aux(aux):
  """Microbatch aux outputs: floats are averaged, integers and bools summed (counts)."""
  def one(x):
    if jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.complexfloating):
      return x.mean(axis=0)
    return x.sum(axis=0)
  return jax.tree.map(one, aux)


def value_and_grad(fun: Callable, argnums: int | Sequence[int] = 0, *,
                   batch_argnums: int | Sequence[int] = 1, has_aux: bool = False) -> Callable:
  """`jax.value_and_grad` that splits the batch into the plan's microbatches.

  With k microbatches the batch arguments (leading axis = examples) are split into k
  equal parts, gradients accumulated with `lax.scan`, and the mean loss and mean gradient
  returned: the same values as the whole batch for mean-reduced losses (to float
  rounding). Aux outputs are combined: floating arrays averaged over microbatches, integer
  and bool arrays summed. Losses that are not means over examples, and layers that
  use batch statistics (BatchNorm), see microbatches, not the global batch.

  Raises UnevenMicrobatchError when the batch does not divide into k.
  """
  batch_argnums = (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums)
  vg = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)

  @functools.wraps(fun)
  def wrapped(*args):
    k = plan_lib.plan_value("microbatches")
    sizes = {x.shape[0] for i in batch_argnums for x in jax.tree.leaves(args[i])
             if getattr(x, "ndim", 0) >= 1}
    if len(sizes) > 1:
      raise ValueError(f"hbm_guard.value_and_grad: batch arguments {batch_argnums} have "
                       f"different leading sizes {sorted(sizes)}.")
    batch = sizes.pop() if sizes else None
    plan_lib.note_fact("batch_size", batch)
    if k == 1 or batch is None:
      return vg(*args)
    if batch % k:
      raise errors.UnevenMicrobatchError(
          f"Batch of {batch} examples does not split into {k} microbatches; use a batch "
          f"divisible by {k} (hbm_guard never drops examples).",
          batch_size=batch, microbatches=k)
    split = {i: jax.tree.map(lambda x: x.reshape((k, batch // k) + x.shape[1:]), args[i])
             for i in batch_argnums}
    diff = (argnums,) if isinstance(argnums, int) else tuple(argnums)

    def grads_like(i):
      return jax.tree.map(
          lambda x: jnp.zeros(jnp.shape(x), _acc_dtype(jnp.result_type(x))), args[i])

    zero = grads_like(diff[0]) if isinstance(argnums, int) else tuple(grads_like(i) for i in diff)

    seen_dtype = []

    def body(carry, micro):
      loss_sum, grad_sum = carry
      call = list(args)
      for i in batch_argnums:
        call[i] = micro[i]
      out, g = vg(*call)
      loss, aux = out if has_aux else (out, None)
      seen_dtype.append(loss.dtype)
      grad_sum = jax.tree.map(lambda a, b: a + b.astype(a.dtype), grad_sum, g)
      return (loss_sum + loss.astype(jnp.float32), grad_sum), aux

    (loss_sum, grad_sum), auxs = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zero), split)
    ref = args[diff[0]] if isinstance(argnums, int) else tuple(args[i] for i in diff)
    grads = jax.tree.map(lambda s, r: (s / k).astype(jnp.result_type(r)), grad_sum, ref)
    loss = (loss_sum / k).astype(seen_dtype[0])
    if has_aux:
      return (loss, _combine_aux(auxs)), grads
    return loss, grads

  return wrapped


def _acc_dtype(dtype):
  """Accumulate low-precision gradients in float32."""
  if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
    return jnp.float32
  return dtype


def load_offloaded(tree):
  """In a step: bring state the plan keeps on host (pinned_host) to the device.

  Call it where the state is first needed (for optimizer state: at the update, after the
  backward pass), so the device holds it only then. Identity when the plan does not
  offload; calling it is what makes the step plan-aware for the offload rung.
  """
  if not plan_lib.plan_value("offload_optimizer"):
    return tree
  return jax.device_put(tree, jax.memory.Space.Device)


def store_offloaded(tree):
  """In a step: send state the plan keeps on host back there (pairs with load_offloaded)."""
  if not plan_lib.plan_value("offload_optimizer"):
    return tree
  return jax.device_put(tree, jax.memory.Space.Host)
