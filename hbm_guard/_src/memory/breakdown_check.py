"""The breakdown's predictions held against the compiler: after a fit, each part of the
first program's peak as the kept plan was predicted to leave it, beside what the compiler
then allotted that part in the kept plan's program.

Pure, on the report's own dicts (a report read back is untrusted: what is not sound is
left out). A part no rule predicts under the plan (activations under a remat policy the
first program did not have, the compiler's scratch) is listed as not predicted, not
guessed.
"""

from __future__ import annotations

from typing import Any

from hbm_guard._src.memory import breakdown as breakdown_lib

TOLERANCE = 0.10  # a predicted saving within this share of the compiled one agrees
SMALL = 0.01  # parts under this share of the first program are listed, not judged

_K = breakdown_lib.Kind
# Parts a microbatch count divides (what is per microbatch); gradients are accumulated
# whole, the batch is read whole, state is untouched by it.
_PER_MICROBATCH = {_K.LOSS_HEAD, _K.ACTIVATIONS, _K.TEMPORARIES}
_UNCHANGED = {_K.PARAMETERS, _K.BATCH, _K.OTHER_STATE, _K.GRADIENTS, _K.OPTIMIZER_STATE,
              _K.OUTPUTS}  # (gradients: while the count of microbatches stays)


def _int(x: Any) -> int | None:
  return x if isinstance(x, int) and not isinstance(x, bool) and x >= 0 else None


def _plan(p: Any) -> dict[str, Any]:
  return p if isinstance(p, dict) else {}


def _count(p: dict[str, Any]) -> int:
  k = p.get("microbatches")
  return k if isinstance(k, int) and not isinstance(k, bool) and k >= 1 else 1


def predict(kind: str, before: int, plan0: dict[str, Any], plan: dict[str, Any],
            compiler_remat: bool = False) -> tuple[int | None, str]:
  """(bytes the part is predicted to hold under `plan`, what does it), from `before`
  bytes under `plan0`; None where no rule predicts it. `compiler_remat`: the first
  program is what the compiler's own remat pass left (its activations are not the step's)."""
  try:
    k = _K(kind)
  except ValueError:
    return None, "a part this version does not know"
  if compiler_remat and k in (_K.ACTIVATIONS, _K.TEMPORARIES):
    return None, ("the compiler rematerialized the first program itself (over the limit): "
                  "what it left is not what a plan leaves, not predicted")
  k0, k1 = _count(plan0), _count(plan)
  remat_new = bool(plan.get("remat_policy")) and plan.get("remat_policy") != plan0.get(
      "remat_policy")
  if k is _K.ACTIVATIONS and remat_new:
    return None, f"layer_remat({plan['remat_policy']}) keeps what its policy saves: not predicted"
  if k is _K.GRADIENTS and k1 != k0:
    return None, f"microbatch({k1}) adds the gradients' accumulators: not predicted"
  if k in _PER_MICROBATCH:
    by = f"microbatch({k1})" if k1 != k0 else "unchanged"
    return before * k0 // k1, by
  if k is _K.OUTPUTS and plan.get("donate_argnums") and not plan0.get("donate_argnums"):
    return 0, "donate"
  if k is _K.OPTIMIZER_STATE and plan.get("offload_optimizer") and not plan0.get(
      "offload_optimizer"):
    return 0, "offload_optimizer"
  if k in _UNCHANGED and not (plan.get("shard_state") and not plan0.get("shard_state")):
    return before, "unchanged"
  return None, "no rule predicts it under this plan"


def _sizes(b: dict[str, Any]) -> tuple[dict[str, int], dict[str, int]]:
  """(bytes of each part at the program's peak, the most each kind of temporary holds
  anywhere in the schedule), the entries that are sound."""
  at_peak = {p["kind"]: p["bytes"] for p in b.get("parts") or []
             if isinstance(p, dict) and isinstance(p.get("kind"), str)
             and _int(p.get("bytes")) is not None}
  return at_peak, _kinds(b.get("own_peak_bytes"))


def _kinds(d: Any) -> dict[str, int]:
  return {k: n for k, n in d.items() if isinstance(k, str) and _int(n) is not None} if (
      isinstance(d, dict)) else {}


def compare(first: dict[str, Any], kept: dict[str, Any]) -> list[dict[str, Any]]:
  """Rows for each part of `first`'s breakdown: predicted under `kept`'s plan, compiled in
  `kept`'s breakdown. `first`, `kept`: attempts (dicts with "plan" and "breakdown").

  A temporary's part is held where it is largest in each program (the peak moves with
  the plan: the loss head of a split step is not live at its peak, which the optimizer's
  update sets), a state's at the peak."""
  b0, b1 = first.get("breakdown"), kept.get("breakdown")
  if not isinstance(b0, dict) or not isinstance(b1, dict) or first is kept:
    return []
  peak0, own0 = _sizes(b0)
  peak1, own1 = _sizes(b1)
  chip1 = _kinds(b1.get("on_chip_peak_bytes"))
  plan0, plan = _plan(first.get("plan")), _plan(kept.get("plan"))
  small = SMALL * (_int(b0.get("total_bytes")) or 0)
  rows = []
  for kind in dict.fromkeys([*peak0, *own0]):
    temporary = kind in own0 or kind in own1
    before = own0.get(kind, 0) if temporary and own0 else peak0.get(kind, 0)
    got = own1.get(kind, 0) if temporary and own1 else peak1.get(kind, 0)
    chip = chip1.get(kind, 0) if temporary else 0
    if not before:
      continue
    predicted, by = predict(kind, before, plan0, plan,
                            bool(_int(b0.get("compiler_rematerialized"))))
    row = {"kind": kind, "before_bytes": before, "predicted_bytes": predicted,
           "compiled_bytes": got, "by": by, "agrees": None,
           "held": "where it is largest" if temporary else "at the peak",
           "on_chip_bytes": chip}
    if predicted is not None and max(before, predicted, got) >= small:
      # (where the compiler put a part on chip, the part is still its size)
      saved, expected = before - got - min(chip, max(0, predicted - got)), before - predicted
      # within TOLERANCE of the saving (or, where nothing was to be saved, of the part)
      row["agrees"] = abs(saved - expected) <= TOLERANCE * (
          max(abs(saved), abs(expected)) if expected else before)
    rows.append(row)
  return sorted(rows, key=lambda r: -r["before_bytes"])


def summary(rows: Any) -> str | None:
  """"3 of 4 parts judged agree within 10%", or None where none was judged."""
  judged = [r.get("agrees") for r in rows if isinstance(r, dict)] if isinstance(rows, list) else []
  judged = [a for a in judged if isinstance(a, bool)]
  if not judged:
    return None
  return (f"{sum(judged)} of {len(judged)} parts judged agree within {TOLERANCE:.0%} of their "
          f"predicted saving (parts under {SMALL:.0%} of the first program, and those no rule "
          f"predicts, are listed, not judged)")


def lines(rows: Any, indent: str = "  ") -> list[str]:
  """The comparison, for a person."""
  out = []
  for r in rows if isinstance(rows, list) else []:
    if not isinstance(r, dict) or _int(r.get("before_bytes")) is None:
      continue
    fmt = breakdown_lib.fmt
    pred = (fmt(r["predicted_bytes"]) if _int(r.get("predicted_bytes")) is not None
            else "not predicted")
    got = fmt(r["compiled_bytes"]) if _int(r.get("compiled_bytes")) is not None else "?"
    mark = {True: "agrees", False: "DIFFERS", None: ""}.get(r.get("agrees"), "")
    if _int(r.get("on_chip_bytes")):
      got += f" in device memory (the compiler held up to {fmt(r['on_chip_bytes'])} of it on chip)"
    held = f" ({r['held']})" if isinstance(r.get("held"), str) else ""
    out.append(f"{indent}{r.get('kind')}{held}: {fmt(r['before_bytes'])} -> predicted {pred} "
               f"({r.get('by')}), compiled {got} {mark}".rstrip())
  return out
