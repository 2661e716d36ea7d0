"""The user's step, built under a plan: one `jax.jit` object per plan (and state layout).

Each jit's traced function installs its plan (so plan-aware helpers follow it), records
what the trace told (`TraceFacts`), and only accepts the input signatures fitted to that
plan: an unfitted signature raises `NewSignature` before anything compiles, which is how
the guard learns of it without a check on every call.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np

from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.backends import flop_count
from hbm_guard._src.backends import options as options_lib
from hbm_guard._src.backends import trace as trace_lib
from hbm_guard._src.dropin import batch_context
from hbm_guard._src.dropin import intercept
from hbm_guard._src.plans import auto_offload
from hbm_guard._src.plans import keywords
from hbm_guard._src.plans import layout as layout_lib
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.plans import user_shardings
from hbm_guard._src.record import errors


class NewSignature(Exception):
  """Raised at trace time for an input signature not fitted to this jit's plan."""

  def __init__(self, key):
    super().__init__("hbm_guard: new input signature")
    self.key = key


@dataclasses.dataclass(eq=False)
class PlanJit:
  """A jit object for one plan (and, with a layout, one state structure)."""
  plan: plan_lib.Plan
  jitted: Any
  layout: dict[int, Any] | None
  allowed: set  # signatures this jit may trace
  facts: dict  # signature -> compile_lib.TraceFacts of its last trace

  def __call__(self, args, kwargs):
    try:
      return self.jitted(*args, **kwargs)
    except ValueError:
      # State the caller holds in another layout than the plan's (sharded, on host): move
      # it once; the step returns it in the planned layout, so later calls are direct.
      if not self.layout:
        raise
      return self.jitted(*layout_lib.place(args, self.layout), **kwargs)
    except jax.errors.JaxRuntimeError as e:
      # The plan donates state that another argument also holds (a DQN's target network
      # passed as `state["params"]`): jax.jit without the donation runs it, so the shared
      # buffers are copied for this call (refused before anything ran: nothing consumed).
      if _DONATED_TWICE not in str(e) or not self.plan.donate_argnums:
        raise
      return self.jitted(*unshared(args, self.plan.donate_argnums), **kwargs)


_DONATED_TWICE = "previously donated in the same call"


def unshared(args, donated) -> list:
  """`args` with each donated leaf that another argument also holds replaced by a copy."""
  donated = {i % len(args) for i in donated if -len(args) <= i < len(args)}
  held = {id(x) for i, a in enumerate(args) if i not in donated
          for x in jax.tree_util.tree_leaves(a)}
  seen: set = set()
  out = list(args)
  for i in sorted(donated):
    leaves, tree = jax.tree_util.tree_flatten(args[i])
    fresh = []
    for x in leaves:
      shared = id(x) in held or id(x) in seen
      seen.add(id(x))
      fresh.append(jnp.copy(x) if shared and isinstance(x, jax.Array) else x)
    out[i] = jax.tree_util.tree_unflatten(tree, fresh)
  return out


class StepBuilder:
  """Builds the step's jit objects per plan, and remembers what the state looks like."""

  def __init__(self, fun: Callable, options: options_lib.GuardOptions):
    self.fun, self.options = fun, options
    self.name = getattr(fun, "__name__", "step")
    self.replaced: tuple[tuple[int, Any], ...] = ()  # (argnum, output) the step returns anew
    self.n_outputs: int | None = None
    self._jits: dict[Hashable, PlanJit] = {}
    self._flops_of: dict[Hashable, float | None] = {}  # (plan run locally, signature) -> flops
    self._last_traced: tuple[Hashable, Any] | None = None  # (that key, the latest jaxpr)
    self._flops_lock = threading.Lock()


  def check_state_argnums(self, nargs: int) -> None:
    """`state_argnums` in range for a call with `nargs` positional arguments."""
    bad = [i for i in self.options.state_argnums if not -nargs <= i < nargs]
    if bad:
      raise errors.InvalidOptionError(
          f"hbm_guard: state_argnums {bad} out of range for {nargs} positional "
          f"argument(s) of {self.name}.")

  def static(self, nargs: int) -> tuple[int, ...]:
    return tuple(i % nargs for i in self.options.static_argnums) if nargs else ()

  def key(self, args, kwargs) -> Hashable:
    return trace_lib.signature(args, kwargs, self.static(len(args)),
                               self.options.static_argnames)

  def abstract(self, args, kwargs, layout, devices=None):
    """The arguments as shapes and dtypes placed by `layout` (for a compile, not a run); on
    a target's devices, the rest where the user's own shardings put them."""
    given = {}
    if devices is not None:
      kw = user_shardings.jit_kwargs_on(self.options.jax_jit_kwargs(), devices)
      given = user_shardings.for_args(kw, args, self.static(len(args)))
    return layout_lib.abstract_args(args, kwargs, layout, self.static(len(args)),
                                    self.options.static_argnames, devices, given)

  def learn(self, facts: compile_lib.TraceFacts | None) -> None:
    """The replaced state, from the first trace that saw it (the same for every plan)."""
    if facts is not None and not self.replaced:
      self.replaced, self.n_outputs = facts.replaced, facts.n_outputs

  def layout(self, plan: plan_lib.Plan, args, devices) -> dict[int, Any] | None:
    given = user_shardings.per_leaf(self.options.jax_jit_kwargs(), args,
                                    self.static(len(args)))
    try:
      given = user_shardings.on_devices(given, devices)
    except errors.InvalidOptionError:
      pass  # a mesh over a target's chips, laid out for this host: as the user gave it
    return layout_lib.plan_layout(plan, args, [i for i, _ in self.replaced], devices,
                                  self.options.offload_filter, self.static(len(args)), given)

  def _traced(self, plan: plan_lib.Plan, allowed, facts, mesh=None):
    fun, state_argnums = self.fun, self.options.state_argnums

    def run(*args, **kwargs):  # the optax update of an unmodified step follows the offload rung
      aware, originals = auto_offload.wrap_states(args, state_argnums)
      with auto_offload.nnx_optimizers():
        return auto_offload.restore_states(fun(*aware, **kwargs), originals)

    @functools.wraps(fun)
    def traced(*args, **kwargs):
      key = self.key(args, kwargs)
      if allowed is not None and key not in allowed:
        raise NewSignature(key)
      auto = dataclasses.replace(batch_context.Context.from_args(
          args, kwargs, state_argnums, self.static(len(args)), self.name, mesh),
          step_call=batch_context.StepCall(run, args, kwargs)
      ) if self.options.auto_plan_aware else None
      with plan_lib.plan_scope(plan) as scope, intercept.intercepting(auto):
        out = fun(*args, **kwargs) if auto is None else run(*args, **kwargs)
      notes = scope.notes
      facts[key] = compile_lib.TraceFacts(
          reads=frozenset(scope.reads), replaced=trace_lib.replaced_state(args, out, state_argnums),
          n_outputs=len(out) if isinstance(out, (tuple, list)) else None,
          batch_size=notes.batch_size, loss_form=notes.loss_form,
          optimizer_streaming=notes.optimizer_streaming, auto=notes.auto,
          auto_refused=notes.auto_refused)
      return out

    return traced

  def jit(self, plan: plan_lib.Plan, layout=None, nargs: int = 0, allowed=None, facts=None,
          devices=None):
    """A new `jax.jit` of the step under `plan` (`allowed` None: any signature), for
    `devices` (a target's) when given: the user's shardings rebuilt over them."""
    kw = self.options.jax_jit_kwargs()
    if devices is not None:
      kw = user_shardings.jit_kwargs_on(kw, devices)
    donate = tuple(sorted(set(self.options.user_donate) | set(plan.donate_argnums)))
    if donate:
      kw["donate_argnums"] = donate
    if plan.compiler_options:  # the user's own options, and the plan's over them
      kw["compiler_options"] = {**(kw.get("compiler_options") or {}),
                                **dict(plan.compiler_options)}
    if layout:
      static = set(self.static(nargs))
      user = user_shardings.for_args(kw, range(nargs), static)
      kw["in_shardings"] = tuple(layout.get(i, user.get(i)) for i in range(nargs)
                                 if i not in static)
      kw["out_shardings"] = user_shardings.merge_outputs(
          layout_lib.out_shardings(layout, self.replaced, self.n_outputs),
          kw.get("out_shardings"))
    mesh = layout_lib.batch_mesh(layout, [i for i, _ in self.replaced]) if layout else None
    traced = self._traced(plan, allowed, {} if facts is None else facts, mesh)
    if "in_shardings" in kw and layout:  # jax.jit then refuses keywords: pass them in place
      return keywords.KeywordsAsPositional(traced, kw, nargs)
    return jax.jit(traced, **kw)

  def on_devices(self, plan: plan_lib.Plan, args, kwargs, devices, facts=None):
    """The step under `plan` laid out for `devices` (a target's): the jit object and the
    abstract arguments to lower it with."""
    layout = self.layout(plan, args, devices)
    jitted = self.jit(plan, layout, len(args), None, facts, devices)
    return jitted, *self.abstract(args, kwargs, layout, devices)

  def plan_jit(self, plan: plan_lib.Plan, args) -> PlanJit:
    """The local jit object for `plan` (one per plan and, with a layout, state structure)."""
    layout = self.layout(plan, args, jax.devices()) if args is not None else None
    state = None if layout is None else tuple(args[i] for i in layout)
    # By what the plan does, not the order its rungs were named in: a plan probed (a full
    # compile here) and then chosen under another name runs the executable compiled then.
    jkey = (dataclasses.replace(plan, rungs=()),
            None if state is None else jax.tree_util.tree_structure(state),
            None if state is None else tuple(np.shape(x) for x in jax.tree.leaves(state)))
    entry = self._jits.get(jkey)
    if entry is None:
      allowed, facts = set(), {}
      nargs = len(args) if args is not None else 0
      entry = PlanJit(plan, self.jit(plan, layout, nargs, allowed, facts), layout, allowed,
                      facts)
      self._jits[jkey] = entry
    elif entry.plan != plan:
      entry = dataclasses.replace(entry, plan=plan)  # the same jit object, named as asked
    return entry

  def learn_state(self, args, kwargs, lower: bool = False):
    """Traces (or lowers) under the default plan: which state the step replaces."""
    facts: dict = {}
    jitted = self.jit(plan_lib.Plan(), None, len(args), None, facts)
    if lower:  # by shape and dtype only: where the caller's arrays live is not the program
      args, kwargs = layout_lib.shapes_only(args, kwargs, self.static(len(args)),
                                            self.options.static_argnames)
    out = jitted.lower(*args, **kwargs) if lower else jitted.trace(*args, **kwargs)
    if facts:
      self.learn(next(iter(facts.values())))
    return out

  def flops(self, plan: plan_lib.Plan, args, kwargs, n_devices: int = 1) -> float | None:
    """The step's compute per device under `plan`, counted on the whole batch's program:
    a plan that shards the batch over n devices does 1/n of it on each; one that leaves
    it replicated does all of it on every device."""
    flops = self._flops(plan, args, kwargs)
    skip = {i for i, _ in self.replaced} | set(self.static(len(args)))
    if flops and layout_lib.batch_sharded(plan, args, skip, n_devices):
      return flops / n_devices
    return flops

  def _flops(self, plan: plan_lib.Plan, args, kwargs) -> float | None:
    key = (_run_locally(plan), self.key(args, kwargs))
    with self._flops_lock:  # priced ahead in another thread (prepare.py): wait, not twice
      return self._flops_locked(key, args, kwargs)

  def _flops_locked(self, key, args, kwargs) -> float | None:
    if key not in self._flops_of:  # plans that differ only in layout run the same program
      pending, jaxpr = self._last_traced, None
      if pending is not None and pending[0] == key:
        self._last_traced, jaxpr = None, pending[1]
      try:
        if jaxpr is None:
          jaxpr = self.jit(key[0], None, len(args)).trace(*args, **kwargs).jaxpr
        self._flops_of[key] = flop_count.count(jaxpr) or None
      except Exception:  # pylint: disable=broad-except  (a price is a preference, not a need)
        self._flops_of[key] = None
    return self._flops_of[key]

  def saw_traced(self, plan: plan_lib.Plan, args, kwargs, traced) -> None:
    """The latest compile's own trace, kept (one jaxpr) so that pricing its plan does not
    trace the step again: seconds at real size, on a target too. None lets it go."""
    self._last_traced = None if traced is None else (
        (_run_locally(plan), self.key(args, kwargs)), traced.jaxpr)


def _run_locally(plan: plan_lib.Plan) -> plan_lib.Plan:
  """The plan as far as the program's arithmetic goes: layout and flags aside."""
  return dataclasses.replace(plan, offload_optimizer=False, shard_state=False,
                             shard_batch=False, donate_argnums=(), compiler_options=(),
                             rungs=())
