"""The repeated layers of a traced loss, as runs of equations to checkpoint one by one.

Per-layer remat needs the layer boundaries of a model the guard did not write. Two
readings of the jaxpr:
- name stacks: Flax linen names each module call (`decoder/encoderdecoderblock_3/...`);
  the family of `<name>_<n>` siblings covering most equations is the layers;
- parameters: where no names are recorded (nnx), each layer reads its own parameters in
  the same pattern; the longest repeating pattern of parameter reads marks the layers;
- a scan over parameters (`nn.scan`, `nnx.scan`): its body is one layer;
- one module applied again and again (ALBERT's shared block): its name does not change,
  but the parameters it reads repeat, each repeat a layer.
Of the readings found, the one whose layers read the most parameter elements is the stack:
a final LayerNorm's scale and bias repeat one read twice, beside a scan of every layer.
"""

from __future__ import annotations

import bisect
import collections
import math
import re
from typing import Any, Sequence

from hbm_guard._src.dropin import jaxpr_flat as flat

_NUMBERED = re.compile(r"(.*?)_?(\d+)")
_MIN_LAYERS = 2
OTHER_FAMILY_SHARE = 0.25  # another family of layers: at least this share of the largest's


def segments(prog: flat.Program, indices: Sequence[int], params: Sequence[Any]
             ) -> tuple[list[tuple[int, int]], str | None]:
  """[start, stop) equation runs, one per layer, and a description; ([], None) if none."""
  indices, params = list(indices), set(params)
  named = _by_names(prog, indices)
  # (the repeated reads' search is quadratic in the reads: only where no names are recorded)
  readings = [r for r in (named if named[0] else _by_parameters(prog, indices, params),
                          _scanned(prog, indices, params), _shared(prog, indices, params))
              if r[0]]
  # max keeps the first of equals: names or repeated reads before a scan
  return max(readings, key=lambda r: _parameters_read(prog, r[0], params), default=([], None))


def _parameters_read(prog, runs, params) -> int:
  """Elements of the parameters read inside `runs`: what the layers hold."""
  read = {v for a, b in runs for i in range(a, b) for v in prog.eqns[i].invars
          if flat.is_var(v) and v in params}
  return sum(math.prod(v.aval.shape) for v in read)


def _scanned(prog, indices, params):
  """Layers stacked under `nn.scan` / `nnx.scan`: a scan over the parameters; its body is
  one layer (checkpointed as such: a run of one scan equation)."""
  runs = [(i, i + 1) for i in indices if prog.eqns[i].primitive.name == "scan"
          and any(flat.is_var(v) and v in params for v in prog.eqns[i].invars)]
  if not runs:
    return [], None
  lengths = [prog.eqns[i].params.get("length") for i, _ in runs]
  return runs, f"{sum(lengths)} scanned layers (the body of {len(runs)} scan)"


def _shared(prog, indices, params):
  """A module applied again and again with the same parameters: under its name, the
  sequence of its parameter reads (each with its op) is one application's, repeated. Each
  application runs from its first read to its module's last equation before the next (a
  module shared by the layers, as a position bias, is not the layers). Of such modules,
  the one whose applications read the most parameter elements."""
  reads: dict = collections.defaultdict(list)  # module path -> [(equation, (op, parameter))]
  members: dict = collections.defaultdict(list)  # module path -> its equations
  for i in indices:
    eqn = prog.eqns[i]
    read = [(eqn.primitive.name, v) for v in eqn.invars if flat.is_var(v) and v in params]
    parts = eqn.name_stack.split("/") if eqn.name_stack else []
    for d in range(1, len(parts) + 1):
      members[tuple(parts[:d])].append(i)
      reads[tuple(parts[:d])] += [(i, r) for r in read]
  found = []
  for path, seq in reads.items():
    period = _period([r for _, r in seq])
    if period is None:
      continue
    starts = [seq[r * period][0] for r in range(len(seq) // period)]
    ends = [members[path][bisect.bisect_left(members[path], nxt) - 1] + 1 for nxt in starts[1:]]
    found.append((list(zip(starts, ends + [members[path][-1] + 1])),
                  f"{'/'.join(path)} applied {len(starts)} times (by repeated parameters)"))
  return max(found, key=lambda r: _parameters_read(prog, r[0], params), default=([], None))


def _period(items: list) -> int | None:
  """The shortest period that repeats `items` whole, at least twice (None if none)."""
  n = len(items)
  for p in range(1, n // _MIN_LAYERS + 1):
    if n % p == 0 and all(items[j] == items[j + p] for j in range(n - p)):
      return p
  return None


def _by_names(prog, indices):
  """The family of numbered siblings covering most equations, and any other family
  disjoint from it that covers at least OTHER_FAMILY_SHARE as much (an encoder's blocks
  beside a decoder's: `T5/Enc_0..3`, `T5/Dec_0..3`)."""
  count: dict = collections.defaultdict(collections.Counter)
  stacks = [prog.eqns[i].name_stack.split("/") for i in indices]
  for parts in stacks:
    for d, comp in enumerate(parts):
      m = _NUMBERED.fullmatch(comp)
      if m:
        count[(tuple(parts[:d]), m.group(1))][comp] += 1
  fams = sorted(((sum(c.values()), -len(k[0]), k) for k, c in count.items()
                 if len(c) >= _MIN_LAYERS), reverse=True)
  if not fams:
    return [], None
  runs, wheres, n_layers = [], [], 0
  for covered, _, (parent, stem) in fams:
    if covered < OTHER_FAMILY_SHARE * fams[0][0]:
      break
    family = _family_runs(indices, stacks, parent, stem)
    if any(a < d and c < b for a, b in family for c, d in runs):
      continue  # nested in (or around) a family already taken
    runs += family
    names = sorted(count[(parent, stem)], key=lambda s: int(re.search(r"\d+$", s).group()))
    wheres.append("/".join((*parent, f"{names[0]}..{names[-1].rsplit('_', 1)[-1]}")))
    n_layers += len(names)
  return sorted(runs), f"{', '.join(wheres)} ({n_layers} layers, by module name)"


def _family_runs(indices, stacks, parent, stem) -> list[tuple[int, int]]:
  """[start, stop) runs of equations, one per member of the family `parent/stem_<n>`."""
  depth = len(parent)
  member_re = re.compile(rf"{re.escape(stem)}_?\d+")
  runs, current = [], None
  for i, parts in zip(indices, stacks):
    member = parts[depth] if len(parts) > depth and tuple(parts[:depth]) == parent else None
    if member is not None and not member_re.fullmatch(member):
      member = None
    if member is not None and current is not None and current[0] == member:
      current[2] = i + 1
      continue
    if current is not None:
      runs.append((current[1], current[2]))
    current = [member, i, i + 1] if member is not None else None
  if current is not None:
    runs.append((current[1], current[2]))
  return runs


def _by_parameters(prog, indices, params):
  reads = [(i, (prog.eqns[i].primitive.name, tuple(
      tuple(v.aval.shape) for v in prog.eqns[i].invars if flat.is_var(v) and v in params)))
           for i in indices if any(flat.is_var(v) and v in params for v in prog.eqns[i].invars)]
  tokens = [t for _, t in reads]
  best = None  # (coverage, period, start, repeats)
  n = len(tokens)
  for p in range(1, n // _MIN_LAYERS + 1):
    run = 0
    for j in range(n - p):
      run = run + 1 if tokens[j] == tokens[j + p] else 0
      repeats = run // p + 1
      if run >= p and (best is None or repeats * p > best[0]):
        best = (repeats * p, p, j - run + 1, repeats)
  if best is None or best[3] < _MIN_LAYERS:
    return [], None
  _, p, start, repeats = best
  starts = [reads[start + r * p][0] for r in range(repeats)]
  after = start + repeats * p
  end = reads[after][0] if after < n else indices[-1] + 1
  runs = [(a, b) for a, b in zip(starts, starts[1:] + [end])]
  return runs, f"{repeats} layers of {p} parameter reads each (by repeated structure)"
