"""orbax: keep the plan beside the checkpoints, so a restored job resumes on the same plan.

    import orbax.checkpoint as ocp
    from hbm_guard.integrations import orbax as hg_orbax

    manager = ocp.CheckpointManager(workdir)
    step = hbm_guard.guarded_jit(train_step, state_argnums=0, target="v5e:2x2",
                                 plan_cache=hg_orbax.plan_cache_dir(manager))

The plan cache then lives in the checkpoint directory: a job restored on another machine
(same program, target and versions) compiles once and fails none. The restored state is
moved to the plan's layout (sharding, host offload) at the first call, whatever layout
orbax restored it in; a state whose shapes or dtypes differ from the saved one's is a new
input signature, fitted anew: never run under a plan fitted for other arrays.

orbax is imported lazily: importing hbm_guard never imports it.
"""

from __future__ import annotations

import os
from typing import Any

PLAN_DIR = "hbm_guard_plans"


def plan_cache_dir(manager: Any) -> str:
  """The plan cache directory inside an orbax CheckpointManager's directory."""
  directory = getattr(manager, "directory", manager)
  return os.path.join(os.fspath(directory), PLAN_DIR)
