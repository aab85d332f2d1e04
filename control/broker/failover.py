"""The failover scripts' former home, kept only for callers not yet moved: the scripts
and their wrappers are in control/broker/scripts.py, `release_replica` in
control/broker/leases.py. Delete once tasks/replica imports those.
"""

from __future__ import annotations

from control.broker.leases import release_replica
from control.broker.scripts import (
    CLAIM_LUA,
    DELIVER_LUA,
    LUA_LIB,
    MAX_REQUEUES,
    RECORD_LUA,
    RESCUE_LUA,
    STREAM_LUA,
    SWEEP_DEAD_LUA,
    SWEEP_ONE_LUA,
)

__all__ = [
    "CLAIM_LUA",
    "DELIVER_LUA",
    "LUA_LIB",
    "MAX_REQUEUES",
    "RECORD_LUA",
    "RESCUE_LUA",
    "STREAM_LUA",
    "SWEEP_DEAD_LUA",
    "SWEEP_ONE_LUA",
    "release_replica",
]
