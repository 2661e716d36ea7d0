"""The plan search: a frozen state (`state`), a pure model of need and cost (`model`), the
plans a step may take (`space`), strategies that ask for figures (`bisection`,
`two_point`, `race`, `cheapest`, `ladder_walk`), the one driver that owns threads and
futures (`driver`), and the entry point a fit calls (`planner`). docs/planner.md tells
it for users.

May import: record, memory, plans, files."""
