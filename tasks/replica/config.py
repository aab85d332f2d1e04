"""What a replica is told when it is built: its name, its model and its limits."""

from __future__ import annotations

from dataclasses import dataclass

from tasks.policy.collector import CollectorConfig
from tasks.policy.hedging import HedgeMode


@dataclass(frozen=True)
class ReplicaConfig:
    name: str
    model: str  # the model it serves first (a move changes the replica's, not this)
    collector: CollectorConfig  # copied by the replica: its batch time follows the engine's
    pull_lead_ms: float = 40.0
    pull_early: bool = False  # a busy replica pulls before `pull_lead_ms` too where no peer frees first
    heartbeat_s: float = 1.0
    ttl_s: float = 3.0  # the registry entry outlives a few missed heartbeats
    lease_ms: float = 300.0
    pulse_ms: int = 0  # the pulse key's lifetime (0: no pulse)
    stall_ms: float = 2000.0  # an engine step this far past a whole batch's time hangs
    max_clock_error_ms: float = 25.0
    host: str = ""  # the host it runs on ("": this machine's name)
    hedge: HedgeMode = "off"  # free-slot hedging (tasks/policy/hedging.py): off, paid or all
    hedge_idle: bool = False  # idle, not listening, two more idle: a batch of copies of what runs elsewhere
    hand_back: bool = True  # what a pull sent before the gate shut brings goes back to the queue
    hand_back_rest: bool = False  # what a static batch leaves in the buffer goes back for a peer's start
    single_listener: bool = False  # idle, it waits on the queue only while it holds its model's listener token
    lead_yields: bool = False  # with single_listener: busy, it pulls in its lead only while no idle replica listens
