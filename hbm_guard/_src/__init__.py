"""hbm_guard's implementation, in nine folders, lowest first: `record` (an out-of-memory
error parsed and diagnosed), `memory` (where the memory goes), `plans` (plans and rungs),
`files` (the report and the plan cache), `search` (the next plan), `dropin` (an unmodified
step made plan-aware), `backends` (compiling a plan), `guard` (`guarded_jit`), `cli` (what a
person reads). Each imports only the folders before it; docs/design.md names every module.
The public API is `hbm_guard`'s own namespace."""
