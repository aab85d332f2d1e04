"""The replica package's seams: only its broker module talks to Redis, and the worker
builds the replica's config from the settings, every limit carried over."""

from __future__ import annotations

import ast
from pathlib import Path

from control.core.settings import Settings
from tasks.engine.fixed import FixedLatencyEngine
from tasks.replica.worker import replica_config

PACKAGE = Path(__file__).resolve().parents[2] / "tasks" / "replica"


def _imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_broker_module_imports_redis() -> None:
    modules = sorted(PACKAGE.glob("*.py"))
    assert any(path.name == "broker.py" for path in modules)
    talking = [path.name for path in modules if "redis" in _imported(path)]
    assert talking == ["broker.py"]


def test_the_worker_builds_the_config_from_the_settings() -> None:
    settings = Settings(
        max_batch=6,
        max_wait_ms=70.0,
        pull_lead_ms=12.0,
        heartbeat_s=0.7,
        replica_ttl_s=4.5,
        lease_ms=450.0,
        stall_ms=900.0,
        max_clock_error_ms=11.0,
        hand_back_pulls=False,
        pull_early=True,
    )
    config = replica_config(settings, "r-1", "small", FixedLatencyEngine(6, 123.0))
    assert (config.name, config.model) == ("r-1", "small")
    assert (config.collector.max_batch, config.collector.max_wait_ms, config.collector.batch_ms) == (6, 70.0, 123.0)
    assert (config.pull_lead_ms, config.heartbeat_s, config.ttl_s) == (12.0, 0.7, 4.5)
    assert (config.lease_ms, config.stall_ms, config.max_clock_error_ms) == (450.0, 900.0, 11.0)
    assert not config.hand_back
    assert config.pull_early
