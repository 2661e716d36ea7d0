"""A loss that picks its form with `lax.cond` / `lax.switch` on a value no example feeds
(the optimizer's step counter, a config flag, the parameters): split branch by branch.

jax.jit runs one branch of such a cond, whatever the batch. So does the split: each branch
is the loss with the cond replaced by that branch, traced and analysed on its own (every
branch must split, or the whole is refused with the branch's reason); the branch index is
computed once from the step's own values, as jax.jit computes it, and the microbatched
gradient is a `lax.switch` over the branches' split gradients. Only the branch jax.jit
would run is run: a branch not taken is never evaluated, so its values cannot reach the
gradient (as a select over both branches would let a NaN do).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
import threading
from typing import Callable, Sequence

import jax
from jax._src import source_info_util
try:  # its cond_p.bind, followed (see _bind); without it, conds are refused, by name
  from jax._src.lax.control_flow import conditionals
except ImportError:  # pragma: no cover  (a jax that moved it)
  conditionals = None
from jax.extend import core as jcore

from hbm_guard._src.dropin import auto_grad
from hbm_guard._src.dropin import batch_tags
from hbm_guard._src.dropin import jaxpr_flat as flat

Traced = auto_grad.Traced


@dataclasses.dataclass(frozen=True)
class Choice:
  """A cond of the loss's program whose index reads only the step's own values."""
  at: int  # its equation in the program
  where: str  # the primitive and the user's line, as refusals name it
  count: int  # its branches
  site: str  # the user's line and column jax records for it (checked when it is bound)


def _batch_slots(t: Traced) -> set:
  return set(t.prog.invars[t.n_diff + sum(k == "other" for k in t.kinds):])


def find(t: Traced) -> tuple[Choice, ...]:
  """The conds (outside any other unit) whose index reads no example (the parameters, the
  loss's other arguments and constants are the same for every microbatch) and whose
  operands read the batch."""
  prog, batch = t.prog, _batch_slots(t)
  return tuple(Choice(i, batch_tags.where(e), len(e.params["branches"]),
                      source_info_util.summarize(e.eqn.source_info))
               for i, e in enumerate(prog.eqns) if e.primitive.name == "cond"
               and not _reads(prog, e.invars[:1]) & batch and _reads(prog, e.invars[1:]) & batch)


def _chosen_by_the_batch(t: Traced) -> str | None:
  """Where a cond chooses its branch from the examples' values, if one does."""
  prog, batch = t.prog, _batch_slots(t)
  return next((batch_tags.where(e) for e in prog.eqns if e.primitive.name == "cond"
               and _reads(prog, e.invars[:1]) & batch), None)


def _reads(prog: flat.Program, atoms: Sequence) -> set:
  """The program's inputs and constants that `atoms` are computed from."""
  targets = [a for a in atoms if flat.is_var(a)]
  read = set(targets)
  for i in flat.needed(prog, targets):
    read.update(v for v in prog.eqns[i].invars if flat.is_var(v))
  return read & (set(prog.invars) | set(prog.constvars))


def _sub_jaxprs(params) -> list:
  out = []
  for value in params.values():
    for v in (value if isinstance(value, (tuple, list)) else (value,)):
      inner = getattr(v, "jaxpr", v)
      if hasattr(inner, "eqns"):
        out.append(inner)
  return out


def _conds(jaxpr) -> int:
  """The conds of a jaxpr, its bodies' included."""
  return sum(sum(_conds(sub) for sub in _sub_jaxprs(e.params)) + (e.primitive.name == "cond")
             for e in jaxpr.eqns)


def _ordinals(prog: flat.Program, at: Sequence[int]) -> tuple[tuple[int, ...], int]:
  """(for each cond at `at`, how many conds jax binds before it, how many in all) while
  the loss is traced: a unit's bodies are traced before it is bound, so theirs come first."""
  before, total = {}, 0
  for i, e in enumerate(prog.eqns):
    nested = sum(_conds(sub) for sub in _sub_jaxprs(e.params))
    before[i] = total + nested
    total += nested + (e.primitive.name == "cond")
  return tuple(before[i] for i in at), total


@dataclasses.dataclass
class _Follow:
  branches: dict[int, tuple[int, Choice]]  # the n-th cond bound -> its branch, and the cond
  seen: int = 0
  replaced: int = 0
  strangers: int = 0  # binds at a chosen place that are not the chosen cond


_FOLLOW: contextvars.ContextVar[_Follow | None] = contextvars.ContextVar(
    "hbm_guard_cond_branch", default=None)
_LOCK = threading.Lock()
_USERS = [0]  # traces following a cond now: jax's own bind is restored when none is


def _bind(*args, **params):
  """cond_p.bind while a branch is followed: the chosen cond, as that branch alone."""
  follow = _FOLLOW.get()
  if follow is None:
    return _ORIGINAL_BIND(*args, **params)
  n = follow.seen
  follow.seen += 1
  if n not in follow.branches:
    return _ORIGINAL_BIND(*args, **params)
  branch, choice = follow.branches[n]
  site = source_info_util.summarize(source_info_util.current())
  if site != choice.site or len(params["branches"]) != choice.count:
    follow.strangers += 1  # another cond in its place: the trace is refused
    return _ORIGINAL_BIND(*args, **params)
  follow.replaced += 1
  token = _FOLLOW.set(None)  # the branch's own conds are jax's
  try:
    return jcore.jaxpr_as_fun(params["branches"][branch])(*args[1:])
  finally:
    _FOLLOW.reset(token)


_ORIGINAL_BIND = conditionals.cond_p.bind if conditionals is not None else None
source_info_util.register_exclusion(__file__)  # a cond bound through _bind is the user's


@contextlib.contextmanager
def _following(branches: dict[int, tuple[int, Choice]]):
  with _LOCK:
    if not _USERS[0]:
      conditionals.cond_p.bind = _bind
    _USERS[0] += 1
  follow = _Follow(branches)
  token = _FOLLOW.set(follow)
  try:
    yield follow
  finally:
    _FOLLOW.reset(token)
    with _LOCK:
      _USERS[0] -= 1
      if not _USERS[0]:
        del conditionals.cond_p.bind


@dataclasses.dataclass
class _Branch(Traced):
  """The loss traced again (at any batch size) with chosen conds replaced by one branch
  each. A cond is known by its place among those jax binds and by the user's line and
  column it is bound from; that the trace bound as many conds as the program holds, and
  replaced each chosen at its place and line, is checked on every trace (else: refused, by
  name)."""
  source: Traced | None = None
  branches: dict[int, tuple[int, Choice]] = dataclasses.field(default_factory=dict)
  expected: int = 0

  def g(self, diff, other, batch):
    with _following(self.branches) as follow:
      out = self.source.g(diff, other, batch)
    if (follow.seen != self.expected or follow.replaced != len(self.branches)
        or follow.strangers):
      raise batch_tags.NotSplittable(
          f"the guard could not follow which cond is which while tracing the loss again "
          f"({follow.seen} bound, {self.expected} in the program, {follow.strangers} other "
          f"in a chosen one's place: a vmapped cond, or a jitted function or a body jax "
          f"cached, holds one)")
    return out


def specialise(t: Traced, choices: Sequence[Choice], branches: Sequence[int]) -> Traced:
  """`t` with each cond of `choices` replaced by its branch in `branches`, traced again."""
  ordinals, expected = _ordinals(t.prog, [c.at for c in choices])
  fields = {f.name: getattr(t, f.name) for f in dataclasses.fields(Traced)}
  b = _Branch(**{**fields, "closed": None, "prog": None}, source=t,
              branches={n: (branch, c) for n, branch, c in zip(ordinals, branches, choices)},
              expected=expected)
  b.closed = jax.make_jaxpr(b.g)(*b.inputs())
  b.prog = flat.flatten(b.closed)
  return b


_MAX_PROGRAMS = 16  # branch programs analysed for one loss (conds nest: 2 x 3 x ...)


@dataclasses.dataclass(frozen=True)
class Branches:
  """The loss split per choice of branches of its batch-free conds: each combination
  traced, and how it splits."""
  choices: tuple[Choice, ...]
  source: Traced
  combos: tuple[tuple[int, ...], ...]  # branch per cond, in mixed radix order
  traced: tuple[Traced, ...]
  splits: tuple  # per combination, its loss_split.Split

  @property
  def description(self) -> str:
    conds = ", ".join(c.where for c in self.choices)
    how = {}  # each way of splitting, with the combinations that split so
    for combo, s in zip(self.combos, self.splits):
      how.setdefault(s.description, []).append("/".join(map(str, combo)))
    each = ("each: " + next(iter(how)) if len(how) == 1 else
            "; ".join(f"branch {', '.join(c)}: {d}" for d, c in how.items()))
    return (f"split branch by branch of {conds} (an index that reads no example: jax.jit "
            f"runs one branch, chosen once, and so does each microbatch); {each}")

  def index(self):
    """The combination jax.jit runs, from the step's own values (as it computes each)."""
    prog, closed = self.source.prog, self.source.closed
    env = dict(zip(prog.constvars, closed.consts))
    diff, other, batch = self.source.inputs()
    env.update(zip(prog.invars, [*diff, *other, *batch]))
    indices = [prog.eqns[c.at].invars[0] for c in self.choices]
    values = flat.evaluate(prog, env, flat.needed(prog, indices), indices)
    combined = 0
    for c, v in zip(self.choices, values):
      combined = combined * c.count + jax.numpy.clip(v, 0, c.count - 1).astype("int32")
    return combined

  def gradient(self, run: Callable[[Traced, object], tuple]) -> tuple:
    """(outputs, gradients): `run(traced, split)` of the combination jax.jit would run."""
    return jax.lax.switch(self.index(), [lambda t=t, s=s: run(t, s)
                                         for t, s in zip(self.traced, self.splits)])


def split(t: Traced, batch: int, analyse: Callable) -> tuple[Branches | None, str | None]:
  """(branches, None) where every combination of branches of the batch-free conds splits;
  (None, why) where one does not, or a cond chooses by the batch; else (None, None)."""
  choices = find(t)
  if choices and _ORIGINAL_BIND is None:
    return None, (f"{choices[0].where}: the drop-in could not follow lax.cond in jax "
                  f"{jax.__version__} (its cond_p moved): pin jax, or split the loss "
                  f"yourself with hbm_guard.value_and_grad")
  if not choices:
    where = _chosen_by_the_batch(t)
    return None, where and (f"{where} chooses its branch from the examples' values (a "
                            f"microbatch could choose another branch than the whole batch)")
  combos = list(itertools.product(*[range(c.count) for c in choices]))
  if len(combos) > _MAX_PROGRAMS:
    return None, (f"{choices[0].where}: {len(combos)} combinations of branches to split, "
                  f"more than {_MAX_PROGRAMS}")
  traced, splits = [], []
  for combo in combos:
    named = ", ".join(f"branch {b} of {c.where}" for b, c in zip(combo, choices))
    try:
      tb = specialise(t, choices, combo)
    except batch_tags.NotSplittable as e:
      return None, f"{named}: {e}"
    except Exception as e:  # pylint: disable=broad-except  (the refusal before stands)
      return None, f"{named} could not be traced alone ({e!r:.120})"
    s, why = analyse(tb, batch)
    if s is None:
      return None, f"{named}: {why}"
    traced.append(tb)
    splits.append(s)
  return Branches(choices, t, tuple(combos), tuple(traced), tuple(splits)), None
