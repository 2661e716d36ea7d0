"""A jaxpr with its nested `jit`s inlined, and an evaluator for parts of it.

The drop-in analysis reads a loss's jaxpr as one flat list of equations (a `jnp.mean` or a
`log_softmax` is a nested `jit`, and where the batch is summed can hide inside one), and
evaluates chosen parts of it: the per-example part once per microbatch, the part after the
batch sums once. Units with their own differentiation rules (`custom_jvp`, `custom_vjp`),
control flow and checkpoints stay whole.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Sequence

import jax
from jax._src import source_info_util  # (jax's own eval_jaxpr keeps name stacks with it)
from jax.extend import core as jcore

_INLINED = frozenset({"jit", "pjit", "closed_call", "core_call"})
_CHECKPOINTS = frozenset({"checkpoint", "remat", "remat2"})


@dataclasses.dataclass(frozen=True, eq=False)
class Const:
  """A constant of an inlined jaxpr, as an operand."""
  value: Any


class Slot:
  """A value of the flat program: one per variable and inlined call (a nested jaxpr that
  jax cached is inlined at each call with its own slots)."""
  __slots__ = ("aval",)

  def __init__(self, aval):
    self.aval = aval

  def __repr__(self):
    return f"Slot({self.aval})"


@dataclasses.dataclass(frozen=True, eq=False)
class Eqn:
  """One equation of the flat program: the original, with its operands resolved."""
  eqn: Any  # the jaxpr equation (primitive, params, source_info, ctx)
  invars: tuple[Any, ...]  # Slot | Literal | Const
  outvars: tuple[Slot, ...]
  name_stack: str
  # jax's own name stack of the equation, the calls it was inlined from included: the
  # program the guard evaluates keeps the user's module names (in XProf and the breakdown)
  stack: Any = None
  # the source info of the outermost call it was inlined from (the user's call of a
  # function jax caches, as `jax.nn.log_softmax`): where a refusal points when the
  # equation's own lines are jax's
  site: Any = None

  @property
  def primitive(self):
    return self.eqn.primitive

  @property
  def params(self):
    return self.eqn.params


@dataclasses.dataclass(frozen=True, eq=False)
class Program:
  """A closed jaxpr, flattened: inputs are its constvars then its invars."""
  constvars: tuple[Any, ...]
  invars: tuple[Any, ...]
  eqns: tuple[Eqn, ...]
  outvars: tuple[Any, ...]  # Var | Literal | Const

  def eqns_outvars(self):
    """Every value the equations compute, in program order."""
    return (v for e in self.eqns for v in e.outvars)


def flatten(closed: Any) -> Program:
  """Inlines every nested `jit` / call of `closed` (a ClosedJaxpr)."""
  jaxpr = closed.jaxpr
  alias: dict[Any, Any] = {v: Slot(v.aval) for v in (*jaxpr.constvars, *jaxpr.invars)}
  eqns: list[Eqn] = []
  _inline(jaxpr, alias, eqns, "", source_info_util.new_name_stack(),
          returned=frozenset(v for v in jaxpr.outvars if isinstance(v, jcore.Var)))
  outs = tuple(_resolve(v, alias) for v in jaxpr.outvars)
  return Program(tuple(alias[v] for v in jaxpr.constvars),
                 tuple(alias[v] for v in jaxpr.invars), tuple(eqns), outs)


def _resolve(atom, alias):
  if isinstance(atom, jcore.Literal):
    return atom
  return alias.get(atom, atom)


def _sub_closed(eqn):
  for name in ("jaxpr", "call_jaxpr"):
    sub = eqn.params.get(name)
    if sub is not None:
      return sub
  return None


def _inline(jaxpr, alias, eqns: list, stack: str, names, site=None,
            returned: frozenset = frozenset()) -> None:
  """`returned`: this jaxpr's outputs that are the program's own: a checkpoint that
  returns one of them wraps the whole loss (`jax.checkpoint(loss_fn)`), and is inlined
  too: its sums are the loss's, split like any (each microbatch's forward is its own)."""
  for eqn in jaxpr.eqns:
    invars = tuple(_resolve(v, alias) for v in eqn.invars)
    here = _join(stack, str(eqn.source_info.name_stack))
    names_here = names + eqn.source_info.name_stack
    name = eqn.primitive.name
    whole_loss = name in _CHECKPOINTS and any(v in returned for v in eqn.outvars)
    sub = _sub_closed(eqn) if name in _INLINED or whole_loss else None
    if sub is None:
      outs = tuple(Slot(v.aval) for v in eqn.outvars)
      alias.update(zip(eqn.outvars, outs))
      eqns.append(Eqn(eqn, invars, outs, here, names_here, site))
      continue
    inner = getattr(sub, "jaxpr", sub)
    consts = getattr(sub, "consts", ())
    for v, c in zip(inner.constvars, consts):
      alias[v] = Const(c)
    for v, a in zip(inner.invars, invars):
      alias[v] = a
    inner_returned = frozenset(i for o, i in zip(eqn.outvars, inner.outvars)
                               if o in returned and isinstance(i, jcore.Var))
    _inline(inner, alias, eqns, here, names_here, site or eqn.source_info, inner_returned)
    for out, inner_out in zip(eqn.outvars, inner.outvars):
      alias[out] = _resolve(inner_out, alias)
    for v in (*inner.constvars, *inner.invars):
      alias.pop(v, None)  # a jaxpr jax cached may be inlined again, elsewhere


def _join(a: str, b: str) -> str:
  return f"{a}/{b}" if a and b else a or b


def read(atom, env):
  if isinstance(atom, jcore.Literal):
    return atom.val
  if isinstance(atom, Const):
    return atom.value
  return env[atom]


def is_var(atom) -> bool:
  return not isinstance(atom, (jcore.Literal, Const))


def bind(e: Eqn, env: dict, params: dict | None = None) -> None:
  """Evaluates one equation into `env`, as jax's own `eval_jaxpr` does (with `params` in
  place of its own, e.g. a scan with a checkpointed body)."""
  params = e.primitive.get_bind_params(e.params if params is None else params)
  subfuns, bind_params = params if isinstance(params, tuple) else ([], params)
  invals = [read(v, env) for v in e.invars]
  stack = source_info_util.current_name_stack() + (
      e.stack if e.stack is not None else e.eqn.source_info.name_stack)
  with (source_info_util.user_context(e.eqn.source_info.traceback, name_stack=stack),
        e.eqn.ctx.manager):
    ans = e.primitive.bind(*subfuns, *invals, **bind_params)
  if e.primitive.multiple_results:
    env.update(zip(e.outvars, ans))
  else:
    env[e.outvars[0]] = ans


def needed(prog: Program, targets: Iterable[Any], given: Iterable[Any] = ()) -> list[int]:
  """Indices of the equations that compute `targets`, in order (stopping at `given`)."""
  want = {v for v in targets if is_var(v)}
  stop = set(given)
  want -= stop
  keep = []
  for i in range(len(prog.eqns) - 1, -1, -1):
    e = prog.eqns[i]
    if any(v in want for v in e.outvars):
      keep.append(i)
      want.update(v for v in e.invars if is_var(v) and v not in stop)
  return keep[::-1]


Segments = Sequence[tuple[int, int]]  # [start, stop) runs of equation indices


def evaluate(prog: Program, env: dict, indices: Sequence[int], targets: Sequence[Any],
             segments: Segments = (), wrap: Callable | None = None,
             constrain: Callable[[Any, Any], Any] | None = None) -> list[Any]:
  """Evaluates `indices` (in order) into `env` and returns `targets`.

  Each run in `segments` is evaluated as one function passed through `wrap` (e.g.
  `jax.checkpoint` with a policy): its operands from outside in, what later equations or the
  targets read out. `constrain(slot, value)` replaces each value computed (a sharding
  constraint).
  """
  starts = {s: t for s, t in segments if wrap is not None and t > s + 1}
  bodies = {s for s, t in segments if wrap is not None and t == s + 1
            and prog.eqns[s].primitive.name == "scan"}
  later = _later_reads(prog, indices, targets)
  pos = 0
  while pos < len(indices):
    i = indices[pos]
    if i not in starts:
      bind(prog.eqns[i], env, _checkpointed_body(prog.eqns[i], wrap) if i in bodies else None)
      _constrain(prog.eqns[i], env, constrain)
      pos += 1
      continue
    stop = starts[i]
    run = []
    while pos < len(indices) and indices[pos] < stop:
      run.append(indices[pos])
      pos += 1
    _segment(prog, env, run, later[pos] if pos < len(later) else set(), wrap, constrain)
  return [read(v, env) for v in targets]


def _checkpointed_body(e: Eqn, wrap) -> dict:
  """A scan's params with its body (one layer of a scanned model) under `wrap`."""
  body = e.params["jaxpr"]
  fun = wrap(jcore.jaxpr_as_fun(body))
  closed = jax.make_jaxpr(lambda *xs: fun(*xs))(*[v.aval for v in body.jaxpr.invars])
  return {**e.params, "jaxpr": closed}


def _later_reads(prog: Program, indices: Sequence[int], targets) -> list[set]:
  """For each position p in `indices`: the vars read at p or after (or by the targets)."""
  out: list[set] = [set() for _ in range(len(indices) + 1)]
  acc = {v for v in targets if is_var(v)}
  out[len(indices)] = set(acc)
  for p in range(len(indices) - 1, -1, -1):
    acc = acc | {v for v in prog.eqns[indices[p]].invars if is_var(v)}
    out[p] = acc
  return out


def _constrain(e: Eqn, env: dict, constrain) -> None:
  if constrain is not None:
    for v in e.outvars:
      env[v] = constrain(v, env[v])


def _segment(prog: Program, env: dict, run: list[int], read_after: set, wrap,
             constrain=None) -> None:
  defined = {v for i in run for v in prog.eqns[i].outvars}
  ins = list(dict.fromkeys(v for i in run for v in prog.eqns[i].invars
                           if is_var(v) and v not in defined))
  outs = [v for i in run for v in prog.eqns[i].outvars if v in read_after]

  def body(*vals):
    local = dict(zip(ins, vals))
    for i in run:
      bind(prog.eqns[i], local)
      _constrain(prog.eqns[i], local, constrain)
    return [local[v] for v in outs]

  env.update(zip(outs, wrap(body)(*[env[v] for v in ins])))


def same_structure(a: Program, b: Program) -> bool:
  """Whether two traces of one function (at two batch sizes) have the same equations."""
  return (len(a.eqns) == len(b.eqns) and len(a.invars) == len(b.invars)
          and len(a.outvars) == len(b.outvars)
          and all(x.primitive is y.primitive and len(x.outvars) == len(y.outvars)
                  for x, y in zip(a.eqns, b.eqns)))


def first_difference(a: Program, b: Program) -> tuple[Eqn | None, Eqn | None]:
  """The first equations where two traces part (None past a program's end): the place a
  branch taken on the batch's size sends the smaller trace elsewhere."""
  for x, y in zip(a.eqns, b.eqns):
    if x.primitive is not y.primitive or len(x.outvars) != len(y.outvars):
      return x, y
  n = min(len(a.eqns), len(b.eqns))
  return (a.eqns[n] if n < len(a.eqns) else None, b.eqns[n] if n < len(b.eqns) else None)


def avals(atoms) -> list[Any]:
  return [jax.typeof(read(v, {})) if not is_var(v) else v.aval for v in atoms]
