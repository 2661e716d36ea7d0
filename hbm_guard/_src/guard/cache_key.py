"""What a fit's plan cache entry is keyed by, and what of an entry read back may be used.

An entry is untrusted (a file another process wrote): its plans must stay within the
guard's own options, and a remembered exhaustion must be young enough to believe."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from hbm_guard._src.backends import compile as compile_lib
from hbm_guard._src.backends import options as options_lib
from hbm_guard._src.backends import steps as steps_lib
from hbm_guard._src.files import plan_cache as plan_cache_lib
from hbm_guard._src.files import report as report_lib
from hbm_guard._src.plans import plan as plan_lib

Status = report_lib.Status


def parts(step: steps_lib.StepBuilder, backend, options: options_lib.GuardOptions,
                args, kwargs, key=None) -> dict[str, Any]:
  """What decides the plan: the program under the default plan, where it must fit, how,
  and the compiler's settings outside the program (README: the plan cache). For a target
  the program is lowered as its first compile will be, and that lowering is compiled."""
  text = None
  if key is not None:
    text = backend.program_text(plan_lib.Plan(), key, args, kwargs)
  if text is None:
    text = step.learn_state(args, kwargs, lower=True).as_text()
  parts = {
      "program": hashlib.sha256(text.encode()).hexdigest(),
      "where": backend.where(), "capacity": options.budget, "max_class": options.max_class,
      "ladder": [r.to_dict() for r in options.ladder], "state_argnums": options.state_argnums,
      "max_attempts": options.max_attempts, "search": options.search,
      "timed_rivals": options.timed_rivals,
      # only where asked: keys written before the option existed stay valid
      **({"estimated_rivals": options.estimated_rivals} if options.estimated_rivals else {}),
      "headroom": options.headroom, "auto_plan_aware": options.auto_plan_aware,
      "compiler_options": options.jit_kwargs.get("compiler_options"),
      "compile_environment": plan_cache_lib.compile_environment(),
      "versions": plan_cache_lib.versions()}
  return json.loads(json.dumps(parts, default=repr))  # as it reads back from the file


def trusted_entry(options: options_lib.GuardOptions, entry: plan_cache_lib.Entry,
                  nargs: int) -> plan_cache_lib.Entry:
  """A cache entry as this guard may use it: its plans within the options, an exhaustion
  young enough to believe; a ValueError (a miss) otherwise."""
  source = "the plan cache entry"
  plan = options.trusted(entry.plan, nargs=nargs, source=source)
  if entry.status != Status.EXHAUSTED:
    return dataclasses.replace(entry, plan=plan, attempts=())
  age = entry.age_seconds()
  if age is None or not -300 <= age <= plan_cache_lib.EXHAUSTED_MAX_AGE_S:
    raise ValueError("an exhaustion of unknown age, or older than "
                     f"{plan_cache_lib.EXHAUSTED_MAX_AGE_S / 86400:.0f} days, is not believed")
  attempts = []
  for i, a in enumerate(entry.attempts[:options.max_attempts], start=1):
    tried = options.trusted(plan_lib.Plan.from_dict(a.get("plan")), nargs=nargs,
                            source=source)
    if a.get("outcome") != compile_lib.Outcome.OOM:
      raise ValueError("an exhaustion whose attempts did not all fail")
    attempts.append({"number": i, "plan": tried.to_dict(), "described": tried.describe(),
                     "outcome": compile_lib.Outcome.OOM.value, "seconds": 0.0,
                     "signature": "", "skipped": []})
  if not attempts:
    raise ValueError("an exhaustion with no attempts")
  return dataclasses.replace(entry, plan=plan, attempts=tuple(attempts))
