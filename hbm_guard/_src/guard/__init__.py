"""The guard: `guarded_jit` (`api`) returns a `GuardedFunction` (`guard`) that maps a
signature to what runs it. On a miss it fits (`fit`, `climb`, `spend`, `budget`,
`fit_ended`), keeps the fastest fitting plan (`keep`, `tournament`), writes the
attempts (`ledger`) and caches the plan (`cache_key`). `boundary` hides its frames
from tracebacks.

May import: record, memory, plans, files, search, dropin, backends."""
