"""Where the batch is in a step's arguments: the context the drop-in traces a gradient in.

A designation, not a proof: the batch's size is voted from the step's non-state
arguments, each array holds it on an axis read from its shape, and the analysis
(`loss_split`) then splits along it exactly or refuses. Other readings (first axes alone,
each leaf on its own, the step's own arrays only, other sizes, segments, one leaf set apart
as a table) are tried by `intercept` where the first is refused.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from hbm_guard._src.dropin import batch_axis
from hbm_guard._src.plans import layout as layout_lib


@dataclasses.dataclass(frozen=True)
class StepCall:
  """The step as the guard's trace calls it (`run(*args, **kwargs)`), with those arguments."""
  run: Callable
  args: tuple
  kwargs: dict


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
  # Whether each leaf is read on its own: an argument some of whose arrays do not hold the
  # batch (a class table in the batch's tuple) still holds it in the others.
  by_leaf: bool = False
  # Whether the loss holds the batch only in the step's own batch arrays (not in values the
  # step computed: another network's parameters passed to it, a power iteration's vector
  # as long as the batch in its closure).
  inputs_only: bool = False
  # Whether an array m times as long as the batch holds it in m segments one after another
  # (pairs stored as halves, `[a_1..a_n, b_1..b_n]`), not as m rows per example, examples
  # major (five captions per image).
  segment_major: bool = False
  # Whether a first axis several times the batch's length holds it (as rows per example,
  # or segments) before another axis of exactly its length does: a set of unlabeled
  # examples twice the labeled beside it, `[2B, D]` with `D == B` (FixMatch, DANN).
  rows_first: bool = False
  # The step's own call being traced, to trace it again at a microbatch's shapes where the
  # loss alone cannot be (sizes the step read before the loss: `b, t = x.shape`).
  step_call: "StepCall | None" = dataclasses.field(default=None, compare=False, repr=False)

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
    batch = [x for x in batch if getattr(x, "ndim", 0) >= 1 and not is_key(x)
             and not _raw_key(x)]
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
    apart = frozenset() if self.by_leaf else frozenset(
        i for ids, shapes in self.groups
        if any(_axis_of(s, size, self.across_axes, rows_first=self.rows_first) is None
               for s in shapes) for i in ids)
    return dataclasses.replace(self, batch_size=size, apart_ids=apart)

  def leafwise(self) -> "Context":
    """This context with each leaf read on its own (no argument set apart)."""
    return dataclasses.replace(self, by_leaf=True).sized(self.batch_size)

  def other_sizes(self, leaves=(), limit: int = 2) -> list["Context"]:
    """This context at the other sizes the arguments' first axes hold, the commonest
    first (read on any axis: a time-major input's batch is its second); then at those of
    the loss's own arrays `leaves` (a gradient inside the step's own loop over minibatches
    sees a minibatch)."""
    counts = collections.Counter(n for n, _, _ in self.candidates)
    own = collections.Counter(int(x.shape[0]) for x in leaves
                              if getattr(x, "ndim", 0) >= 1 and not is_key(x))
    # (of the loss's own: a size at least two of its arrays lead with, as a minibatch's
    # inputs and labels do; one example's features, one key's words, are not a batch)
    # (where no first axis is shared by two leaves, a size every batch leaf holds on some
    # axis, first: data stored features-first, [D, B] beside [K, B], holds its batch last)
    shapes = [set(shape) for _, shape, _ in self.candidates]
    every = sorted(set.intersection(*shapes) - set(counts), reverse=True) if (
        len(shapes) > 1 and max(counts.values()) == 1) else []
    sizes = every + [n for n, _ in counts.most_common()]
    sizes += [n for n, c in own.most_common() if c > 1]
    return [self.sized(n) for n in dict.fromkeys(sizes)
            if n != self.batch_size and n > 1][:limit]

  def segmented(self, lengths: Sequence[int] = ()) -> "Context | None":
    """This context with arrays several times as long as the batch read as segments of it,
    one after another; None where no array is (of the step's, or of `lengths`: the arrays
    the loss closes over, as `concatenate([chosen, rejected])` made before it)."""
    sizes = [n for n, _, _ in self.candidates] + list(lengths)
    if self.segment_major or not self.batch_size or not any(
        n != self.batch_size and n % self.batch_size == 0 for n in sizes):
      return None
    return dataclasses.replace(self, segment_major=True)

  def multiples_first(self) -> "Context | None":
    """This context with a first axis several times the batch's length read before an
    only other axis of its length; None where no array of the step's is read otherwise."""
    size = self.batch_size
    if self.rows_first or not size or not any(
        shape[0] != size and shape[0] % size == 0 and size in shape[1:]
        for _, shape, _ in self.candidates):
      return None
    return dataclasses.replace(self, rows_first=True).sized(size)

  def step_inputs(self) -> "Context":
    """This context with the batch only in the step's own batch arrays."""
    return dataclasses.replace(self, inputs_only=True)

  def without(self, leaf) -> "Context":
    """This context with one batch leaf set apart: read as a table the loss uses whole (a
    codebook, a class prior, a queue of negatives riding in the batch's dict, as long as
    the batch by chance)."""
    return dataclasses.replace(self, apart_ids=self.apart_ids | {id(leaf)})

  def is_input(self, x) -> bool:
    return any(id(x) in ids for ids, _ in self.groups)

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

  def batch_axis_of(self, x) -> int | batch_axis.Batched | None:
    """The axis of a batch leaf that holds the batch, else None. A batch leaf holds the
    batch's size and is not state (one of the step's own batch arguments, or a value
    computed from them, such as token weights), nor a leaf of an argument that is not all
    batch (a DQN's target network, whose biases may be as long as the batch)."""
    if (self.batch_size is None or getattr(x, "ndim", 0) < 1 or not hasattr(x, "dtype")
        or id(x) in self.state_ids or id(x) in self.apart_ids
        or (self.inputs_only and not self.is_input(x))):
      return None
    if is_key(x):  # per-example keys (`split(key, n)`): split with their examples
      return 0 if x.shape[0] == self.batch_size else None
    return _axis_of(tuple(x.shape), self.batch_size, self.across_axes, self.segment_major,
                    self.rows_first)

  def is_batch(self, x) -> bool:
    return self.batch_axis_of(x) is not None


def _axis_of(shape: tuple, size: int | None, across_axes: bool, segment_major: bool = False,
             rows_first: bool = False) -> int | batch_axis.Batched | None:
  """Where `shape` holds the batch of `size`: its first axis; else (`across_axes`) its only
  axis of that length, or a first axis of several rows per example, examples major (five
  captions per image, [5B, ...]), or (`segment_major`) of several segments of the batch
  (`rows_first`: such a first axis before another of exactly the batch's length). Which
  axis is a designation, not a proof: the analysis then splits the loss along it exactly
  or refuses."""
  if not shape or not size:
    return None
  if shape[0] == size:
    return 0
  if not across_axes:
    return None
  axes = [i for i, n in enumerate(shape) if n == size]
  if len(axes) == 1 and not (rows_first and shape[0] % size == 0):
    return axes[0]
  if (axes and not rows_first) or shape[0] % size:
    return None
  return batch_axis.Batched(0, shape[0] // size) if segment_major else 0


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


def _raw_key(x) -> bool:
  """A legacy key's data, `jax.random.PRNGKey(0)`: uint32[2] (it does not vote for the
  batch's size; keys split per example, uint32[n, 2], still split with the batch)."""
  return tuple(getattr(x, "shape", ())) == (2,) and str(getattr(x, "dtype", "")) == "uint32"


def is_key(x) -> bool:
  try:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
  except (AttributeError, TypeError):
    return False


def describe_leaf(x) -> str:
  return f"{layout_lib.dtype_of(x).name}{list(x.shape)}"
