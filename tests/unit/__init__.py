"""Policy code on plain data: no broker, no processes, no torch."""
