"""The plan search: a frozen state (`state`), a pure model of need and cost (`model`), the
plans a step may take (`space`), strategies that ask for figures (`bisection`, `two_point`,
`race`, `cheapest`, `ladder_walk`), and the one driver that owns threads and futures
(`driver`). docs/planner.md tells it for users."""
