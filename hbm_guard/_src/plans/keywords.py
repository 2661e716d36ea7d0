"""Keyword arguments under a plan's layout.

`jax.jit` refuses keyword arguments once `in_shardings` are given ("pjit does not support
kwargs when in_shardings is specified"), and a plan that reshards or offloads gives them.
A step the user calls with keywords would then fail only under those plans. So the jit is
built per set of keyword names, taking them as trailing positional arguments: static
and donated names become static and donated positions, the rest stay where they are.
"""

from __future__ import annotations

from typing import Any, Callable

import jax


class KeywordsAsPositional:
  """A `jax.jit` lookalike (`__call__`, `lower`, `trace`) over `fun` with `kw`'s shardings
  for `nargs` positional arguments, whatever keywords a call passes."""

  def __init__(self, fun: Callable, kw: dict[str, Any], nargs: int):
    self._fun, self._kw, self._nargs = fun, dict(kw), nargs
    self._jits: dict[tuple[str, ...], Any] = {}

  def _jit(self, names: tuple[str, ...]):
    if names not in self._jits:
      self._jits[names] = jax.jit(_positional(self._fun, self._nargs, names),
                                  **_kw_for(self._kw, self._nargs, names))
    return self._jits[names]

  def _split(self, args, kwargs):
    names = tuple(sorted(kwargs))
    return self._jit(names), (*args, *(kwargs[n] for n in names))

  def __call__(self, *args, **kwargs):
    jitted, flat = self._split(args, kwargs)
    return jitted(*flat)

  def lower(self, *args, **kwargs):
    jitted, flat = self._split(args, kwargs)
    return jitted.lower(*flat)

  def trace(self, *args, **kwargs):
    jitted, flat = self._split(args, kwargs)
    return jitted.trace(*flat)


def _positional(fun: Callable, nargs: int, names: tuple[str, ...]) -> Callable:
  def call(*flat):
    return fun(*flat[:nargs], **dict(zip(names, flat[nargs:])))
  call.__name__ = getattr(fun, "__name__", "step")
  return call


def _kw_for(kw: dict[str, Any], nargs: int, names: tuple[str, ...]) -> dict[str, Any]:
  out = {k: v for k, v in kw.items() if k not in ("static_argnames", "donate_argnames")}
  static = set(kw.get("static_argnames") or ())
  donated = set(kw.get("donate_argnames") or ())
  at = {n: nargs + j for j, n in enumerate(names)}
  own = lambda key: tuple(i % nargs for i in (out.get(key) or ())) if nargs else ()  # noqa: E731
  out["static_argnums"] = own("static_argnums") + tuple(at[n] for n in names if n in static)
  donate = own("donate_argnums") + tuple(at[n] for n in names if n in donated)
  if donate:
    out["donate_argnums"] = donate
  if out.get("in_shardings") is not None:
    out["in_shardings"] = tuple(out["in_shardings"]) + tuple(
        None for n in names if n not in static)
  return out
