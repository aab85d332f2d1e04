"""What a chaos run is: its scenario and load (`ChaosSpec`), the keys and timings its faults share,
and the deployments it starts."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from control.bench.harness import MODEL, Deployment, DeploymentError, child_env
from control.chaos.idle import IdleSpec
from control.core.vocab import Backend, Policy

PAID_KEY, FREE_KEY = "chaos-paid", "chaos-free"
PAUSE_S = 5.0  # replica-hang, broker-stall: how long the process stays stopped
CLIENT_SLACK_S = 5.0  # a client waits its deadline plus this, then counts the request lost
HANGUP_SHARE, HANGUP_MS = 0.2, 100.0


class ChaosError(DeploymentError):
    """The run could not be set up (the deployment did not start or warm)."""


@dataclass(frozen=True)
class ChaosSpec:
    scenario: str
    replicas: int = 4
    load: float = 0.7
    paid_share: float = 0.3
    duration_s: float = 30.0
    fault_at_s: float = 8.0
    repeat: int = 1
    deadline_ms: float | None = None
    seed: int = 1
    client_retries: int = 2
    spike: float = 3.0
    spike_s: float = 30.0
    backend: Backend = "fixed"
    policy: Policy = "static"
    idle: IdleSpec | None = None  # client-hangup --idle: faults one at a time, no load
    cells: int = 1
    pause: bool = False  # cell-loss: SIGSTOP the broker for PAUSE_S instead of SIGKILL
    replicas_per_host: int = 0  # simulated hosts of this many replicas (`up --replicas-per-host`)
    peer_load: float | None = None  # a peer region B driven at this share of its capacity; None: no peer

    @property
    def has_peer(self) -> bool:
        return self.scenario == "region-loss" or self.peer_load is not None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ChaosSpec:
        idle = None
        if args.idle:
            idle = IdleSpec(args.hangups, args.cancels, args.every, HANGUP_MS, args.tail, model=MODEL, key=PAID_KEY)
        per_host = args.replicas_per_host
        if per_host is None:
            per_host = 2 if args.scenario == "host-loss" else 0
        return cls(
            args.scenario,
            args.replicas,
            args.load,
            args.paid_share,
            args.duration,
            args.fault_at,
            args.repeat,
            args.deadline_ms,
            args.seed,
            args.client_retries,
            args.spike,
            args.spike_s,
            args.backend,
            args.policy,
            idle,
            args.cells or (3 if args.scenario == "cell-loss" else 1),
            args.pause,
            per_host,
            args.peer_load,
        )

    def problem(self) -> str | None:
        if self.idle is not None:
            if self.scenario != "client-hangup":
                return "--idle is a variant of client-hangup only"
            return self.idle.problem()
        if self.scenario == "cell-loss" and self.cells < 2:
            return "cell-loss needs --cells 2 or more (one is lost, the others serve)"
        if self.scenario == "host-loss" and not 0 < self.replicas_per_host < self.replicas:
            return "host-loss needs --replicas-per-host below --replicas (one host is lost, another serves)"
        if self.replicas_per_host < 0:
            return "--replicas-per-host must be at least 0"
        if self.peer_load is not None and not 0 <= self.peer_load <= 10:
            return "--peer-load must be in [0, 10]"
        if self.pause and self.scenario != "cell-loss":
            return "--pause is a variant of cell-loss only"
        if self.replicas < self.cells:
            return "--replicas must be at least --cells (each cell needs a replica)"
        if self.replicas < 1 or self.repeat < 1:
            return "--replicas and --repeat must be at least 1"
        if not 0 < self.load <= 10 or not 0 <= self.paid_share <= 1:
            return "--load must be in (0, 10] and --paid-share in [0, 1]"
        if not 0 < self.fault_at_s < self.duration_s:
            return "--fault-at must fall inside the load: 0 < fault-at < duration"
        if self.deadline_ms is not None and self.deadline_ms <= 0:
            return "--deadline-ms must be positive"
        return None


def deployments_for(spec: ChaosSpec) -> list[Deployment]:
    """The deployments, the one the faults hit first; with a peer, region A lists region B
    in its PEERS (B, as many replicas, in no simulated hosts and one cell)."""
    if not spec.has_peer:
        return [_deployment(spec, "main", child_env(PAID_KEY, FREE_KEY))]
    b = Deployment(
        "b", spec.replicas, child_env(PAID_KEY, FREE_KEY, region="b"), backend=spec.backend, policy=spec.policy
    )
    return [_deployment(spec, "a", child_env(PAID_KEY, FREE_KEY, region="a", peers=json.dumps([b.url]))), b]


def _deployment(spec: ChaosSpec, name: str, env: dict[str, str]) -> Deployment:
    return Deployment(
        name,
        spec.replicas,
        env,
        backend=spec.backend,
        policy=spec.policy,
        cells=spec.cells,
        replicas_per_host=spec.replicas_per_host,
    )
