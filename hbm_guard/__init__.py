"""hbm_guard: survive XLA's compile-time HBM out-of-memory (E1000).

Parse the error into a record, diagnose it against the E1000 page, and (with
`guarded_jit`) recompile the step down a fallback ladder until it fits.
"""

from hbm_guard._src.backends.options import GuardOptions
from hbm_guard._src.backends.options import RungClass
from hbm_guard._src.backends.options import Search
from hbm_guard._src.backends.targets import quiet_libtpu_on_cpu_host
from hbm_guard._src.dropin.plan_aware import checkpoint
from hbm_guard._src.dropin.plan_aware import compute_dtype
from hbm_guard._src.dropin.plan_aware import current_remat_policy
from hbm_guard._src.dropin.plan_aware import value_and_grad
from hbm_guard._src.files.report import render_path as render_report
from hbm_guard._src.guard.api import guarded_jit
from hbm_guard._src.guard.climb import Attempt
from hbm_guard._src.guard.guard import GuardedFunction
from hbm_guard._src.plans.ladder import load_ladder
from hbm_guard._src.plans.offload import load_offloaded
from hbm_guard._src.plans.offload import offload_aware
from hbm_guard._src.plans.offload import store_offloaded
from hbm_guard._src.plans.plan import Plan
from hbm_guard._src.plans.plan import current_plan
from hbm_guard._src.plans.rungs import Rung
from hbm_guard._src.record.diagnose import Advice
from hbm_guard._src.record.diagnose import Diagnosis
from hbm_guard._src.record.diagnose import diagnose
from hbm_guard._src.record.diagnose import format_bytes
from hbm_guard._src.record.errors import CapacityExceededError
from hbm_guard._src.record.errors import FitTimeBudgetError
from hbm_guard._src.record.errors import HbmGuardError
from hbm_guard._src.record.errors import InvalidLadderError
from hbm_guard._src.record.errors import InvalidOptionError
from hbm_guard._src.record.errors import InvalidPlanError
from hbm_guard._src.record.errors import LadderExhaustedError
from hbm_guard._src.record.errors import StateConsumedError
from hbm_guard._src.record.errors import TpuCompilerBusyError
from hbm_guard._src.record.errors import UnevenMicrobatchError
from hbm_guard._src.record.errors import UnknownTargetError
from hbm_guard._src.record.errors import UntrustedPlanError
from hbm_guard._src.record.record import Allocation
from hbm_guard._src.record.record import E1000Record
from hbm_guard._src.record.record import parse
from hbm_guard._src.record.record import parse_size

__version__ = "0.1.0"

__all__ = (
    "Advice",
    "Allocation",
    "Attempt",
    "GuardOptions",
    "GuardedFunction",
    "Plan",
    "Rung",
    "RungClass",
    "Search",
    "Diagnosis",
    "E1000Record",
    "CapacityExceededError",
    "HbmGuardError",
    "InvalidLadderError",
    "InvalidOptionError",
    "InvalidPlanError",
    "FitTimeBudgetError",
    "LadderExhaustedError",
    "UnevenMicrobatchError",
    "StateConsumedError",
    "TpuCompilerBusyError",
    "UnknownTargetError",
    "UntrustedPlanError",
    "checkpoint",
    "compute_dtype",
    "current_plan",
    "current_remat_policy",
    "diagnose",
    "format_bytes",
    "guarded_jit",
    "load_ladder",
    "load_offloaded",
    "offload_aware",
    "parse",
    "parse_size",
    "quiet_libtpu_on_cpu_host",
    "render_report",
    "store_offloaded",
    "value_and_grad",
)
