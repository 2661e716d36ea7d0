"""Where a program's memory goes at its peak, by kind, by layer and by buffer, from XLA's
own buffer assignment (`buffer_dump`), each part with the rung that removes it.

The device memory (memory space 0) of a program is the sum of its allocations: the entry
parameters (the step's arguments: parameters, optimizer state, the batch), outputs not
aliased to a parameter, XLA's arena of temporaries, and small thread-local and constant
ones. The arena is sized for the moment most temporaries are live: that moment is found on
the schedule (the values' live ranges), and what is live then is read by its instruction's
name stack — the backward pass (`transpose(jvp(...))`), the forward values still held for
it (activations, by the layer their Flax module path names), the loss head (the values of
the logits' shape) — and its source line. Padding (S3.C) is the bytes a value's tiled
layout adds to its shape's own.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import os
import re
from typing import Any, Sequence

from hbm_guard._src.memory import buffer_dump
from hbm_guard._src.memory import hlo_names as names

TOLERANCE = 0.05  # the parts sum to the compiler's own figure within this share
TOP = 10  # buffers listed


class Kind(enum.StrEnum):
  PARAMETERS = "parameters"
  OPTIMIZER_STATE = "optimizer state"
  OTHER_STATE = "other state"
  BATCH = "batch"
  OUTPUTS = "outputs not aliased to inputs"
  ACTIVATIONS = "activations saved for the backward pass"
  LOSS_HEAD = "loss head (logits and their softmax)"
  GRADIENTS = "gradients and the backward pass"
  COLLECTIVES = "collective and host-transfer buffers"
  TEMPORARIES = "other temporaries"
  ARENA_SLACK = "temporaries' arena beyond what is live at the peak"
  PROGRAM = "program scratch and constants"


# Which rung removes each kind, and what it does to it (a share of the part that remains,
# for a count k where one applies), in the ladder's own rung names.
_RUNGS: dict[Kind, tuple[str, ...]] = {
    Kind.ACTIVATIONS: ("microbatch", "layer_remat"),
    Kind.LOSS_HEAD: ("microbatch",),
    Kind.OPTIMIZER_STATE: ("offload_optimizer", "reshard_fsdp"),
    Kind.PARAMETERS: ("reshard_fsdp",),
    Kind.OUTPUTS: ("donate",),
    Kind.GRADIENTS: ("reshard_fsdp",),
    Kind.TEMPORARIES: ("microbatch",),
}
_NOT_TOUCHED = {Kind.LOSS_HEAD: "layer_remat does not touch it",
                Kind.GRADIENTS: "microbatching keeps them whole (accumulated)",
                Kind.BATCH: "microbatching keeps the batch whole (it is split as it is read)",
                Kind.PROGRAM: "no rung changes it"}
_COLLECTIVE_OPS = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute",
                   "all-to-all", "send", "recv")
_LOSS_OPS = ("softmax", "logsumexp", "cross_entropy", "log_softmax", "xent", "nll")


@dataclasses.dataclass(frozen=True)
class Saving:
  """What one rung does to a part: `rung` (with its count) leaves `remaining` bytes."""
  rung: str
  remaining: int

  def to_dict(self) -> dict[str, Any]:
    return {"rung": self.rung, "remaining_bytes": self.remaining}


@dataclasses.dataclass(frozen=True)
class Part:
  kind: Kind
  bytes: int
  savings: tuple[Saving, ...] = ()
  untouched: str | None = None  # what does not reduce it, said

  def to_dict(self) -> dict[str, Any]:
    return {"kind": self.kind.value, "bytes": self.bytes,
            "savings": [s.to_dict() for s in self.savings], "untouched": self.untouched}


@dataclasses.dataclass(frozen=True)
class Buffer:
  """One value live at the peak (or an argument), as a person reads it."""
  bytes: int
  shape: str  # "f32[8,1024,262144]"
  kind: Kind
  module: str | None  # the Flax module path from the name stack ("LM/block_3/Dense_0")
  op: str | None  # the operation ("dot_general", "log_softmax")
  source: str | None  # the user's file and line ("train.py:17")
  padding: int = 0

  def to_dict(self) -> dict[str, Any]:
    return {"bytes": self.bytes, "shape": self.shape, "kind": self.kind.value,
            "module": self.module, "op": self.op, "source": self.source,
            "padding_bytes": self.padding}

  def describe(self) -> str:
    where = f" at {self.source}" if self.source else ""
    what = f" ({self.op})" if self.op else ""
    return f"{self.shape} {fmt(self.bytes)}{where}{what}"


@dataclasses.dataclass(frozen=True)
class Breakdown:
  """The peak of one compile, by kind, by layer and by buffer, with its sources said."""
  source: str  # where the figures come from
  total: int  # the device memory the parts add up to
  parts: tuple[Part, ...]
  layers: tuple[tuple[str, int], ...]  # activations held per layer at the peak
  top: tuple[Buffer, ...]
  padding: int
  checked_against: str | None = None  # "the compiler's figure 25.27G (early check)"
  figure: int | None = None
  notes: tuple[str, ...] = ()
  seconds: float = 0.0  # what reading the dump and computing this took
  # the most each kind of temporary holds at any point of the schedule (not only at the
  # program's peak): what a rung's prediction for that kind is held against
  own_peaks: tuple[tuple[Kind, int], ...] = ()
  # the same in the chip's on-chip memory (TPU VMEM, memory space 1), where the compiler
  # placed values that fit there: not device memory, but where a part went
  on_chip_peaks: tuple[tuple[Kind, int], ...] = ()
  # values the compiler's own rematerialization pass made (XLA names its copies
  # `.remat`): it ran because the program as written was over the limit, so this
  # program holds less than the step as written needs
  compiler_remat: int = 0

  @property
  def agrees(self) -> bool | None:
    """Whether the parts sum to the compiler's figure within TOLERANCE."""
    if not self.figure:
      return None
    return abs(self.total - self.figure) <= TOLERANCE * self.figure

  def part(self, kind: Kind) -> int:
    return sum(p.bytes for p in self.parts if p.kind is kind)

  def largest(self, n: int = 3) -> list[Part]:
    return sorted((p for p in self.parts if p.bytes), key=lambda p: -p.bytes)[:n]

  def summary(self, n: int = 3) -> str:
    """The largest parts, for a progress line: "loss head 8.0 GiB, activations 6.1 GiB"."""
    return ", ".join(f"{p.kind.value} {fmt(p.bytes)}" for p in self.largest(n))

  def savings(self) -> dict[str, int]:
    """What each rung is predicted to free here (bytes), the largest first."""
    out: dict[str, int] = collections.Counter()
    for p in self.parts:
      for s in p.savings:
        out[s.rung.split("(")[0]] += p.bytes - s.remaining
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))

  def to_dict(self) -> dict[str, Any]:
    return {"source": self.source, "total_bytes": self.total,
            "checked_against": self.checked_against, "figure_bytes": self.figure,
            "agrees": self.agrees, "tolerance": TOLERANCE,
            "parts": [p.to_dict() for p in self.parts],
            "layers": [{"layer": name, "bytes": n} for name, n in self.layers],
            "top": [b.to_dict() for b in self.top], "padding_bytes": self.padding,
            "savings": self.savings(), "notes": list(self.notes),
            "own_peak_bytes": {k.value: n for k, n in self.own_peaks},
            "on_chip_peak_bytes": {k.value: n for k, n in self.on_chip_peaks},
            "compiler_rematerialized": self.compiler_remat,
            "seconds": round(self.seconds, 3)}


def fmt(n: int) -> str:
  """Bytes as a person reads them."""
  for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"


@dataclasses.dataclass(frozen=True)
class Arguments:
  """What the step's arguments are, to name the entry parameters by: each parameter's
  kind from its pytree path (`state.params[...]`, `state.opt_state[...]`, `batch[...]`)."""
  state_names: tuple[str, ...] = ()  # the step's state arguments' names
  state_argnums: tuple[int, ...] = ()  # and positions (a plan's wrapper names them flat[i])
  microbatches: int = 1  # the plan's count (the savings of a further split are from here)
  devices: int = 1  # the chips a plan may shard the state over

  def kind(self, path: str) -> Kind:
    head = re.split(r"[.\[]", path, maxsplit=1)[0]
    wrapped = re.match(r"^\w+\[(\d+)\]", path)  # a plan's wrapper: `flat[0].params[...]`
    if head not in self.state_names and wrapped and int(wrapped.group(1)) in self.state_argnums:
      head = self.state_names[0] if self.state_names else "state"
    lower = path.lower()
    if "opt_state" in lower or re.search(r"\b(mu|nu|momentum|trace)\b", lower):
      return Kind.OPTIMIZER_STATE
    if head in self.state_names or head == "state" or (not self.state_names and "param" in lower):
      return Kind.PARAMETERS if "param" in lower else Kind.OTHER_STATE
    return Kind.BATCH


def compute(dump: buffer_dump.Dump, args: Arguments, *, figure: int | None = None,
            figure_name: str | None = None, code_bytes: int | None = None,
            scoped_bytes: int | None = None) -> Breakdown:
  """The breakdown of `dump`'s program (checked against `figure`, the compiler's own);
  `code_bytes`, `scoped_bytes`: the program's code and the compiler's scoped scratch, where
  the compiler said them (memory_analysis(), the error's own breakdown)."""
  notes = list(dump.notes)
  device = [a for a in dump.allocations if a.color == 0]
  if not device:
    return Breakdown("XLA's buffer assignment (dump)", 0, (), (), (), 0, None, figure,
                     tuple(notes + ["the dump held no allocation in device memory"]))
  amounts: dict[Kind, int] = collections.Counter()
  buffers: list[Buffer] = []
  padding = 0
  for a in device:
    if a.parameter is not None:
      v = a.values[0] if a.values else None
      ins = dump.instructions.get(v.name) if v else None
      path = (ins.op_name if ins and ins.op_name else (v.name if v else f"parameter {a.parameter}"))
      kind = args.kind(path)
      amounts[kind] += a.size
      pad = names.padding(v.shape, a.size) if v else 0
      padding += pad
      buffers.append(Buffer(a.size, names.shape(v.shape) if v else "?", kind, None, path, None, pad))
    elif a.temp:
      continue
    elif a.live_out:
      amounts[Kind.OUTPUTS] += a.size
    else:
      amounts[Kind.PROGRAM] += a.size
  arena = sum(a.size for a in device if a.temp and a.parameter is None)
  temps = [a for a in device if a.temp and a.parameter is None]
  live, moment = _live_at_peak(dump, temps)
  own_peaks: tuple = ()
  on_chip: tuple = ()
  if live is None:
    notes.append("the live ranges were not read: the temporaries are one part")
    amounts[Kind.TEMPORARIES] += arena
  else:
    head_shapes = _loss_head_shapes(dump)
    param_shapes = {names.shape(a.values[0].shape) for a in device
                    if a.parameter is not None and a.values and a.size >= 1 << 16}
    layers: dict[str, int] = collections.Counter()
    held = 0
    for v in live:
      ins = dump.instructions.get(v.name)
      kind = _kind_of(ins, v, head_shapes, param_shapes)
      amounts[kind] += v.size
      held += v.size
      pad = names.padding(v.shape, v.size)
      padding += pad
      module = names.module(ins.op_name) if ins else None
      if kind is Kind.ACTIVATIONS and module:
        layers[names.layer(module)] += v.size
      buffers.append(Buffer(v.size, names.shape(v.shape), kind, module,
                            names.op(ins.op_name) if ins else v.name,
                            dump.source_of(ins.frame) if ins else None, pad))
    amounts[Kind.ARENA_SLACK] += max(0, arena - held)
    kind_of = lambda v: _kind_of(dump.instructions.get(v.name), v, head_shapes,  # noqa: E731
                                 param_shapes)
    own_peaks = _own_peaks(dump, temps, kind_of)
    on_chip = _own_peaks(dump, [a for a in dump.allocations if a.color == 1], kind_of)

  remat = sum(1 for a in device for v in a.values if names.is_compiler_remat(v.name))
  if remat:
    notes.append(f"the compiler rematerialized {remat} value(s) itself (XLA's remat pass, "
                 f"`.remat` copies): the step as written needs more than this program "
                 f"holds, and its activations here are what was left after that pass")
  if scoped_bytes:
    amounts[Kind.PROGRAM] += scoped_bytes
  if code_bytes:  # (libtpu's memory_analysis() counts its temporaries there: not added)
    notes.append(f"memory_analysis() reports {fmt(code_bytes)} of generated code, which "
                 f"libtpu's figure shares with the temporaries: not added to the parts")
  elif figure is not None:
    notes.append("the program's code size is not in the dump (not counted)")
  total = sum(amounts.values())
  parts = tuple(_part(kind, n, args) for kind, n in amounts.items() if n)

  top = tuple(sorted(buffers, key=lambda b: -b.bytes)[:TOP])
  layers_t = tuple(sorted(layers.items(), key=lambda kv: names.order(kv[0]))) if live else ()
  checked = None
  if figure:
    checked = f"{figure_name or 'the compiler'}'s figure, {fmt(figure)}"
    if abs(total - figure) > TOLERANCE * figure:
      notes.append(f"the parts sum to {fmt(total)}, {abs(total - figure) / figure:.0%} "
                   f"from {checked}")
  source = "XLA's buffer assignment and live ranges (dump)" + (
      f", at schedule position {moment}" if moment is not None else "")
  return Breakdown(source, total, parts, layers_t, top, padding, checked, figure, tuple(notes),
                   own_peaks=own_peaks, on_chip_peaks=on_chip, compiler_remat=remat)


def from_listing(allocations: Sequence[Any], figure: int | None = None) -> Breakdown | None:
  """A partial breakdown from the allocations an error message lists (its largest only:
  said so), each read by its op name as a dumped value is: the backward pass, the forward
  values held for it, the loss head; None where the message lists none."""
  listed = [a for a in allocations if getattr(a, "size_bytes", None)]
  if not listed:
    return None
  amounts: dict[Kind, int] = collections.Counter()
  buffers = []
  for a in listed:
    name = a.op_name or a.xla_label or ""
    kind = (Kind.LOSS_HEAD if any(op in name for op in _LOSS_OPS) else
            Kind.GRADIENTS if "transpose(" in name else
            Kind.ACTIVATIONS if "jvp(" in name else
            Kind.BATCH if (a.allocation_type or "").startswith("parameter") else
            Kind.TEMPORARIES)
    amounts[kind] += a.size_bytes
    source = (f"{os.path.basename(a.source_file)}:{a.source_line}" if a.source_file
              and a.source_line else a.source_file)
    buffers.append(Buffer(a.size_bytes, names.shape(a.shape_text) if a.shape_text else "?", kind,
                          names.module(name) if name else None,
                          names.op(name) or None, source, a.padding_bytes or 0))
  total = sum(amounts.values())
  parts = tuple(_part(kind, n, Arguments()) for kind, n in amounts.items())
  return Breakdown("the error message's listing of its largest allocations (not the whole "
                   "program)", total, parts, (), tuple(sorted(buffers, key=lambda b: -b.bytes)[:TOP]),
                   sum(b.padding for b in buffers), None, figure,
                   (f"the {len(listed)} allocations listed add up to {fmt(total)}"
                    + (f" of the {fmt(figure)} needed" if figure else ""),))


def _part(kind: Kind, n: int, args: Arguments) -> Part:
  """A part, with what each rung that reduces it would leave of it: a microbatch count
  four times the plan's keeps a quarter of what is per microbatch; remat per layer keeps
  the layers' inputs (not counted here: an upper bound on its saving); offload and
  donation take it out of device memory; FSDP keeps a chip's share."""
  savings = []
  for rung in _RUNGS.get(kind, ()):
    if rung == "microbatch":
      k = args.microbatches
      savings.append(Saving(f"microbatch({4 * k})", n // 4))
    elif rung == "layer_remat":
      savings.append(Saving("layer_remat(nothing_saveable)", 0))
    elif rung in ("offload_optimizer", "donate"):
      savings.append(Saving(rung, 0))
    elif rung == "reshard_fsdp" and args.devices > 1:
      savings.append(Saving(f"reshard_fsdp({args.devices} chips)", n // args.devices))
  return Part(kind, n, tuple(savings), _NOT_TOUCHED.get(kind))


def _live_at_peak(dump: buffer_dump.Dump, arenas: Sequence[buffer_dump.Allocation]
                  ) -> tuple[list | None, int | None]:
  """The values of the arenas live at the schedule's position where most bytes are."""
  values = [v for a in arenas for v in a.values]
  if not values or not dump.ranges:
    return None, None
  events = []
  for v in values:
    r = dump.ranges.get(v.key)
    if r is not None:
      events.append((r[0], v.size))
      events.append((r[1] + 1, -v.size))
  if not events:
    return None, None
  events.sort()
  best, at, now = -1, None, 0
  for t, delta in events:
    now += delta
    if now > best and delta > 0:
      best, at = now, t
  live = [v for v in values if (r := dump.ranges.get(v.key)) is not None and r[0] <= at <= r[1]]
  return live, at


def _own_peaks(dump: buffer_dump.Dump, arenas: Sequence[buffer_dump.Allocation], kind_of
               ) -> tuple[tuple[Kind, int], ...]:
  """The most the temporaries of each kind hold at once, anywhere in the schedule: one
  sweep over the live ranges, a running total per kind."""
  events = []
  for v in (v for a in arenas for v in a.values):
    r = dump.ranges.get(v.key)
    if r is not None:
      kind = kind_of(v)
      events.append((r[0], v.size, kind))
      events.append((r[1] + 1, -v.size, kind))
  events.sort(key=lambda e: (e[0], e[1]))  # (frees before allocations at one position)
  now: dict[Kind, int] = collections.Counter()
  most: dict[Kind, int] = collections.Counter()
  for _, delta, kind in events:
    now[kind] += delta
    most[kind] = max(most[kind], now[kind])
  return tuple(sorted(((k, n) for k, n in most.items() if n), key=lambda kv: -kv[1]))


def _loss_head_shapes(dump: buffer_dump.Dump) -> set[str]:
  """The shapes of the loss head's values: the model's outputs that the loss works on
  outside any module (the logits, their softmax and its cotangent share a shape), or
  under a softmax or a cross-entropy by name."""
  inside, outside = set(), set()
  for ins in dump.instructions.values():
    if not ins.op_name or ("jvp(" not in ins.op_name and "transpose(" not in ins.op_name):
      continue
    shape = names.shape(ins.shape)
    if shape.count(",") < 1:
      continue
    if any(op in ins.op_name for op in _LOSS_OPS):
      outside.add(shape)
      inside.add(shape)
    elif names.module(ins.op_name) is None:
      outside.add(shape)
    else:
      inside.add(shape)
  return inside & outside


def _kind_of(ins: buffer_dump.Instruction | None, v: buffer_dump.Value, head: set,
             param_shapes: set) -> Kind:
  if ins is not None and (ins.opcode in _COLLECTIVE_OPS or ins.opcode.startswith(
      ("all-", "copy-start")) and "S(5)" in v.shape):
    return Kind.COLLECTIVES
  if ins is not None and ins.opcode.startswith(("all-gather", "all-reduce", "reduce-scatter")):
    return Kind.COLLECTIVES
  if names.shape(v.shape) in head and v.size >= 1 << 20:
    return Kind.LOSS_HEAD
  name = ins.op_name if ins else ""
  if "transpose(" in name or (names.shape(v.shape) in param_shapes and v.size >= 1 << 16):
    return Kind.GRADIENTS  # (and the updates of the parameters' shape)
  if "jvp(" in name:
    return Kind.ACTIVATIONS
  return Kind.TEMPORARIES
