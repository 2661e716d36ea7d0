"""Plans and their rungs: the frozen `Plan` (`plan`), the ladder's vocabulary (`rungs`),
one spec per rung kind (`rung_specs`), the ladder a user may write (`ladder`), what a
plan may do under the user's options (`plan_trust`, `argnums`, `keywords`), and the
layouts and placements a plan sets (`layout`, `user_shardings`, `thread_context`,
`offload`, `auto_offload`, `swap`).

May import: record, memory."""
