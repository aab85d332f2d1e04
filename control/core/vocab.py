"""The two service tiers. Its own module, so policy code can name them without
importing the settings (and through them a Redis client)."""

from typing import Literal

Tier = Literal["paid", "free"]
TIERS: tuple[Tier, ...] = ("paid", "free")
