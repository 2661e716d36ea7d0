"""The split gradient: the step's loss traced once at the whole batch (`auto_grad`), run
microbatch by microbatch, each contributing its sums and their gradients, combined once at
the totals: the whole batch's value and gradient, however it is split."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from hbm_guard._src import auto_grad
from hbm_guard._src import batch_axis
from hbm_guard._src import jaxpr_flat as flat
from hbm_guard._src import layers
from hbm_guard._src import sum_cotangent

def _micro_program(t: auto_grad.Traced, split: auto_grad.Split, batch: int, k: int):
  """The loss traced on one microbatch, checked equation for equation against the whole."""
  m = batch // k
  diff, other, batch_vals = t.inputs()
  shapes = [_microbatch_of(x, x.shape[a] // k, a) for x, a in zip(batch_vals, t.axes)]
  try:
    closed = jax.make_jaxpr(t.g)(diff, other, shapes)
  except Exception as e:  # pylint: disable=broad-except  (a shape fixed at the batch's size)
    raise batch_axis.NotSplittable(
        f"the loss does not trace on a microbatch of {m} examples ({type(e).__name__}: "
        f"{str(e).splitlines()[0] if str(e) else ''}); a constant or an argument sized by "
        f"the whole batch (not split with it) meets per-example values") from None
  prog = flat.flatten(closed)
  if not flat.same_structure(t.prog, prog) or len(closed.consts) != len(t.closed.consts):
    raise batch_axis.NotSplittable("the loss traces differently on a microbatch")
  slot = {a: b for x, y in zip(t.prog.eqns, prog.eqns) for a, b in zip(x.outvars, y.outvars)}
  slot.update(zip(t.prog.invars, prog.invars))
  slot.update(zip(t.prog.constvars, prog.constvars))
  frontier = [slot[v] for v in split.frontier]
  outs = [prog.outvars[i] for i in split.batched_outs]
  indices = flat.needed(prog, frontier + outs, given=[slot[v] for v in split.hoisted])
  for i in indices:
    _check_shrinks(t.prog.eqns[i], prog.eqns[i], split.tags, k)
    for a, b in zip(t.prog.eqns[i].invars, prog.eqns[i].invars):
      if _literal(a) is not None and not np.array_equal(_literal(a), _literal(b)):
        raise batch_axis.NotSplittable(
            f"`{prog.eqns[i].primitive.name}` in {prog.eqns[i].name_stack or 'the loss'} uses "
            f"the batch size as a number in per-example work (e.g. x / batch_size before a sum)")
  return closed, prog, frontier, outs, indices, slot


def _check_shrinks(whole: flat.Eqn, micro: flat.Eqn, tags: dict, k: int) -> None:
  """Each per-example value of the microbatch's program is its whole-batch value's shape
  with the batch axis k times shorter. A value as long as the batch that is not split with
  it (a constant, an argument) can broadcast against a one-example microbatch and make the
  result as long as the batch again: that is caught here, not trained on."""
  for w, m in zip(whole.outvars, micro.outvars):
    tag = tags.get(w)
    if not isinstance(tag, batch_axis.Batched):
      continue
    ws, ms = tuple(w.aval.shape), tuple(m.aval.shape)
    a = tag.axis
    if (len(ws) != len(ms) or ws[:a] != ms[:a] or ws[a + 1:] != ms[a + 1:]
        or ms[a] * k != ws[a]):
      raise batch_axis.NotSplittable(
          f"{batch_axis.where(micro)} does not shrink with the microbatch ({list(ws)} at the "
          f"whole batch, {list(ms)} at a microbatch): a value as long as the batch that is "
          f"not split with it (a constant or an argument) meets per-example values")


def _microbatch_of(x, m: int, axis: int) -> jax.ShapeDtypeStruct:
  """`x`'s type with `axis` m long (a microbatch's rows): its dtype, weak type and, where
  the step is traced under a mesh, its sharding (whose absence would trace otherwise: a
  scalar meeting it is resharded, as in flax's attention masks)."""
  aval = jax.typeof(x)
  sharding = getattr(aval, "sharding", None)
  if sharding is not None and getattr(getattr(sharding, "mesh", None), "empty", True):
    sharding = None
  shape = tuple(x.shape)
  return jax.ShapeDtypeStruct(shape[:axis] + (m,) + shape[axis + 1:], x.dtype,
                              sharding=sharding, weak_type=getattr(aval, "weak_type", False))


def _parts(x, axis: int, k: int, batch: int):
  """`x` as k microbatches stacked first, (k, ...), each with the batch where `x` has it:
  microbatch i takes examples i, i+k, i+2k, ..., each with its r rows where `axis` holds
  r per example, examples major (five captions per image)."""
  y = jnp.moveaxis(x, axis, 0)
  r, rest = y.shape[0] // batch, tuple(y.shape[1:])
  y = jnp.swapaxes(y.reshape((batch // k, k, r) + rest), 0, 1)
  return jnp.moveaxis(y.reshape((k, batch // k * r) + rest), 1, axis + 1)


def _literal(atom):
  return None if flat.is_var(atom) or isinstance(atom, flat.Const) else np.asarray(atom.val)


def _acc_dtype(dtype):
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32:
    return jnp.float32
  return dtype


def _key_slots(prog: flat.Program, slots, values) -> list[int]:
  """Positions among `slots` (inputs of `prog`, with `values`) of random keys, folded per
  microbatch: typed keys, and raw uint32 key data (`jax.random.PRNGKey`) where a random op
  takes it as its key. A counter fed to `fold_in` as its data (nnx's `RngCount`) is not a
  key."""
  fed = {e.invars[0] for e in prog.eqns if e.invars and flat.is_var(e.invars[0])
         and e.primitive.name.startswith(("random_", "threefry"))}  # (a literal: unhashable)
  return [i for i, (v, c) in enumerate(zip(slots, values))
          if auto_grad.is_key(c) or (v in fed and jnp.dtype(c.dtype) == jnp.uint32 and c.ndim >= 1)]


def microbatched(t: auto_grad.Traced, split: auto_grad.Split, batch: int, k: int,
                 policy: str | None, ctx: auto_grad.Context):
  """(outputs, gradient leaves) of the loss over k microbatches: the whole batch's."""
  closed, prog, frontier, outs, indices, slot = _micro_program(t, split, batch, k)
  constrain = ctx.constraint({slot[v]: tag for v, tag in split.tags.items() if v in slot})
  segments, _ = layers.segments(prog, indices, prog.invars[:t.n_diff])
  wrap = auto_grad.wrap_policy(policy)
  diff, other, batch_vals = t.inputs()
  # Microbatch i takes examples i, i+k, i+2k, ...: a batch sharded over devices (data
  # parallel) gives each device an equal share of every microbatch.
  parts = [_parts(x, a, k, batch) for x, a in zip(batch_vals, t.axes)]
  keys = _key_slots(prog, prog.constvars, closed.consts)
  other_keys = _key_slots(prog, prog.invars[t.n_diff:t.n_diff + len(other)], other)
  dep = [j for j, d in enumerate(split.dep) if d]
  stats = _hoisted_values(t, split)
  hoisted = [slot[v] for v in split.hoisted]

  def per_micro(d, micro, i, wanted=None):
    consts, own = list(closed.consts), list(other)
    for p in keys:  # each microbatch draws its own random numbers
      consts[p] = jax.random.fold_in(consts[p], i)
    for p in other_keys:
      own[p] = jax.random.fold_in(own[p], i)
    env = dict(zip(prog.constvars, consts))
    env.update(zip(prog.invars, [*d, *own, *micro]))
    env.update(zip(hoisted, stats))
    if wanted is not None:
      return flat.evaluate(prog, env, flat.needed(prog, wanted, given=hoisted), wanted)
    vals = flat.evaluate(prog, env, indices, frontier + outs, segments, wrap, constrain)
    sums, bouts = vals[:len(frontier)], vals[len(frontier):]
    return [sums[j] for j in dep], (sums, bouts)

  if split.known_cotangent is None:
    split = dataclasses.replace(split, known_cotangent=auto_grad.known_cotangent(
        t, split.frontier, split.dep))
  if split.known_cotangent:
    cotangents = [_known_cotangent(t, split, frontier, dep, parts, k, per_micro)]
  else:
    cotangents = [_unit_cotangent(frontier, dep, j, e) for j in dep
                  for e in range(int(np.prod(frontier[j].aval.shape)))]

  def body(carry, xs):
    totals, grads = carry
    micro, i = xs
    _, vjp, (sums, bouts) = jax.vjp(lambda d: per_micro(d, micro, i), diff, has_aux=True)
    new = [vjp(cot)[0] for cot in cotangents]
    totals = [a + s.astype(a.dtype) for a, s in zip(totals, sums)]
    grads = [[a + g.astype(a.dtype) for a, g in zip(acc, gs)] for acc, gs in zip(grads, new)]
    return (totals, grads), bouts

  zeros = ([jnp.zeros(v.aval.shape, _acc_dtype(v.aval.dtype)) for v in frontier],
           [[jnp.zeros(x.shape, _acc_dtype(x.dtype)) for x in diff] for _ in cotangents])
  (totals, grads), stacked = jax.lax.scan(body, zeros, (parts, jnp.arange(k)))
  totals = [s.astype(v.aval.dtype) for s, v in zip(totals, split.frontier)]
  basis = None if split.known_cotangent else [
      (j, e) for j in dep for e in range(int(np.prod(frontier[j].aval.shape)))]
  return _combine(t, split, totals, grads, basis, stacked, batch // k)


def _hoisted_values(t: auto_grad.Traced, split: auto_grad.Split) -> list:
  """The parameter-free batch statistics, over the whole batch (no gradient reaches them)."""
  if not split.hoisted:
    return []
  diff, other, batch_vals = t.inputs()
  env = dict(zip(t.prog.constvars, t.closed.consts))
  env.update(zip(t.prog.invars, [*diff, *other, *batch_vals]))
  wanted = list(split.hoisted)
  return [jax.lax.stop_gradient(v) for v in
          flat.evaluate(t.prog, env, flat.needed(t.prog, wanted), wanted)]


def _unit_cotangent(frontier, dep, j, e) -> list:
  cot = [jnp.zeros(frontier[q].aval.shape, frontier[q].aval.dtype) for q in dep]
  q = dep.index(j)
  cot[q] = cot[q].reshape(-1).at[e].set(1).reshape(cot[q].shape)
  return cot


def _known_cotangent(t: auto_grad.Traced, split: auto_grad.Split, frontier, dep, parts, k,
                     per_micro) -> list:
  """The sums' cotangent under jax.jit: from the sums that do not depend on the parameters
  (totalled first, in a forward pass over the microbatches), where it reads any."""
  free = [j for j, d in enumerate(split.dep) if not d]
  diff, other, batch_vals = t.inputs()
  loss = sum_cotangent.combined_fn(t.prog, t.closed.consts, split.frontier, split.dep,
                                   t.n_diff, other, batch_vals)
  free_totals = []
  if free:
    wanted = [frontier[j] for j in free]

    def add(totals, xs):
      micro, i = xs
      vals = per_micro(diff, micro, i, wanted)
      return [a + v.astype(a.dtype) for a, v in zip(totals, vals)], None
    init = [jnp.zeros(v.aval.shape, _acc_dtype(v.aval.dtype)) for v in wanted]
    free_totals, _ = jax.lax.scan(add, init, (parts, jnp.arange(k)))
    free_totals = [s.astype(v.aval.dtype) for s, v in zip(free_totals, wanted)]
  cot = sum_cotangent.value(loss, [frontier[j].aval for j in dep], free_totals, diff)
  return [c.astype(frontier[j].aval.dtype) for c, j in zip(cot, dep)]


def _combine(t: auto_grad.Traced, split: auto_grad.Split, totals, grads, basis, stacked,
             m: int):
  """The loss's outputs and gradients from the totals: with a known cotangent the
  microbatches' pullbacks are the sums' whole gradient; otherwise each sum's gradient
  (`basis`, one per element) is scaled by the totals' cotangent."""
  prog = t.prog
  diff, other, batch_vals = t.inputs()
  rest = [i for i in range(len(prog.outvars)) if i not in split.batched_outs]
  targets = [prog.outvars[i] for i in rest]
  indices = flat.needed(prog, targets, given=split.frontier)

  def combined(sums, d):
    env = dict(zip(prog.constvars, t.closed.consts))
    env.update(zip(prog.invars, [*d, *other, *batch_vals]))
    env.update(zip(split.frontier, sums))
    vals = flat.evaluate(prog, env, indices, targets)
    return vals[0], vals

  if basis is None:
    loss, vjp, vals = jax.vjp(lambda d: combined(totals, d), diff, has_aux=True)
    (g_direct,) = vjp(jnp.ones_like(loss))
    g_sums = None
  else:
    loss, vjp, vals = jax.vjp(combined, totals, diff, has_aux=True)
    g_sums, g_direct = vjp(jnp.ones_like(loss))
  out = [None] * len(prog.outvars)
  for i, v in zip(rest, vals):
    out[i] = v
  for i, ys in zip(split.batched_outs, stacked):
    out[i] = _unsplit(ys, split.tags[prog.outvars[i]].axis, m)
  result = []
  for n, (x, gd) in enumerate(zip(diff, g_direct)):
    g = gd.astype(_acc_dtype(x.dtype))
    if basis is None:
      g = g + grads[0][n].astype(g.dtype)
    else:
      for b, (j, e) in enumerate(basis):
        g = g + g_sums[j].reshape(-1)[e].astype(g.dtype) * grads[b][n]
    result.append(g.astype(x.dtype))
  return out, result


def _unsplit(ys, axis: int, m: int):
  """Per-example outputs stacked per microbatch, (k, ...), back in the batch's order:
  microbatch i held examples i, i+k, ...; the batch (m per microbatch) is the major factor
  of `axis`, whose other factor r (a merged sequence) stays innermost."""
  k, shape = ys.shape[0], ys.shape[1:]
  r = shape[axis] // m
  x = jnp.moveaxis(ys, 0, axis)  # (..., k, m * r, ...)
  x = x.reshape(shape[:axis] + (k, m, r) + shape[axis + 1:])
  x = jnp.swapaxes(x, axis, axis + 1)  # (..., m, k, r, ...): example j * k + i
  return x.reshape(shape[:axis] + (m * k * r,) + shape[axis + 1:])
