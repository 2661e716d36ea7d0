"""The drop-in's analysis and rewrite: a step written for `jax.jit` made plan-aware. Its
gradient calls are followed while it traces (`intercept`, `following`), the batch axis
of every value is read (`batch_*`, `own_rows`, `custom_rules`, `cond_branches`), a
split is proven exact or refused by name (`loss_split`, `micro_program`, `retrace`),
and the microbatched step is written (`microbatch`, `auto_grad`, `sum_cotangent`,
`layers`, `closure`). `plan_aware` is the same for steps written with its helpers.

May import: record, memory, plans, files, search."""
