"""hbm_guard: survive XLA's compile-time HBM out-of-memory (E1000).

Parse the error into a record, diagnose it against the E1000 page, and (with
`guarded_jit`) recompile the step down a fallback ladder until it fits.
"""

from hbm_guard._src.diagnose import Advice
from hbm_guard._src.diagnose import Diagnosis
from hbm_guard._src.diagnose import diagnose
from hbm_guard._src.diagnose import format_bytes
from hbm_guard._src.errors import HbmGuardError
from hbm_guard._src.errors import InvalidLadderError
from hbm_guard._src.errors import LadderExhaustedError
from hbm_guard._src.errors import UnevenMicrobatchError
from hbm_guard._src.errors import UnknownTargetError
from hbm_guard._src.record import Allocation
from hbm_guard._src.record import E1000Record
from hbm_guard._src.record import parse
from hbm_guard._src.record import parse_size

__version__ = "0.1.0"

__all__ = (
    "Advice",
    "Allocation",
    "Diagnosis",
    "E1000Record",
    "HbmGuardError",
    "InvalidLadderError",
    "LadderExhaustedError",
    "UnevenMicrobatchError",
    "UnknownTargetError",
    "diagnose",
    "format_bytes",
    "parse",
    "parse_size",
)
