"""Compiling a plan for a backend, and what a compile tells: the step built for a plan
(`steps`, `trace`), compiled (`compile`, `backend`, `prepare`, `probing`) for a TPU
target, this host or many hosts (`targets`, `hosts`), its flops and step time
estimated (`flop_count`, `step_time`, `estimated`), under the user's options
(`options`).

May import: record, memory, plans, files, search, dropin."""
