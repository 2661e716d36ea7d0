"""`jax.value_and_grad` / `jax.grad` as the guard traces a step: where a drop-in step's
gradient is found (flax's `nnx.value_and_grad` / `nnx.grad` call these too).

While a guard traces (and only in that thread and context), `jax.value_and_grad` and
`jax.grad` are wrappers that hand the gradient to `auto_grad`: it follows the plan's
microbatches and remat policy where the analysis allows, and says why where it does not.
Everywhere else, and once the trace is done, they are jax's own. A step that bound the
names before the trace (`from jax import grad, value_and_grad`) holds jax's own functions:
their gradient is found one level down, where jax's `value_and_grad_f` calls `vjp`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import sys
from typing import Callable, Iterator

import jax
from absl import logging

from hbm_guard._src.dropin import auto_grad
from hbm_guard._src.dropin import batch_axis
from hbm_guard._src.dropin import batch_context
from hbm_guard._src.dropin import batch_tags
from hbm_guard._src.dropin import batch_units
from hbm_guard._src.dropin import cond_branches
from hbm_guard._src.dropin import following as following_lib
from hbm_guard._src.dropin import layers as layers_lib
from hbm_guard._src.dropin import loss_split
from hbm_guard._src.dropin import micro_program
from hbm_guard._src.dropin import microbatch
from hbm_guard._src.dropin import retrace
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.plans import swap
from hbm_guard._src.record import errors

# A failure inside the analysis or the rewrite is a bug of the guard's: where set (the
# tests set HBM_GUARD_RAISE_INTERNAL=1), it is raised instead of turned into a refusal.
RAISE_INTERNAL = os.environ.get("HBM_GUARD_RAISE_INTERNAL") == "1"
INTERNAL_ERROR = "a bug in hbm_guard"
_ACTIVE: contextvars.ContextVar[batch_context.Context | None] = contextvars.ContextVar(
    "hbm_guard_auto", default=None)
_CALLS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar(
    "hbm_guard_gradient_calls", default=None)  # the step's gradient calls so far
_SWAP = swap.WhileTracing()
_ORIGINAL = {"value_and_grad": jax.value_and_grad, "grad": jax.grad}
try:  # where jax's value_and_grad_f finds `vjp` (a global of its module, read at each call)
  from jax._src import api as _jax_api  # pylint: disable=g-import-not-at-top  (not public)
except ImportError:  # pragma: no cover  (a jax without it: bound names are not followed)
  _jax_api = None
_API_SWAP = swap.WhileTracing()


_VALUE_AND_GRAD_F = following_lib.nested_code(_ORIGINAL["value_and_grad"], "value_and_grad_f")
Following = following_lib.Following


def _following() -> Following:
  return following_lib.check(_jax_api, _VALUE_AND_GRAD_F)


FOLLOWING = _following()
_FOLLOW_BOUND = FOLLOWING.bound_names
_SAID = []  # (the message said once per process)


@contextlib.contextmanager
def intercepting(ctx: batch_context.Context | None) -> Iterator[None]:
  """Routes this context's `jax.value_and_grad` / `jax.grad` calls to `auto_grad`."""
  if ctx is None:
    yield
    return
  if not FOLLOWING.bound_names and not _SAID:
    _SAID.append(True)
    logging.warning("hbm_guard: %s", FOLLOWING.message())
  token, calls = _ACTIVE.set(ctx), _CALLS.set([0])
  try:
    with _SWAP.swapped(jax, {"value_and_grad": _value_and_grad, "grad": _grad}), (
        _API_SWAP.swapped(_jax_api, {"vjp": _vjp}) if _FOLLOW_BOUND
        else contextlib.nullcontext()):
      yield
  finally:
    _ACTIVE.reset(token)
    _CALLS.reset(calls)


def _tracing() -> bool:
  """Whether a guard's trace (or the step's second trace, `retrace`) is in progress."""
  return _ACTIVE.get() is not None or retrace.capturing() is not None


def _call_number() -> int:
  """This gradient call's number among the step's (from 0), counted."""
  calls = _CALLS.get()
  if calls is None:
    return 0
  calls[0] += 1
  return calls[0] - 1


@contextlib.contextmanager
def suspended() -> Iterator[None]:
  """jax's own gradients here (the helpers, and the loss traced inside the analysis)."""
  token = _ACTIVE.set(None)
  try:
    yield
  finally:
    _ACTIVE.reset(token)


@functools.wraps(_ORIGINAL["value_and_grad"])
def _value_and_grad(fun: Callable, argnums=0, has_aux: bool = False, **kw):
  own = _ORIGINAL["value_and_grad"](fun, argnums, has_aux=has_aux, **kw)
  if not _tracing():
    return own
  own_only = [k for k in ("holomorphic", "allow_int", "reduce_axes") if kw.get(k)]
  if own_only:
    return _as_jax_own(fun, own, own_only)

  @functools.wraps(fun)
  def value_and_grad_f(*args, **kwargs):
    capture = retrace.capturing()
    if capture is not None:
      return capture.reached(fun, args, kwargs, own)
    ctx = _ACTIVE.get()
    if ctx is None:
      return own(*args, **kwargs)
    index = _call_number()
    with suspended():
      return _guarded(fun, argnums, has_aux, args, kwargs, ctx, own, index)
  return value_and_grad_f


def _as_jax_own(fun: Callable, own: Callable, why: list[str]) -> Callable:
  """jax's own gradient, noted as not split: the guard does not rewrite gradients taken
  with these options (they behave exactly as under jax.jit)."""
  @functools.wraps(fun)
  def noted(*args, **kwargs):
    ctx, capture = _ACTIVE.get(), retrace.capturing()
    if capture is not None:
      capture.skip()
    elif ctx is not None:
      _call_number()
      _note(Found(_name(fun, ctx), (), None, f"taken with {', '.join(why)}=True: jax's own "
                  f"gradient, not split", None))
    return own(*args, **kwargs)
  return noted


@functools.wraps(_ORIGINAL["grad"])
def _grad(fun: Callable, argnums=0, has_aux: bool = False, **kw):
  if not _tracing():
    return _ORIGINAL["grad"](fun, argnums, has_aux=has_aux, **kw)
  vg = _value_and_grad(fun, argnums, has_aux=has_aux, **kw)

  @functools.wraps(fun)
  def grad_once(*args, **kwargs):
    out, g = vg(*args, **kwargs)
    return (g, out[1]) if has_aux else g
  return grad_once


def _vjp(fun: Callable, *primals, **kw):
  """jax's `vjp`, except where jax's own `value_and_grad_f` calls it during a guard's trace:
  a `value_and_grad` or `grad` the step bound before the trace, whose call (read from that
  frame: the user's function, argnums, arguments) is then the intercepted one's."""
  own = _API_SWAP.original("vjp")
  caller = sys._getframe(1)  # pylint: disable=protected-access
  if not _tracing() or caller.f_code is not _VALUE_AND_GRAD_F:
    return own(fun, *primals, **kw)
  try:
    call = caller.f_locals
    fun_, argnums, has_aux = call["fun"], call["argnums"], call["has_aux"]
    args, kwargs = call["args"], call["kwargs"]
    own_only = call["holomorphic"] or call["allow_int"]
  except KeyError as e:  # (jax renamed one: its own gradient, and said)
    if retrace.capturing() is not None:
      return own(fun, *primals, **kw)
    _note(Found("value_and_grad", (), None, Following(False, f"its frame has no {e}")
                .message(), None))
    return own(fun, *primals, **kw)
  if own_only:  # as `_value_and_grad` does (which would call back here)
    return own(fun, *primals, **kw)
  out, g = _value_and_grad(fun_, argnums, has_aux=has_aux)(*args, **kwargs)
  grads = (g,) if isinstance(argnums, int) else tuple(g)
  pullback = lambda _: grads  # noqa: E731  (value_and_grad_f pulls back its one cotangent)
  return (out[0], pullback, out[1]) if has_aux else (out, pullback)


@dataclasses.dataclass(frozen=True)
class Found:
  """What the analysis found in one gradient, for the report."""
  where: str
  batch: tuple[str, ...]
  split: str | None  # how the loss splits, when it does exactly
  refused: str | None  # why it does not
  layers: str | None  # the repeated layers checkpointed under a remat plan
  line: str = dataclasses.field(default_factory=lambda: batch_tags.called_at())  # its call

  def describe(self) -> str:
    parts = [f"gradient of `{self.where}`" + (f" ({self.line})" if self.line else "")]
    if self.batch:
      parts.append("batch: " + ", ".join(self.batch))
    parts.append(self.split or f"not split: {self.refused}")
    if self.layers:
      parts.append(f"layers: {self.layers}")
    return "; ".join(parts)


def _guarded(fun, argnums, has_aux, args, kwargs, ctx: batch_context.Context, own,
             index: int = 0):
  """The gradient under the plan in force (the step's `index`th gradient call); jax's own
  where nothing applies."""
  before = plan_lib.reads_now()
  differentiated = [x for i in auto_grad.normalized_argnums(argnums, len(args))
                    if i < len(args) for x in jax.tree.leaves(args[i])]
  whole, ctx = ctx, ctx.beside(differentiated)
  try:
    budget = [retrace.MAX_RETRACES]
    t = _trace(fun, argnums, args, kwargs, ctx, index, budget)
  except Exception as e:  # pylint: disable=broad-except  (then jax's own, which raises its own)
    _note(Found(_name(fun, ctx), (), None, f"the loss could not be traced alone ({e!r:.120})",
                None))
    return own(*args, **kwargs)
  helpers = plan_lib.reads_now() - before  # the step's own plan-aware helpers, inside the loss
  if "microbatches" in helpers:
    return own(*args, **kwargs)  # the step splits its own batch
  split, refused = _analyse(t, ctx.batch_size)
  branches = None
  if refused is not None:  # a cond on the step's own values: split branch by branch
    branches, why = cond_branches.split(t, ctx.batch_size, _analyse)
    refused = None if branches else why if why and "`cond`" in refused else refused
  if refused is not None:
    ctx, t, split, refused = _other_readings(fun, argnums, args, kwargs, whole, differentiated,
                                             ctx, t, refused, index, budget)
  elif _uneven(ctx.batch_size):  # a reading whose count divides (the batch on a later axis)
    other = _other_readings(fun, argnums, args, kwargs, whole, differentiated, ctx, t,
                            f"the batch of {ctx.batch_size} does not split evenly", index,
                            budget)
    if other[2] is not None and not _uneven(other[0].batch_size):
      (ctx, t, split, refused), branches = other, None
  batch = ctx.batch_size
  described = tuple(batch_context.describe_leaf(x) + _where_batch(a)
                    for x, a in zip(t.inputs()[2], t.axes))
  try:
    segments, layers = layers_lib.segments(t.prog, range(len(t.prog.eqns)),
                                           t.prog.invars[:t.n_diff])
  except Exception:  # pylint: disable=broad-except
    segments, layers = [], None
  if "remat_policy" in helpers:
    layers = None
  elif layers and (checkpointed := loss_split.own_checkpoints(t.prog)):
    layers = f"{layers}; {checkpointed}"
  splits = split or branches
  found = Found(_name(fun, ctx), described, splits and splits.description, refused, layers)
  _note(found)
  k = plan_lib.plan_value("microbatches") if splits is not None else 1
  if k > 1 and batch % k:  # not compiled whole under k's name: the climb picks a count
    raise errors.UnevenMicrobatchError.of(batch, k)  # that divides (a trailing batch)
  policy = plan_lib.plan_value("remat_policy") if layers else None
  if splits is not None:
    plan_lib.note(batch_size=batch, loss_form="auto_sums")
  constrain = ctx.constraint(split.tags) if split is not None else None
  try:
    if k > 1 and branches is not None:
      outs, grads = branches.gradient(
          lambda tb, sb: microbatch.microbatched(tb, sb, batch, k, policy, ctx))
    elif k > 1:
      outs, grads = microbatch.microbatched(t, split, batch, k, policy, ctx)
    elif (policy is not None and segments) or constrain is not None:
      outs, grads = auto_grad.whole_batch(t, policy if segments else None,
                                          _ORIGINAL["value_and_grad"], constrain)
    else:
      return own(*args, **kwargs)
  except batch_axis.NotSplittable as e:
    _note(dataclasses.replace(found, split=None, refused=str(e)), again=True)
    return own(*args, **kwargs)
  except Exception as e:  # pylint: disable=broad-except  (never the user's step's failure)
    if RAISE_INTERNAL:
      raise
    why = internal_error("rewrite", e)
    _note(dataclasses.replace(found, split=None, refused=why), again=True)
    return own(*args, **kwargs)
  out, grads = auto_grad.unflatten(t, outs, grads, args)
  return out, grads[0] if isinstance(argnums, int) else tuple(grads)


def _where_batch(a) -> str:
  if isinstance(a, batch_axis.Batched):
    return f" (batch on axis {a.axis}, in {a.segments} segments one after another)"
  return f" (batch on axis {a})" if a else ""


def _uneven(batch: int | None) -> bool:
  k = plan_lib.peek("microbatches")
  return bool(batch) and k > 1 and batch % k != 0


_MAX_READINGS = 10  # readings of which arguments hold the batch, tried in turn


def _trace(fun, argnums, args, kwargs, reading: batch_context.Context, index: int,
           budget: list[int]) -> auto_grad.Traced:
  """The loss traced alone at the whole batch as `reading` reads it, with how to trace it
  again through the step at a microbatch (`retrace`, within the gradient's `budget`)."""
  t = auto_grad.trace(fun, argnums, args, kwargs, reading)
  t.again = retrace.again(reading, index, t, budget)
  return t


def _other_readings(fun, argnums, args, kwargs, whole: batch_context.Context, differentiated,
                    ctx: batch_context.Context, t: auto_grad.Traced, refused: str,
                    index: int = 0, budget: list[int] | None = None):
  """Where the batch as first read is refused, the other readings of where it is, in turn:
  on first axes alone (as it was read before batches on other axes), each leaf on its own
  (a class table beside the batch in one tuple), the batch only in the step's own arrays
  (not another network's parameters passed to the loss, nor a vector the step computed as
  long as the batch and the loss closes over), the other sizes the arguments hold (a
  time-major step whose sequence outnumbers the batch; a gradient in the step's own loop
  over minibatches; data stored features-first), then each of those with arrays several
  times the batch's length read as its segments (pairs stored as halves), then each batch
  leaf set apart in turn (a codebook as long as the batch in its dict). Which reading is
  a designation, not a proof: the analysis splits along it exactly or refuses. The first
  that splits, with a count of microbatches that divides it, is taken; else the refusal of
  the first axes' reading, as before."""
  lead = whole.leading_only().beside(differentiated)
  readings = [lead] if (any(t.axes) or lead.batch_size != ctx.batch_size) else []
  own = [x for i, a in enumerate(args) if i not in t.diff for x in jax.tree.leaves(a)]
  k = plan_lib.peek("microbatches")
  readings += [c for c in (ctx.step_inputs(), ctx.leafwise(), ctx.multiples_first(),
                           *ctx.other_sizes(own))
               if c is not None and c not in readings
               and (k == 1 or (c.batch_size or 1) % k == 0)]
  batch_leaves = t.inputs()[2]  # (those the loss closes over too)
  lengths = {x.shape[0] for x in batch_leaves if getattr(x, "ndim", 0)}
  readings += [s for c in (ctx, *readings) if (s := c.segmented(lengths)) is not None
               and s not in readings and (k == 1 or (s.batch_size or 1) % k == 0)]
  apart = {ctx.without(x): x for x in batch_leaves} if len(batch_leaves) > 1 else {}
  readings += list(apart)
  reported, uneven, further = (ctx, t, None, refused), None, None
  for other in readings[:_MAX_READINGS]:
    try:
      t1 = _trace(fun, argnums, args, kwargs, other, index,
                  budget if budget is not None else [retrace.MAX_RETRACES])
    except Exception:  # pylint: disable=broad-except  (the refusal above stands)
      continue
    if other in apart and _reworked(t1, apart[other]):
      continue  # (a table the parameters transform would be transformed in every microbatch)
    # (a leaf set apart is as long as the batch: its reading is held on a microbatch now,
    # not first when the climb traces one)
    split1, refused1 = _analysis(t1, other.batch_size, checked=other in apart)
    if split1 is not None and not _uneven(other.batch_size):
      return other, t1, split1, None
    if split1 is not None:  # (kept, should no reading divide: the climb picks a count)
      uneven = uneven or (other, t1, split1, None)
    elif ((other is lead and lead.batch_size) or not reported[1].inputs()[2]
          or (further is None and other.segment_major
              and isinstance(refused1, micro_program.OnMicrobatch))):
      # (a reading that found the batch says more; so does one of the batch's segments
      # refused only on a microbatch: `lp[:n]` with n read outside the loss)
      further = further or isinstance(refused1, micro_program.OnMicrobatch) or None
      reported = (other, t1, None, str(refused1))
  return uneven or reported


def _reworked(t: auto_grad.Traced, table) -> bool:
  """Whether the loss transforms `table` (set apart) by the parameters apart from the
  batch: each microbatch would repeat that work whole (in-batch keys, all embeddings)."""
  n_own = t.n_diff + t.kinds.count("other")
  return batch_units.reworked_whole(t.prog, t.prog.invars[:t.n_diff], t.prog.invars[n_own:],
                                    _slots_of(t, table))


def _slots_of(t: auto_grad.Traced, leaf) -> list:
  """The loss program's inputs (or constants) that hold `leaf`."""
  prog, slots = t.prog, []
  for v, x in zip(prog.invars, [*t.inputs()[0], *t.inputs()[1], *t.inputs()[2]]):
    if x is leaf:
      slots.append(v)
  for v, c in zip(prog.constvars, t.closed.consts):
    if c is leaf:
      slots.append(v)
  return slots


def _analyse(t: auto_grad.Traced, batch: int | None, checked: bool = False):
  """(split, None) where the traced loss splits over the batch, else (None, why not).
  `checked`: held on a microbatch even under the plain plan (at the fewest that divide)."""
  split, refused = _analysis(t, batch, checked)
  return split, None if refused is None else str(refused)


def _analysis(t: auto_grad.Traced, batch: int | None, checked: bool = False):
  """`_analyse`, with the refusal as raised (NotSplittable: where it was met), or the
  internal error's text."""
  try:
    if not batch:
      raise batch_axis.NotSplittable("no batch argument found (the step's non-state "
                                     "arguments have no leading axis)")
    k = plan_lib.peek("microbatches")
    k = k if k > 1 and batch % k == 0 else 1
    if checked and k == 1 and (counts := plan_lib.microbatch_counts(batch, above=1)):
      loss_split.analyse(t, batch, counts[0])
    return loss_split.analyse(t, batch, k), None
  except batch_axis.NotSplittable as e:
    return None, e
  except Exception as e:  # pylint: disable=broad-except  (a jaxpr the analysis misreads)
    if RAISE_INTERNAL:
      raise
    return None, internal_error("analysis", e)


def internal_error(stage: str, e: Exception) -> str:
  """A refusal that is hbm_guard's bug, not the step's: said so, with what to report."""
  return (f"{INTERNAL_ERROR}: the drop-in's {stage} failed on this loss ({type(e).__name__}: "
          f"{e!s:.160}); the step runs jax's own gradient. Please report it at "
          f"https://github.com/hbm-guard/hbm_guard/issues with this message")


def _name(fun, ctx) -> str:
  name = getattr(fun, "__name__", type(fun).__name__)
  return f"{name}` in `{ctx.step_name}"


def _note(found: Found, again: bool = False) -> None:
  """Adds the analysis of one gradient to the trace's notes (`again`: replaces the last,
  the same gradient's). Each gradient is described; the batch counts as not split only
  where no gradient split it, whatever the order of the calls (a refused one runs jax's
  own gradient beside the others' microbatches)."""
  found_so_far = plan_lib.noted("gradients")
  if again and found_so_far:
    found_so_far = found_so_far[:-1]
  found_so_far += (found,)
  several = len(found_so_far) > 1
  refusals = [(f"{f.where.split('`', 1)[0]} " if several else "")
              + (f"(the gradient at {f.line}): " if f.line else "") + f.refused
              for f in found_so_far if f.refused is not None]
  split = any(f.split is not None for f in found_so_far)
  plan_lib.note(gradients=found_so_far,
                auto=" | ".join(f.describe() for f in found_so_far),
                auto_refused=None if split or not refusals else " | ".join(refusals))
