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

import collections
import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hbm_guard._src import batch_axis
from hbm_guard._src import closure
from hbm_guard._src import custom_rules
from hbm_guard._src import jaxpr_flat as flat
from hbm_guard._src import layers
from hbm_guard._src import layout as layout_lib
from hbm_guard._src import plan as plan_lib
from hbm_guard._src import sum_cotangent

_MAX_SUM_GRADS = 8  # separate batch sums of the parameters whose gradients are accumulated


@dataclasses.dataclass(frozen=True)
class Context:
  """What the guard's trace knows of the step's arguments."""
  batch_size: int | None  # the commonest leading size of the step's non-state arguments
  state_ids: frozenset[int]
  step_name: str = "step"
  mesh: Any = None  # the plan shards the batch over this mesh's "fsdp" axis (data parallel)
  candidates: tuple = ()  # (leading size, shape, dtype) of each leaf that voted for the size
  # (leaf ids, leading sizes) of each non-state argument's arrays, and the ids of those
  # arguments whose arrays do not all lead with the batch's size
  groups: tuple = ()
  apart_ids: frozenset = frozenset()

  def constraint(self, tags: dict) -> Callable[[Any, Any], Any] | None:
    """Keeps per-example values sharded on their batch axis (data parallel), so the
    compiler gathers parameters (FSDP) instead of the batch."""
    if self.mesh is None:
      return None
    n = self.mesh.devices.size

    def constrain(slot, value):
      tag = tags.get(slot)
      if not isinstance(tag, batch_axis.Batched) or jnp.ndim(value) <= tag.axis or (
          jnp.shape(value)[tag.axis] % n):
        return value
      spec = jax.sharding.PartitionSpec(*([None] * tag.axis), "fsdp")
      return jax.lax.with_sharding_constraint(value, jax.sharding.NamedSharding(self.mesh, spec))
    return constrain

  @classmethod
  def from_args(cls, args, kwargs, state_argnums, static, step_name="step",
                mesh=None) -> "Context":
    state, static = set(state_argnums), set(static)
    batch = [x for i, a in enumerate(args) if i not in state and i not in static
             for x in jax.tree.leaves(a)] + jax.tree.leaves(kwargs)
    batch = [x for x in batch if getattr(x, "ndim", 0) >= 1 and not _is_key(x)]
    states = [x for i in state if i < len(args) for x in jax.tree.leaves(args[i])]
    candidates = tuple((int(x.shape[0]), tuple(x.shape), jnp.dtype(x.dtype)) for x in batch)
    groups = tuple(_group(a) for i, a in enumerate(args) if i not in state and i not in static)
    groups += tuple(_group(v) for v in kwargs.values())
    ctx = cls(None, frozenset(map(id, states)), step_name, mesh, candidates,
              groups=tuple(g for g in groups if g[1]))
    return ctx.sized(_commonest(candidates))

  def sized(self, size: int | None) -> "Context":
    """This context with the batch's size `size`: an argument some of whose arrays do not
    lead with it (a target network beside the batch, images with five captions each) is
    not the batch, whatever its leaves' sizes."""
    apart = frozenset(i for ids, sizes in self.groups if any(n != size for n in sizes)
                      for i in ids)
    return dataclasses.replace(self, batch_size=size, apart_ids=apart)

  def beside(self, differentiated) -> "Context":
    """The batch's size voted again without the leaves shaped as the differentiated ones:
    a step whose state the guard was not told (no `state_argnums`) passes parameters and
    optimizer moments, which outnumber the batch's leaves."""
    shaped = {(tuple(x.shape), jnp.dtype(x.dtype)) for x in differentiated
              if hasattr(x, "shape") and hasattr(x, "dtype")}
    size = _commonest(tuple(c for c in self.candidates if c[1:] not in shaped))
    if size is None or size == self.batch_size:
      return self
    return self.sized(size)

  def is_batch(self, x) -> bool:
    """A batch leaf: the batch's leading size and not state (one of the step's own batch
    arguments, or a value computed from them, such as token weights), and not a leaf of an
    argument that is not all batch (a DQN's target network, whose biases may be as long as
    the batch)."""
    return (self.batch_size is not None and getattr(x, "ndim", 0) >= 1
            and hasattr(x, "dtype") and x.shape[0] == self.batch_size
            and id(x) not in self.state_ids and id(x) not in self.apart_ids
            and not _is_key(x))


def _group(tree) -> tuple[frozenset[int], tuple[int, ...]]:
  leaves = [x for x in jax.tree.leaves(tree) if getattr(x, "ndim", 0) >= 1 and not _is_key(x)]
  return frozenset(map(id, leaves)), tuple(int(x.shape[0]) for x in leaves)


def _commonest(candidates: tuple) -> int | None:
  sizes = collections.Counter(n for n, _, _ in candidates)
  return sizes.most_common(1)[0][0] if sizes else None


def _is_key(x) -> bool:
  try:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  except (AttributeError, TypeError):
    return False


def describe_leaf(x) -> str:
  return f"{layout_lib.dtype_of(x).name}{list(x.shape)}"


@dataclasses.dataclass
class _Traced:
  """The loss traced at the whole batch, with where its inputs came from."""
  fun: Callable
  diff: tuple[int, ...]
  leaves: list  # args' and kwargs' leaves
  treedef: Any
  kinds: list[str]  # per leaf: "diff" | "batch" | "other"
  captured: list  # batch values the loss closes over
  out_tree: list  # [treedef] of the loss's output, filled by tracing
  closed: Any = None
  prog: flat.Program | None = None
  state_ids: frozenset[int] = frozenset()  # the step's state leaves: never the batch

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
    it = {"diff": iter(diff), "other": iter(other), "batch": iter(batch)}
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


def trace(fun, argnums, args, kwargs, ctx: Context) -> _Traced:
  diff = normalized_argnums(argnums, len(args))
  kinds, leaves = [], []
  for i, a in enumerate(args):
    for x in jax.tree.leaves(a):
      leaves.append(x)
      kinds.append("diff" if i in diff else "batch" if ctx.is_batch(x) else "other")
  for x in jax.tree.leaves(kwargs):
    leaves.append(x)
    kinds.append("batch" if ctx.is_batch(x) else "other")
  treedef = jax.tree_util.tree_structure((args, kwargs))
  explicit = {id(x) for x in leaves}
  captured = [x for x in closure.find(fun, lambda x: isinstance(x, jax.core.Tracer)
                                      and ctx.is_batch(x)) if id(x) not in explicit]
  t = _Traced(fun, diff, leaves, treedef, kinds, captured, [],
              state_ids=ctx.state_ids | ctx.apart_ids)
  t.closed = jax.make_jaxpr(t.g)(*t.inputs())
  t.prog = flat.flatten(t.closed)
  return t


def _wrap(policy_name: str | None):
  if policy_name is None or policy_name == "everything_saveable":
    return None
  policy = plan_lib.checkpoint_policy(policy_name)
  return lambda f: jax.checkpoint(f, policy=policy, prevent_cse=True)


# ----------------------------------------------------------------------------- split
@dataclasses.dataclass(frozen=True)
class Split:
  """How the loss splits: its batch sums, which carry gradients, what is per example."""
  tags: dict
  frontier: tuple  # sums the combining part reads (slots of the whole-batch program)
  dep: tuple[bool, ...]  # per frontier sum: does it depend on the differentiated inputs
  batched_outs: tuple[int, ...]  # output positions that are per example
  description: str
  # Each microbatch is differentiated with the cotangent jax.jit gives the sums (known
  # before the totals); otherwise with a unit cotangent per element, scaled once combined.
  known_cotangent: bool | None = False  # None: not decided (traced whole)
  # Parameter-free batch statistics read by per-example work: evaluated once over the whole
  # batch, given to each microbatch as constants.
  hoisted: tuple = ()


def analyse(t: _Traced, batch: int, microbatched: bool = True) -> Split:
  """How the traced loss splits over the batch; raises batch_axis.NotSplittable. Traced
  whole (`microbatched=False`), whether the sums' cotangent is known in advance is only
  decided where a refusal depends on it."""
  prog = t.prog
  n_diff = sum(k == "diff" for k in t.kinds)
  n_other = sum(k == "other" for k in t.kinds)
  batch_slots = prog.invars[n_diff + n_other:]
  if not batch_slots:
    raise batch_axis.NotSplittable("no batch input reaches the loss")
  for c in t.closed.consts:
    if (isinstance(c, jax.core.Tracer) and getattr(c, "ndim", 0) >= 1 and c.shape[0] == batch
        and id(c) not in t.state_ids):  # a state leaf the batch's size (BatchNorm's 128 means)
      # or a leaf of an argument that is not the batch
      raise batch_axis.NotSplittable(
          f"a batch-sized value {describe_leaf(c)} reaches the loss other than through its "
          f"arguments or closure (pass it as an argument)")
  seen: list = []
  hoisted: set = set()
  dep_slots = _depends(prog, set(prog.invars[:n_diff]))
  token = custom_rules.SEEN.set(seen)
  try:
    tags = batch_axis.analyse(prog, {v: 0 for v in batch_slots}, batch, t.closed.consts,
                              hoisted, lambda v: v not in dep_slots)
  finally:
    custom_rules.SEEN.reset(token)
  outs = [tags.get(v) if flat.is_var(v) else None for v in prog.outvars]
  if not isinstance(outs[0], batch_axis.Reduced):
    raise batch_axis.NotSplittable("the loss does not depend on the batch")
  hoisted_t = tuple(v for v in prog.eqns_outvars() if v in hoisted) if hoisted else ()
  frontier = []
  for i in flat.needed(prog, prog.outvars, given=hoisted):
    e = prog.eqns[i]
    if tags.get(e.outvars[0]) is batch_axis.COMBINED:
      frontier += [v for v in e.invars if flat.is_var(v) and tags.get(v) is batch_axis.SUM]
  frontier += [v for v in prog.outvars if flat.is_var(v) and tags.get(v) is batch_axis.SUM]
  frontier = tuple(dict.fromkeys(frontier))
  dep = tuple(v in dep_slots for v in frontier)
  batched_outs = tuple(i for i, tag in enumerate(outs) if isinstance(tag, batch_axis.Batched))
  for i in batched_outs:
    if outs[i].axis != 0 and prog.outvars[i].aval.shape[outs[i].axis] % batch:
      raise batch_axis.NotSplittable(f"output {i} holds the batch unevenly")
  rules = _custom_vjp_rules(prog, flat.needed(prog, list(frontier), given=hoisted), dep_slots)
  unseen = [e for e in rules if not any(e.eqn is s for s in seen)]
  if unseen:
    raise batch_axis.NotSplittable(
        f"a custom derivative rule ({batch_axis.where(unseen[0])}) acts on the parameters "
        f"before the batch: split, it would see each microbatch's part of the gradient")
  n_grads = sum(int(np.prod(v.aval.shape)) for v, d in zip(frontier, dep) if d)
  known = None
  if microbatched or seen or n_grads > _MAX_SUM_GRADS:
    known = known_cotangent(t, frontier, dep)
  if seen and not known:
    raise batch_axis.NotSplittable(
        "a custom_vjp rule lies between the parameters and batch sums whose cotangent "
        "needs the whole batch's totals (its backward would see another cotangent)")
  if known is False and n_grads > _MAX_SUM_GRADS:
    raise batch_axis.NotSplittable(
        f"the loss depends on {n_grads} separate batch sums of the parameters")
  n_sums = len(frontier)
  kind = "the sum" if n_sums == 1 and outs[0] is batch_axis.SUM else (
      f"a function of {n_sums} batch sum{'s' * (n_sums != 1)}")
  how = ("; each microbatch pulled back with the cotangent jax.jit gives the sums, known "
         "before the totals" if known else "" if known is None else
         "; each sum's gradient accumulated and scaled once by the cotangent of the totals")
  rule_note = f"; {len(seen)} custom derivative rule(s) read per example" if seen else ""
  stats = (f"; {len(hoisted_t)} parameter-free batch statistic(s) computed once over the "
           f"whole batch" if hoisted_t else "")
  return Split(tags, frontier, dep, batched_outs,
               f"loss: {kind}, accumulated over microbatches and combined once{how}"
               f"{rule_note}{stats} (exact)", known, hoisted_t)


def known_cotangent(t: _Traced, frontier, dep) -> bool:
  """Whether the sums' cotangent reads neither the parameters nor the dependent sums."""
  loss = sum_cotangent.combined_fn(t.prog, t.closed.consts, frontier, dep, t.n_diff,
                                   t.inputs()[1], t.inputs()[2])
  return sum_cotangent.known_in_advance(
      loss, [v.aval for v, d in zip(frontier, dep) if d],
      [v.aval for v, d in zip(frontier, dep) if not d], t.inputs()[0])


def _custom_vjp_rules(prog: flat.Program, indices, dep_slots) -> list:
  """The custom_vjp equations (at any depth) among `indices` that depend on the parameters."""
  found = []
  for i in indices:
    e = prog.eqns[i]
    if not any(v in dep_slots for v in e.outvars):
      continue
    if e.primitive.name in batch_axis.CUSTOM_RULES and e.primitive.name != "custom_jvp_call":
      found.append(e)
    for sub in _nested(e.eqn):
      found += [_Nested(x) for x in _all_eqns(sub) if x.primitive.name in
                batch_axis.CUSTOM_RULES and x.primitive.name != "custom_jvp_call"]
  return found


@dataclasses.dataclass(frozen=True)
class _Nested:
  """A custom_vjp equation inside a nested jaxpr (a scan's body), as an `Eqn`-like."""
  eqn: Any
  name_stack: str = ""

  @property
  def primitive(self):
    return self.eqn.primitive


def _nested(eqn) -> list:
  out = []
  for v in eqn.params.values():
    for x in (v if isinstance(v, (tuple, list)) else (v,)):
      inner = getattr(x, "jaxpr", x)
      if hasattr(inner, "eqns"):
        out.append(inner)
  return out


def _all_eqns(jaxpr):
  for e in jaxpr.eqns:
    yield e
    for sub in _nested(e):
      yield from _all_eqns(sub)


def _depends(prog: flat.Program, roots: set) -> set:
  dep = set(roots)
  for e in prog.eqns:
    if any(flat.is_var(v) and v in dep for v in e.invars):
      dep.update(e.outvars)
  return dep


def _micro_program(t: _Traced, split: Split, batch: int, k: int):
  """The loss traced on one microbatch, checked equation for equation against the whole."""
  m = batch // k
  diff, other, batch_vals = t.inputs()
  shapes = [_microbatch_of(x, m) for x in batch_vals]
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


def _microbatch_of(x, m: int) -> jax.ShapeDtypeStruct:
  """`x`'s type at m examples: its dtype, weak type and, where the step is traced under a
  mesh, its sharding (whose absence would trace otherwise: a scalar meeting it is
  resharded, as in flax's attention masks)."""
  aval = jax.typeof(x)
  sharding = getattr(aval, "sharding", None)
  if sharding is not None and getattr(getattr(sharding, "mesh", None), "empty", True):
    sharding = None
  return jax.ShapeDtypeStruct((m,) + tuple(x.shape[1:]), x.dtype, sharding=sharding,
                              weak_type=getattr(aval, "weak_type", False))


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
          if _is_key(c) or (v in fed and jnp.dtype(c.dtype) == jnp.uint32 and c.ndim >= 1)]


def microbatched(t: _Traced, split: Split, batch: int, k: int, policy: str | None,
                 ctx: Context):
  """(outputs, gradient leaves) of the loss over k microbatches: the whole batch's."""
  closed, prog, frontier, outs, indices, slot = _micro_program(t, split, batch, k)
  constrain = ctx.constraint({slot[v]: tag for v, tag in split.tags.items() if v in slot})
  segments, _ = layers.segments(prog, indices, prog.invars[:t.n_diff])
  wrap = _wrap(policy)
  diff, other, batch_vals = t.inputs()
  # Microbatch i takes examples i, i+k, i+2k, ...: a batch sharded over devices (data
  # parallel) gives each device an equal share of every microbatch.
  parts = [jnp.swapaxes(x.reshape((batch // k, k) + tuple(x.shape[1:])), 0, 1)
           for x in batch_vals]
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
    split = dataclasses.replace(split, known_cotangent=known_cotangent(
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


def _hoisted_values(t: _Traced, split: Split) -> list:
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


def _known_cotangent(t: _Traced, split: Split, frontier, dep, parts, k, per_micro) -> list:
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


def _combine(t: _Traced, split: Split, totals, grads, basis, stacked, m: int):
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


def whole_batch(t: _Traced, policy: str | None, vg: Callable, constrain=None):
  """(outputs, gradient leaves) over the whole batch: each repeated layer checkpointed with
  `policy`, per-example values kept where `constrain` puts them."""
  prog = t.prog
  indices = list(range(len(prog.eqns)))
  segments, _ = layers.segments(prog, indices, prog.invars[:t.n_diff])
  diff, other, batch_vals = t.inputs()
  wrap = _wrap(policy)

  def f(d):
    env = dict(zip(prog.constvars, t.closed.consts))
    env.update(zip(prog.invars, [*d, *other, *batch_vals]))
    vals = flat.evaluate(prog, env, indices, list(prog.outvars), segments, wrap, constrain)
    return vals[0], vals

  (_, vals), grads = vg(f, has_aux=True)(diff)
  return vals, grads


def unflatten(t: _Traced, out_leaves, grad_leaves, args):
  """The loss's outputs and the gradients in the structures jax's own would have."""
  out = jax.tree_util.tree_unflatten(t.out_tree[0], out_leaves)
  structs = [jax.tree_util.tree_structure(args[i]) for i in t.diff]
  it = iter(grad_leaves)
  grads = [jax.tree_util.tree_unflatten(s, [next(it) for _ in range(s.num_leaves)])
           for s in structs]
  return out, grads
