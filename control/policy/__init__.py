"""Fleet policy on plain data: admission and rebalance (no I/O; the clock is passed in)."""
