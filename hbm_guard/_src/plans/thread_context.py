"""The caller's tracing context, carried into a helper thread that traces for it.

jax keeps `jax.set_mesh`, the deprecated `with mesh:`, `jax.enable_x64`,
`jax.default_matmul_precision` and the like per thread, and Python's context variables
start empty in a new thread. A thread that lowers probes, prices plans or compiles for the
fit must trace the step as the caller's thread would: a step written for `jax.set_mesh`
(a reshard to a bare PartitionSpec) failed to trace there, and what the thread was
preparing was lost.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import dataclasses
import threading
from typing import Any, Callable

import jax

from hbm_guard._src.plans import user_shardings

try:  # jax's thread-local config values (x64, matmul precision, ...): private, so optional
  from jax._src import config as _jax_config
except ImportError:  # pragma: no cover
  _jax_config = None
try:  # the deprecated `with mesh:` context, thread-local too: private, so optional
  from jax._src import mesh as _jax_mesh
except ImportError:  # pragma: no cover
  _jax_mesh = None


def _legacy_resources() -> Any:
  """The mesh environment a `with mesh:` block set in this thread, or None."""
  return getattr(getattr(_jax_mesh, "thread_resources", None), "env", None)


def _local_config() -> tuple[tuple[Any, Any], ...]:
  """(state, value) for each jax config value this thread has set for itself."""
  states = getattr(_jax_config, "config_states", None)
  unset = getattr(getattr(_jax_config, "config_ext", None), "unset", None)
  if not states or unset is None:
    return ()
  out = []
  for state in list(states.values()):
    try:
      value = state.get_local()
    except Exception:  # pylint: disable=broad-except  (a state without a local value)
      continue
    if value is not unset:
      out.append((state, value))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Captured:
  """What a thread had set when `capture` was called; `run` reproduces it elsewhere."""
  mesh: Any  # the user's jax.set_mesh mesh, or None
  local_config: tuple[tuple[Any, Any], ...]
  variables: contextvars.Context
  legacy_resources: Any = None  # a `with mesh:` block's environment, or None

  def run(self, fn: Callable[..., Any], *args) -> Any:
    return self.variables.copy().run(self._run, fn, args)

  def _run(self, fn, args):
    previous = [(state, state.swap_local(value)) for state, value in self.local_config]
    env = _legacy_resources()
    if self.legacy_resources is not None and env is not None:
      _jax_mesh.thread_resources.env = self.legacy_resources
    try:
      if self.mesh is None:
        return fn(*args)
      with jax.set_mesh(self.mesh):
        return fn(*args)
    finally:
      if self.legacy_resources is not None and env is not None:
        _jax_mesh.thread_resources.env = env
      for state, value in reversed(previous):
        state.set_local(value)


def capture() -> Captured:
  """This thread's tracing context, to run a helper thread's work under."""
  return Captured(user_shardings.context_mesh(), _local_config(), contextvars.copy_context(),
                  _legacy_resources())


def submit(fn: Callable[[], Any], name: str) -> concurrent.futures.Future:
  """Runs `fn` in a daemon thread under this thread's tracing context: a future of its
  result, which the caller may stop waiting for (a libtpu compile cannot be stopped; a
  daemon thread does not hold the process open for it)."""
  future: concurrent.futures.Future = concurrent.futures.Future()
  future.set_running_or_notify_cancel()
  captured = capture()
  def run():
    try:
      future.set_result(captured.run(fn))
    except BaseException as e:  # pylint: disable=broad-except  (raised again to the caller)
      future.set_exception(e)
  threading.Thread(target=run, daemon=True, name=name).start()
  return future
