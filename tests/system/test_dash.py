"""The dashboard: driven with Textual's Pilot against a real fleet (real Valkey, real
replicas), against a broker that is gone, and rendered at 80x24 against a stored
snapshot, an SVG that Textual exports (`KEYBATCH_UPDATE_SNAPSHOTS=1 pytest
tests/system/test_dash.py` rewrites it; look at it before committing)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from textual.widgets import DataTable, Static

from control.broker.registry import ReplicaInfo
from control.broker.traffic import TierTraffic
from control.core.lifecycle import ReplicaState
from control.core.procs import free_port
from control.core.settings import Settings
from control.fleet.operator import FleetSnapshot, Operator
from control.policy.rebalance import Decision
from tests.support.deploy import Deployment, deployment
from tui.dash import Dashboard

SMALL, LARGE = "kb-small", "kb-large"
SNAPSHOT = Path(__file__).parent / "snapshots" / "dash_80x24.svg"


@pytest.fixture(scope="module")
def fleet() -> Iterator[Deployment]:
    with deployment(workers=3, models=(SMALL, LARGE), BATCH_MS="100", MAX_BATCH="8") as d:
        yield d


def _operator(d: Deployment) -> Operator:
    return Operator(Settings(redis_url=d.system.redis_url, models={SMALL: SMALL, LARGE: LARGE}))


async def _until(pilot: object, check: object, timeout_s: float = 10.0) -> bool:
    for _ in range(int(timeout_s / 0.05)):
        if check():  # type: ignore[operator]
            return True
        await asyncio.sleep(0.05)
    return bool(check())  # type: ignore[operator]


def _states(app: Dashboard) -> dict[str, str]:
    table = app.query_one("#replicas", DataTable)
    return {str(row.value): str(table.get_row(row)[2]) for row in table.rows}


def _models(app: Dashboard) -> dict[str, str]:
    table = app.query_one("#replicas", DataTable)
    return {str(row.value): str(table.get_row(row)[1]) for row in table.rows}


def test_the_dashboard_shows_the_fleet_and_drains_and_resumes_a_replica(fleet: Deployment) -> None:
    async def scenario() -> None:
        app = Dashboard(_operator(fleet), poll_s=0.2)
        async with app.run_test(size=(100, 30)) as pilot:
            assert await _until(pilot, lambda: len(_states(app)) == 3)
            assert set(_states(app).values()) == {"serving"}
            queues = app.query_one("#queues", DataTable)
            assert {str(queues.get_row_at(i)[0]) for i in range(queues.row_count)} == {SMALL, LARGE}
            models = _models(app)
            shared = next(m for m in models.values() if list(models.values()).count(m) == 2)
            row = sorted(models).index(next(n for n in sorted(models) if models[n] == shared))
            await pilot.click("#replicas")
            app.query_one("#replicas", DataTable).move_cursor(row=row)
            name = app.selected()
            assert name is not None and models[name] == shared
            await pilot.press("d")
            await pilot.press("n")  # asked first: "no" does nothing
            await pilot.pause(0.5)
            assert _states(app)[name] == "serving"
            await pilot.press("d")
            await pilot.press("y")
            assert await _until(pilot, lambda: _states(app).get(name) == "drained", 15), _states(app)
            await pilot.press("r")
            await pilot.press("y")
            assert await _until(pilot, lambda: _states(app).get(name) == "serving", 15), _states(app)
            await pilot.press("q")

    asyncio.run(scenario())


def test_a_broker_that_is_gone_shows_a_banner_not_a_crash() -> None:
    async def scenario() -> None:
        settings = Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", models={SMALL: SMALL})
        app = Dashboard(Operator(settings), poll_s=0.2)
        async with app.run_test(size=(80, 24)) as pilot:
            banner = app.query_one("#banner", Static)
            assert await _until(pilot, lambda: banner.has_class("shown"))
            assert "broker unreachable" in str(banner.render())
            await pilot.press("a")  # the keys still work
            assert app.auto

    asyncio.run(scenario())


def _fixed_snapshot(k: int = 0) -> FleetSnapshot:
    def replica(name: str, model: str, state: ReplicaState, fill: int, util: float, held: int) -> ReplicaInfo:
        return ReplicaInfo(
            name=name, model=model, state=state, state_label=state.label, backend="fixed", max_batch=64,
            batch_ms=250.0, buffered=held, busy=True, num_batches=10, num_requests=500, dropped={},
            host="host-a", pid=100, num_held=held, last_batch_size=fill, batch_p50_ms=250.0, batch_p99_ms=251.0,
            utilization=util, heartbeat_age_ms=120.0,
        )  # fmt: skip

    replicas = [
        replica("r1@host-a", SMALL, ReplicaState.SERVING, 48, 0.8, 60),
        replica("r2@host-a", SMALL, ReplicaState.DRAINING, 20, 0.4, 20),
        replica("r3@host-b", LARGE, ReplicaState.SERVING, 64, 0.95, 90),
    ]
    traffic = [
        TierTraffic(SMALL, "paid", 12, 80.0, 60.0, 59.5, 300.0, 350.0 + 25 * k),
        TierTraffic(SMALL, "free", 40, 210.0, 180.0, 175.0, 350.0, 480.0 + 15 * k),
        TierTraffic(LARGE, "paid", 5, 120.0, 20.0, 19.0, 400.0, 450.0 + 25 * k),
        TierTraffic(LARGE, "free", 70, 640.0, 60.0, 41.0, 500.0, 620.0 + 70 * k),
    ]
    return FleetSnapshot(replicas, traffic, read_at=0.0)


class StillDashboard(Dashboard):
    """Shows a fixed snapshot and never polls: for the rendering test."""

    def poll(self) -> None:  # type: ignore[override]
        return None


def test_the_dashboard_at_80x24_matches_its_snapshot() -> None:
    async def scenario() -> str:
        settings = Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0", models={SMALL: SMALL, LARGE: LARGE})
        app = StillDashboard(Operator(settings), poll_s=3600)
        async with app.run_test(size=(80, 24)) as pilot:
            for k in range(5):
                app.show(_fixed_snapshot(k))
            app._log_decisions(
                [Decision("kb-large short: oldest queued 640 ms > 300 ms", "r2@host-a", SMALL, LARGE)], []
            )
            await pilot.pause()
            return app.export_screenshot(title="keybatch dash")

    screen = asyncio.run(scenario())
    if os.environ.get("KEYBATCH_UPDATE_SNAPSHOTS"):
        SNAPSHOT.parent.mkdir(exist_ok=True)
        SNAPSHOT.write_text(screen)
    assert screen == SNAPSHOT.read_text()
