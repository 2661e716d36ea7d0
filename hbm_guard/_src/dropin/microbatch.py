"""The split gradient: the step's loss traced once at the whole batch (`auto_grad`), run
microbatch by microbatch, each contributing its sums and their gradients, combined once at
the totals: the whole batch's value and gradient, however it is split."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hbm_guard._src.dropin import auto_grad
from hbm_guard._src.dropin import batch_axis
from hbm_guard._src.dropin import batch_context
from hbm_guard._src.dropin import jaxpr_flat as flat
from hbm_guard._src.dropin import layers
from hbm_guard._src.dropin import loss_split
from hbm_guard._src.dropin import sum_cotangent


def _parts(x, axis: int, k: int, batch: int, segments: int = 1):
  """`x` as k microbatches stacked first, (k, ...), each with the batch where `x` has it:
  microbatch i takes examples i, i+k, i+2k, ..., each with its r rows where `axis` holds
  r per example, examples major (five captions per image); in each segment alike where the
  axis holds the batch in segments (`[chosen; rejected]`)."""
  y = jnp.moveaxis(x, axis, 0)
  s = segments
  r, rest = y.shape[0] // (s * batch), tuple(y.shape[1:])
  y = y.reshape((s, batch // k, k, r) + rest)
  y = jnp.moveaxis(y, 2, 0)  # (k, s, batch // k, r, ...)
  return jnp.moveaxis(y.reshape((k, s * (batch // k) * r) + rest), 1, axis + 1)


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
          if batch_context.is_key(c) or (v in fed and jnp.dtype(c.dtype) == jnp.uint32 and c.ndim >= 1)]


def microbatched(t: auto_grad.Traced, split: loss_split.Split, batch: int, k: int,
                 policy: str | None, ctx: batch_context.Context):
  """(outputs, gradient leaves) of the loss over k microbatches: the whole batch's."""
  micro = split.micro
  if micro is None or split.scheme is None:
    raise ValueError("the split was not analysed for microbatches")  # (a bug: see intercept)
  closed, prog, frontier, outs, indices = (micro.closed, micro.prog, micro.frontier,
                                           micro.outs, micro.indices)
  slot = micro.slot
  constrain = ctx.constraint({slot[v]: tag for v, tag in split.tags.items() if v in slot})
  segments, _ = layers.segments(prog, indices, prog.invars[:t.n_diff])
  wrap = auto_grad.wrap_policy(policy)
  diff, other, batch_vals = t.inputs()
  # Microbatch i takes examples i, i+k, i+2k, ...: a batch sharded over devices (data
  # parallel) gives each device an equal share of every microbatch.
  parts = [_parts(x, a, k, batch) if not isinstance(a, batch_axis.Batched)
           else _parts(x, a.axis, k, batch, a.segments) for x, a in zip(batch_vals, t.axes)]
  keys = _key_slots(prog, prog.constvars, closed.consts)
  other_keys = _key_slots(prog, prog.invars[t.n_diff:t.n_diff + len(other)], other)
  dep = [j for j, d in enumerate(split.dep) if d]
  stats, shares = _whole_batch_values(t, split, k, batch)
  hoisted = [slot[v] for v in split.hoisted]
  shared = [slot[v] for v, _ in split.split]

  def per_micro(d, micro_vals, i, wanted=None, statistics=None):
    micro_in, micro_shares = micro_vals
    consts, own = list(closed.consts), list(other)
    for p in keys:  # each microbatch draws its own random numbers
      consts[p] = jax.random.fold_in(consts[p], i)
    for p in other_keys:
      own[p] = jax.random.fold_in(own[p], i)
    env = dict(zip(prog.constvars, consts))
    env.update(zip(prog.invars, [*d, *own, *micro_in]))
    env.update(zip(hoisted, stats))
    env.update(zip(shared, micro_shares))
    env.update(statistics or {})  # {microbatch slot: a statistic's total}
    if wanted is not None:  # (the statistics known so far given: a later one is computed)
      known = [*hoisted, *shared, *(statistics or {})]
      return flat.evaluate(prog, env, flat.needed(prog, wanted, given=known), wanted)
    vals = flat.evaluate(prog, env, indices, frontier + outs, segments, wrap, constrain)
    sums, bouts = vals[:len(frontier)], vals[len(frontier):]
    return [sums[j] for j in dep], (sums, bouts)

  xs = ((parts, shares), jnp.arange(k))
  if split.scheme is loss_split.Scheme.STAGED:
    return _staged(t, split, per_micro, xs, stats, dep, batch // k)
  if split.scheme is loss_split.Scheme.PER_ELEMENT:
    cotangents = [_unit_cotangent(frontier, dep, j, e) for j in dep
                  for e in range(int(np.prod(frontier[j].aval.shape)))]
  else:
    cotangents = [_cotangent(t, split, frontier, dep, xs, per_micro)]

  def body(carry, x):
    totals, grads = carry
    micro_vals, i = x
    _, vjp, (sums, bouts) = jax.vjp(lambda d: per_micro(d, micro_vals, i), diff, has_aux=True)
    new = [vjp(cot)[0] for cot in cotangents]
    totals = [a + s.astype(a.dtype) for a, s in zip(totals, sums)]
    grads = [[a + g.astype(a.dtype) for a, g in zip(acc, gs)] for acc, gs in zip(grads, new)]
    return (totals, grads), bouts

  zeros = ([jnp.zeros(v.aval.shape, _acc_dtype(v.aval.dtype)) for v in frontier],
           [[jnp.zeros(x.shape, _acc_dtype(x.dtype)) for x in diff] for _ in cotangents])
  (totals, grads), stacked = jax.lax.scan(body, zeros, xs)
  totals = [s.astype(v.aval.dtype) for s, v in zip(totals, split.frontier)]
  basis = None if split.scheme is not loss_split.Scheme.PER_ELEMENT else [
      (j, e) for j in dep for e in range(int(np.prod(frontier[j].aval.shape)))]
  return _combine(t, split, totals, grads, basis, stacked, batch // k)


def _total(per_micro, xs, d, wanted, statistics=None, extrema=()) -> list:
  """The sums `wanted` (microbatch slots) totalled over the microbatches, forward only;
  `extrema` (tags by position) for a maximum or minimum: the microbatches' combined so."""
  kinds = list(extrema) or [None] * len(wanted)

  def add(acc, x):
    micro_vals, i = x
    vals = per_micro(d, micro_vals, i, wanted, statistics)
    return [_COMBINE.get(kind, jnp.add)(a, v.astype(a.dtype))
            for a, v, kind in zip(acc, vals, kinds)], None
  init = [_identity(v.aval, kind) for v, kind in zip(wanted, kinds)]
  summed, _ = jax.lax.scan(add, init, xs)
  return [s.astype(v.aval.dtype) for s, v in zip(summed, wanted)]


_COMBINE = {batch_axis.tags.MAX: jnp.maximum, batch_axis.tags.MIN: jnp.minimum}


def _identity(aval, kind):
  """Where a total starts: 0 for a sum, the dtype's lowest (highest) for a max (min)."""
  dtype = _acc_dtype(aval.dtype)
  if kind is None:
    return jnp.zeros(aval.shape, dtype)
  if jnp.issubdtype(dtype, jnp.inexact):
    low, high = -jnp.inf, jnp.inf
  else:
    low, high = jnp.iinfo(dtype).min, jnp.iinfo(dtype).max
  return jnp.full(aval.shape, low if kind is batch_axis.tags.MAX else high, dtype)


def _staged(t: auto_grad.Traced, split: loss_split.Split, per_micro, xs, hoisted_vals,
            dep: list[int], m: int):
  """`Scheme.STAGED`: L = H(S, V, d); each stage's statistics V_n = G_n(S_n, V_<n, d), its
  sums S_n over the batch reading earlier stages' statistics; the loss's sums S read them
  all. Forward: each stage's sums totalled (one pass each), its statistics computed, then
  the loss's sums (one pass). Backward: each microbatch pulled back through its terms of
  S with jax.jit's cotangent of S (giving the statistics' cotangents), then, stage by stage
  from the last, through G_n and its terms of S_n (one pass each)."""
  prog, micro = t.prog, split.micro
  diff, other, batch_vals = t.inputs()
  slot = micro.slot
  staged = list(split.staged)

  def whole_env(d):
    env = dict(zip(prog.constvars, t.closed.consts))
    env.update(zip(prog.invars, [*d, *other, *batch_vals]))
    env.update(zip(split.hoisted, hoisted_vals))
    return env

  def micro_stats(values: dict) -> dict:  # {whole slot: value} -> {microbatch slot: value}
    return {slot[v]: x for v, x in values.items()}

  known: dict = {}  # statistic -> its total
  pulls = []  # per stage: (its sums' slots, their totals, which differentiable, pullback of G)
  for stats, sums in split.stages:
    extrema = [split.tags.get(v) if split.tags.get(v) in _COMBINE else None for v in sums]
    totals = _total(per_micro, xs, diff, [slot[v] for v in sums], micro_stats(known), extrema)
    inexact = [j for j, x in enumerate(totals) if _inexact(x) and extrema[j] is None]
    earlier = [v for v in known if _inexact(known[v])]

    def statistics(s, before, d, stats=stats, sums=sums, totals=totals, inexact=inexact,
                   earlier=earlier):  # V_n = G_n(S_n, V_<n, d), at the whole batch's sums
      env = whole_env(d)
      env.update(known)
      env.update(zip(earlier, before))
      env.update(zip(sums, _put(totals, inexact, s)))
      given = [*sums, *split.hoisted, *known]
      return flat.evaluate(prog, env, flat.needed(prog, list(stats), given=given), list(stats))

    values, pull = jax.vjp(statistics, [totals[j] for j in inexact],
                           [known[v] for v in earlier], diff)
    pulls.append((sums, totals, inexact, earlier, pull, stats, dict(known)))
    known.update(zip(stats, values))

  v_all = [known[v] for v in staged]
  vdep = [j for j, x in enumerate(v_all) if _inexact(x)]
  s2 = _total(per_micro, xs, diff, micro.frontier[:len(split.frontier)], micro_stats(known))
  targets = [prog.outvars[0]]
  indices = flat.needed(prog, targets, given=[*split.frontier, *staged])

  def head(s, v, d):  # H(S, V, d)
    env = whole_env(d)
    env.update(zip(split.frontier, _put(s2, dep, s)))
    env.update(zip(staged, _put(v_all, vdep, v)))
    return flat.evaluate(prog, env, indices, targets)[0]

  c_s2, c_v = jax.grad(head, argnums=(0, 1))([s2[j] for j in dep], [v_all[j] for j in vdep],
                                            diff)

  def pull_back(wanted, cot, wrt, given):
    """One pass: each microbatch's terms of the sums `wanted` (None: the loss's, with the
    per-example outputs) pulled back with `cot`, to the parameters and the statistics
    `wrt` (of those `given`, the statistics known before those sums); their sums, with the
    per-example outputs stacked."""
    def body(carry, x):
      grads, cv = carry
      micro_vals, i = x

      def f(d, v):
        stats = micro_stats({**given, **dict(zip(wrt, v))})
        if wanted is None:
          sums, (_, bouts) = per_micro(d, micro_vals, i, statistics=stats)
          return sums, bouts
        return per_micro(d, micro_vals, i, wanted, stats), None
      _, vjp, bouts = jax.vjp(f, diff, [known[u] for u in wrt], has_aux=True)
      gd, gv = vjp(cot)
      return (_add(grads, gd), _add(cv, gv)), bouts
    zeros_d = [jnp.zeros(x.shape, _acc_dtype(x.dtype)) for x in diff]
    zeros_v = [jnp.zeros(known[u].shape, _acc_dtype(known[u].dtype)) for u in wrt]
    return jax.lax.scan(body, (zeros_d, zeros_v), xs)

  wrt = [staged[j] for j in vdep]
  (grads, cv), stacked = pull_back(
      None, [c.astype(s2[j].dtype) for c, j in zip(c_s2, dep)], wrt, known)
  acc = lambda u, c: c.astype(_acc_dtype(known[u].dtype))  # noqa: E731
  cot_v = {u: acc(u, a) + acc(u, b) for u, a, b in zip(wrt, c_v, cv)}  # so far, by statistic
  for sums, totals, inexact, earlier, pull, stats, before in reversed(pulls):
    c_stats = [cot_v.get(v, None) for v in stats]
    c_stats = [_no_cotangent(known[v]) if c is None else c.astype(known[v].dtype)
               for v, c in zip(stats, c_stats)]
    c_s, c_before, g_stat = pull(c_stats)
    grads = [a + g.astype(a.dtype) for a, g in zip(grads, g_stat)]
    for u, c in zip(earlier, c_before):
      cot_v[u] = cot_v.get(u, 0) + acc(u, c)
    if not inexact:  # (maxima only: no gradient flows through them)
      continue
    (g_s, c_more), _ = pull_back(
        [slot[sums[j]] for j in inexact],
        [c.astype(totals[j].dtype) for c, j in zip(c_s, inexact)], earlier, before)
    grads = [a + g.astype(a.dtype) for a, g in zip(grads, g_s)]
    for u, c in zip(earlier, c_more):
      cot_v[u] = cot_v.get(u, 0) + acc(u, c)
  return _combine(t, split, s2, [grads], None, stacked, m, dict(zip(staged, v_all)))


def _no_cotangent(x):
  """A zero cotangent for `x` (float0 for an integer, as jax.vjp asks)."""
  if _inexact(x):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


def _inexact(x) -> bool:
  return bool(jnp.issubdtype(x.dtype, jnp.inexact))


def _put(values: list, at: list[int], new) -> list:
  """`values` with positions `at` replaced by `new` (in order)."""
  out = list(values)
  for j, x in zip(at, new):
    out[j] = x
  return out


def _add(acc: list, new) -> list:
  return [a + g.astype(a.dtype) for a, g in zip(acc, new)]


def _whole_batch_values(t: auto_grad.Traced, split: loss_split.Split, k: int, batch: int):
  """The parameter-free values computed once over the whole batch (no gradient reaches
  them): the statistics, given whole to each microbatch, and the values split like the
  batch, as k shares stacked first."""
  wanted = [*split.hoisted, *(v for v, _ in split.split)]
  if not wanted:
    return [], []
  diff, other, batch_vals = t.inputs()
  env = dict(zip(t.prog.constvars, t.closed.consts))
  env.update(zip(t.prog.invars, [*diff, *other, *batch_vals]))
  vals = [jax.lax.stop_gradient(v) for v in
          flat.evaluate(t.prog, env, flat.needed(t.prog, wanted), wanted)]
  n = len(split.hoisted)
  shares = [_parts(v, tag.axis, k, batch, tag.segments)
            for v, (_, tag) in zip(vals[n:], split.split)]
  return vals[:n], shares


def _unit_cotangent(frontier, dep, j, e) -> list:
  cot = [jnp.zeros(frontier[q].aval.shape, frontier[q].aval.dtype) for q in dep]
  q = dep.index(j)
  cot[q] = cot[q].reshape(-1).at[e].set(1).reshape(cot[q].shape)
  return cot


def _cotangent(t: auto_grad.Traced, split: loss_split.Split, frontier, dep, xs, per_micro
              ) -> list:
  """The sums' cotangent under jax.jit, from totals taken first in a forward pass over the
  microbatches: of the sums no gradient reaches, where it is known in advance (a
  token-weighted mean's `1/sum(w)`), or of every sum (`Scheme.TOTALS_FIRST`)."""
  first = [j for j, d in enumerate(split.dep)
           if not d or split.scheme is loss_split.Scheme.TOTALS_FIRST]
  diff, other, batch_vals = t.inputs()
  loss = sum_cotangent.combined_fn(t.prog, t.closed.consts, split.frontier, split.dep,
                                   t.n_diff, other, batch_vals)
  totals = {}
  if first:
    wanted = [frontier[j] for j in first]

    def add(acc, x):
      micro_vals, i = x
      vals = per_micro(diff, micro_vals, i, wanted)
      return [a + v.astype(a.dtype) for a, v in zip(acc, vals)], None
    init = [jnp.zeros(v.aval.shape, _acc_dtype(v.aval.dtype)) for v in wanted]
    summed, _ = jax.lax.scan(add, init, xs)
    totals = {j: s.astype(frontier[j].aval.dtype) for j, s in zip(first, summed)}
  free = [totals[j] for j, d in enumerate(split.dep) if not d]
  at = [totals[j] for j in dep] if split.scheme is loss_split.Scheme.TOTALS_FIRST else None
  cot = sum_cotangent.value(loss, [frontier[j].aval for j in dep], free, diff, at)
  return [c.astype(frontier[j].aval.dtype) for c, j in zip(cot, dep)]


def _combine(t: auto_grad.Traced, split: loss_split.Split, totals, grads, basis, stacked,
             m: int, statistics: dict | None = None):
  """The loss's outputs and gradients from the totals: with a known cotangent the
  microbatches' pullbacks are the sums' whole gradient; otherwise each sum's gradient
  (`basis`, one per element) is scaled by the totals' cotangent."""
  prog = t.prog
  diff, other, batch_vals = t.inputs()
  rest = [i for i in range(len(prog.outvars)) if i not in split.batched_outs]
  targets = [prog.outvars[i] for i in rest]
  statistics = statistics or {}
  indices = flat.needed(prog, targets, given=[*split.frontier, *statistics])

  def combined(sums, d):
    env = dict(zip(prog.constvars, t.closed.consts))
    env.update(zip(prog.invars, [*d, *other, *batch_vals]))
    env.update(statistics)
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
    tag = split.tags[prog.outvars[i]]
    if tag is batch_axis.tags.MAX:  # the largest of each microbatch's largest
      out[i] = jnp.max(ys, axis=0)
    elif tag is batch_axis.tags.MIN:
      out[i] = jnp.min(ys, axis=0)
    else:
      out[i] = _unsplit(ys, tag, m)
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


def _unsplit(ys, tag, m: int):
  """Per-example outputs stacked per microbatch, (k, ...), back in the batch's order:
  microbatch i held examples i, i+k, ... (in each segment); the batch (m per microbatch)
  is the major factor of the axis, whose other factor r (a merged sequence) stays
  innermost."""
  axis, s = tag.axis, tag.segments
  k, shape = ys.shape[0], ys.shape[1:]
  r = shape[axis] // (s * m)
  x = jnp.moveaxis(ys, 0, axis)  # (..., k, s * m * r, ...)
  x = x.reshape(shape[:axis] + (k, s, m, r) + shape[axis + 1:])
  x = jnp.moveaxis(x, axis, axis + 2)  # (..., s, m, k, r, ...): example j * k + i
  return x.reshape(shape[:axis] + (s * m * k * r,) + shape[axis + 1:])
