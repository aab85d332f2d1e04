"""What one request may take of its connection before the app sees it, per process."""

from __future__ import annotations

from dataclasses import dataclass

from control.core.settings import Settings
from control.core.vocab import PAID

KEEPALIVE_S = 5


@dataclass(frozen=True)
class RequestLimits:
    """What one request may take of its connection before the app sees it."""

    header_timeout_s: float
    body_timeout_s: float
    max_body_bytes: int
    first_byte_timeout_s: float = KEEPALIVE_S
    send_timeout_s: float = 10.0
    max_header_bytes: int = 32_768
    max_header_fields: int = 100
    paid_keys: frozenset[str] = frozenset()

    @classmethod
    def of(cls, settings: Settings) -> RequestLimits:
        paid = frozenset(key for key, tier in settings.api_keys.items() if tier == PAID)
        return cls(
            settings.header_timeout_s,
            settings.body_timeout_s,
            settings.max_body_bytes,
            settings.first_byte_timeout_s,
            settings.send_timeout_s,
            settings.max_header_bytes,
            settings.max_header_fields,
            paid,
        )

    def is_paid(self, authorization: str | None) -> bool:
        """The key decides the tier, as the app reads it (api/completions.py: caller)."""
        if not authorization or not self.paid_keys:
            return False
        scheme, _, key = authorization.partition(" ")
        return scheme.lower() == "bearer" and key.strip() in self.paid_keys
