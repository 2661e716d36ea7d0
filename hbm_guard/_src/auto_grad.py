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
from typing import Any, Callable

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
  # (leaf ids, shapes) of each non-state argument's arrays, and the ids of those arguments
  # with an array that does not hold the batch's size (`_axis_of`)
  groups: tuple = ()
  apart_ids: frozenset = frozenset()
  # Whether a leaf may hold the batch on an axis other than its first (a time-major [T, B, D]
  # sequence): where it is the only axis of the batch's length.
  across_axes: bool = True

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
    batch = [x for x in batch if getattr(x, "ndim", 0) >= 1 and not is_key(x)]
    states = [x for i in state if i < len(args) for x in jax.tree.leaves(args[i])]
    candidates = tuple((int(x.shape[0]), tuple(map(int, x.shape)), jnp.dtype(x.dtype))
                       for x in batch)
    groups = tuple(_group(a) for i, a in enumerate(args) if i not in state and i not in static)
    groups += tuple(_group(v) for v in kwargs.values())
    ctx = cls(None, frozenset(map(id, states)), step_name, mesh, candidates,
              groups=tuple(g for g in groups if g[1]))
    return ctx.sized(_vote(candidates, ctx.across_axes))

  def leading_only(self) -> "Context":
    """This context as it was before batches on other axes: each leaf's batch is its first
    axis, the size voted among first axes alone. Where a split across axes is refused,
    this one is tried: nothing that split before stops splitting."""
    ctx = dataclasses.replace(self, across_axes=False)
    return ctx.sized(_vote(self.candidates, False))

  def sized(self, size: int | None) -> "Context":
    """This context with the batch's size `size`: an argument some of whose arrays do not
    hold it (a target network beside the batch, images with five captions each) is not
    the batch, whatever its leaves' sizes."""
    apart = frozenset(i for ids, shapes in self.groups
                      if any(_axis_of(s, size, self.across_axes) is None for s in shapes)
                      for i in ids)
    return dataclasses.replace(self, batch_size=size, apart_ids=apart)

  def beside(self, differentiated) -> "Context":
    """The batch's size voted again without the leaves shaped as the differentiated ones:
    a step whose state the guard was not told (no `state_argnums`) passes parameters and
    optimizer moments, which outnumber the batch's leaves."""
    shaped = {(tuple(x.shape), jnp.dtype(x.dtype)) for x in differentiated
              if hasattr(x, "shape") and hasattr(x, "dtype")}
    size = _vote(tuple(c for c in self.candidates if c[1:] not in shaped), self.across_axes)
    if size is None or size == self.batch_size:
      return self
    return self.sized(size)

  def batch_axis_of(self, x) -> int | None:
    """The axis of a batch leaf that holds the batch, else None. A batch leaf holds the
    batch's size and is not state (one of the step's own batch arguments, or a value
    computed from them, such as token weights), nor a leaf of an argument that is not all
    batch (a DQN's target network, whose biases may be as long as the batch)."""
    if (self.batch_size is None or getattr(x, "ndim", 0) < 1 or not hasattr(x, "dtype")
        or id(x) in self.state_ids or id(x) in self.apart_ids or is_key(x)):
      return None
    return _axis_of(tuple(x.shape), self.batch_size, self.across_axes)

  def is_batch(self, x) -> bool:
    return self.batch_axis_of(x) is not None


def _axis_of(shape: tuple, size: int | None, across_axes: bool) -> int | None:
  """Where `shape` holds the batch of `size`: its first axis; else (`across_axes`) its only
  axis of that length, or a first axis of several rows per example, examples major (five
  captions per image, [5B, ...]). Which axis is a designation, not a proof: the analysis
  then splits the loss along it exactly or refuses."""
  if not shape or not size:
    return None
  if shape[0] == size:
    return 0
  if not across_axes:
    return None
  axes = [i for i, n in enumerate(shape) if n == size]
  if len(axes) == 1:
    return axes[0]
  return 0 if not axes and shape[0] % size == 0 else None


def _group(tree) -> tuple[frozenset[int], tuple[tuple[int, ...], ...]]:
  leaves = [x for x in jax.tree.leaves(tree) if getattr(x, "ndim", 0) >= 1 and not is_key(x)]
  return frozenset(map(id, leaves)), tuple(tuple(map(int, x.shape)) for x in leaves)


def _vote(candidates: tuple, across_axes: bool) -> int | None:
  """The batch's size: the commonest first axis of the batch's leaves; across axes, a tie
  goes to the size more leaves hold on any axis (time-major inputs [T, B, D] beside labels
  [B]: B, not T), then to the one more first axes are multiples of (images [B] beside
  their captions [5B]: B)."""
  leading = collections.Counter(n for n, _, _ in candidates)
  if not leading:
    return None
  if not across_axes:
    return leading.most_common(1)[0][0]
  anywhere = collections.Counter(n for _, shape, _ in candidates for n in set(shape))
  return max(leading, key=lambda n: (leading[n], anywhere[n],
                                     sum(c for s, c in leading.items() if s % n == 0)))


def is_key(x) -> bool:
  try:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  except (AttributeError, TypeError):
    return False


def describe_leaf(x) -> str:
  return f"{layout_lib.dtype_of(x).name}{list(x.shape)}"


@dataclasses.dataclass
class Traced:
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
  axes: tuple[int, ...] = ()  # per batch value (`inputs()[2]`): the axis holding the batch

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


def trace(fun, argnums, args, kwargs, ctx: Context) -> Traced:
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
  batch = [x for x, k in zip(leaves, kinds) if k == "batch"] + captured
  t = Traced(fun, diff, leaves, treedef, kinds, captured, [],
             state_ids=ctx.state_ids | ctx.apart_ids,
             axes=tuple(ctx.batch_axis_of(x) for x in batch))
  t.closed = jax.make_jaxpr(t.g)(*t.inputs())
  t.prog = flat.flatten(t.closed)
  return t


def wrap_policy(policy_name: str | None):
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


def analyse(t: Traced, batch: int, microbatched: bool = True) -> Split:
  """How the traced loss splits over the batch; raises batch_axis.NotSplittable. Traced
  whole (`microbatched=False`), whether the sums' cotangent is known in advance is only
  decided where a refusal depends on it."""
  prog = t.prog
  n_diff = sum(k == "diff" for k in t.kinds)
  n_other = sum(k == "other" for k in t.kinds)
  batch_slots = prog.invars[n_diff + n_other:]
  if not batch_slots:
    raise batch_axis.NotSplittable(
        f"no input of the loss holds the step's batch of {batch} examples (a part of it, "
        f"such as minibatches the step scans over itself, is not split again)")
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
    tags = batch_axis.analyse(prog, dict(zip(batch_slots, t.axes)), batch, t.closed.consts,
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


def known_cotangent(t: Traced, frontier, dep) -> bool:
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
