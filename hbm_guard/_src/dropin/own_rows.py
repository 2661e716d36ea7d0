"""`x[jnp.arange(n), y]`: each example reads its own row of a per-example value.

The index's column for the batch axis is an `iota` over the batch: the position of each
example. Hoisted from the whole batch it would name rows a microbatch does not hold; counted
in each microbatch it names that microbatch's own, which is what the gather means. Found
here as a chain of values from the gather's index back to the iota, read by nothing else
(so that no other op reads the positions as numbers).
"""

from __future__ import annotations

from typing import Any

from hbm_guard._src.dropin import batch_tags as tags
from hbm_guard._src.dropin import jaxpr_flat as flat

Batched = tags.Batched
_shape = tags.shape_of


_CHAIN = frozenset({"broadcast_in_dim", "reshape", "convert_element_type", "expand_dims"})


def chain(e: flat.Eqn, ins: list, producers: dict) -> Any:
  """Where a gather reads, for the operand's batch axis, an `iota` over the batch in its
  index (`x[jnp.arange(n), y]`: each example its own row): the values from the index's
  index back to that iota (the iota last); None otherwise. Counted in each microbatch, they
  index that microbatch's own rows, where nothing else reads them (`only_as_own_rows`)."""
  if e.primitive.name != "gather" or len(ins) < 2:
    return None
  op, idx = ins[0], ins[1]
  dn = e.params["dimension_numbers"]
  if (not isinstance(op, Batched) or not isinstance(idx, Batched) or op.segments != 1
      or idx.segments != 1 or tuple(getattr(dn, "operand_batching_dims", ()))):
    return None
  rank = len(_shape(e.invars[1]))
  smap = tuple(dn.start_index_map)
  if (idx.axis >= rank - 1 or op.axis not in smap or op.axis not in tuple(dn.collapsed_slice_dims)
      or _shape(e.invars[0])[op.axis] != _shape(e.invars[1])[idx.axis]):
    return None
  column, v = smap.index(op.axis), e.invars[1]
  cat = producers.get(v)
  if cat is None:
    return None
  if cat.primitive.name == "concatenate" and cat.params["dimension"] == rank - 1:
    start, v = 0, None
    for piece in cat.invars:
      width = _shape(piece)[rank - 1]
      if start <= column < start + width:
        v = piece if width == 1 else None
      start += width
  elif len(smap) != 1:
    return None
  chain = [e.invars[1]]
  for _ in range(12):  # back through broadcasts, reshapes, casts, jnp's index wrapping
    if v is None or not flat.is_var(v) or (p := producers.get(v)) is None:
      return None
    chain.append(v)
    if p.primitive.name == "iota":
      shape = tuple(v.aval.shape)
      ok = len(shape) == 1 and shape[0] == _shape(e.invars[1])[idx.axis]
      return tuple(chain) if ok else None
    wrapped = _wrapped_index(p, producers)
    if wrapped is not None:  # `select_n(i < 0, i, i + n)`: i itself, for an iota's i
      chain += wrapped[1:]
      v = wrapped[0]
      continue
    if p.primitive.name not in _CHAIN:
      return None
    v = p.invars[0]
  return None


def only_as_own_rows(prog: flat.Program, values: set, gathers: set) -> flat.Eqn | None:
  """The first op that reads one of `values` (an iota over the batch and what indexing
  made of it) other than to build the index of one of `gathers`: the positions would be
  read as numbers there (None where there is no such op)."""
  for e in prog.eqns:
    if any(flat.is_var(v) and v in values for v in e.invars):
      if any(e is g for g in gathers) and not any(
          flat.is_var(v) and v in values for v in e.invars[:1]):
        continue
      if e.outvars and all(v in values for v in e.outvars):
        continue
      return e
  return None


def _wrapped_index(sel: flat.Eqn, producers: dict) -> tuple | None:
  """jnp's wrapping of a negative index, `select_n(i < 0, i, i + n)`: (i, the comparison,
  the sum)."""
  if sel.primitive.name != "select_n" or len(sel.invars) != 3:
    return None
  pred, i, plus = sel.invars
  lt, add = producers.get(pred), producers.get(plus)
  if lt is None or add is None or lt.primitive.name != "lt" or add.primitive.name != "add":
    return None
  if lt.invars[0] is not i or add.invars[0] is not i or flat.is_var(lt.invars[1]) or flat.is_var(
      add.invars[1]):
    return None
  return (i, pred, plus)


def gathered(e: flat.Eqn) -> list[int]:
  """A gather's output dimensions that come from its index's batch dimensions."""
  offset = tuple(e.params["dimension_numbers"].offset_dims)
  return [d for d in range(len(e.outvars[0].aval.shape)) if d not in offset]
