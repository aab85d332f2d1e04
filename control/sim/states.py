"""A simulated request's states (one byte each, the finished ones last) and the tiers by paid flag."""

from __future__ import annotations

from control.core.vocab import FREE, PAID, Tier

NEW, WAITING, RUNNING, OK, REFUSED, EXPIRED, CANCELLED, LATE, LOST = range(9)
STATE_NAMES = ("new", "waiting", "running", "ok", "refused_429", "expired_504", "cancelled_409", "late_504", "lost")

TIERS: tuple[Tier, Tier] = (FREE, PAID)  # indexed by a request's paid flag
