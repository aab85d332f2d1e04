"""The engine contract a replica drives, and the fixed-latency simulated engine."""
