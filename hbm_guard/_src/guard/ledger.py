"""Every attempt of a guarded step and its report, written after each attempt; what the
report says of plans above the allowed class and of refusals met on the way."""

from __future__ import annotations

import dataclasses
from typing import Any

from absl import logging

from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.backends import options as options_lib
from hbm_guard._src.files import report as report_lib
from hbm_guard._src.guard import climb as climb_lib
from hbm_guard._src.plans import plan as plan_lib
from hbm_guard._src.record import diagnose as diagnose_lib

Status = report_lib.Status


@dataclasses.dataclass(frozen=True)
class AboveClass:
  """A plan of a class above `max_class` that the probes predict would fit."""
  klass: str
  plan: str
  predicted_bytes: int

  def to_dict(self) -> dict[str, Any]:
    return {"class": self.klass, "plan": self.plan, "predicted_bytes": self.predicted_bytes}


class Ledger:
  """Every attempt of a guarded step, and its report, written after each attempt."""

  def __init__(self, name: str, options: options_lib.GuardOptions, stem: str):
    self.name, self.options = name, options
    self.attempts: list[climb_lib.Attempt] = []
    # why the drop-in did not split the batch -> the first plan whose trace said so (a
    # probe's, a compile's beside the climb, a rival's: not only the climb's own)
    self.refused: dict[str, str] = {}
    self._told = 0  # refusals already given to an attempt
    self.probed: dict[str, Any] = {}  # a probe's plan -> where its memory goes
    self._writer = report_lib.Writer(options.report_dir, stem)

  @property
  def path(self) -> str | None:
    return self._writer.path

  def record(self, attempt: climb_lib.Attempt) -> None:
    """Every attempt is in the report before it is in the log: a kill loses neither. The
    refusals met since the attempt before are the attempt's."""
    new = [f"{plan}: {why}" for why, plan in list(self.refused.items())[self._told:]]
    self._told = len(self.refused)
    if new:
      attempt = dataclasses.replace(attempt, refused=attempt.refused + tuple(new))
    self.attempts.append(attempt)
    if attempt.outcome is not compile_lib.Outcome.FITS:
      self.write(Status.CLIMBING)
    need = attempt.record.required_bytes if attempt.record else (attempt.memory or {}).get("peak")
    # Detail: the progress line said it already (absl's -v 1 shows it again, with its signature).
    logging.debug("hbm_guard: %s attempt #%d [%s] %s: %s%s in %.1f s", self.name,
                 attempt.number, attempt.signature, attempt.plan.describe(), attempt.outcome,
                 f", needs {diagnose_lib.format_bytes(need)}" if need else "",
                 attempt.seconds)

  def refuse(self, plan: plan_lib.Plan, why: str) -> bool:
    """Records a refusal met tracing `plan`; whether it is new."""
    new = why not in self.refused
    self.refused.setdefault(why, plan.describe())
    return new

  def write(self, status: Status, *, final_plan: plan_lib.Plan | None = None,
            above: AboveClass | None = None, attempts: list[dict] | None = None,
            note: str | None = None, timed: dict[str, Any] | None = None,
            estimated: dict[str, Any] | None = None) -> bool:
    o = self.options
    data = report_lib.build(
        function=self.name, status=status,
        attempts=attempts if attempts is not None else [a.to_dict() for a in self.attempts],
        final_plan=final_plan.to_dict() if final_plan is not None else None,
        target=o.target.name if o.target else None, capacity_bytes=o.budget,
        max_class=o.max_class, ladder=[r.to_dict() for r in o.ladder],
        above_class=above.to_dict() if above else None, note=note, timed=timed,
        estimated=estimated,
        refused=[{"plan": plan, "why": why} for why, plan in self.refused.items()],
        probed=[{"plan": plan, "breakdown": b.to_dict()} for plan, b in self.probed.items()])
    return self._writer.write(data)
