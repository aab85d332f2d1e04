"""`keybatch chaos`: a short replica-kill run against a real `keybatch up` reports its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from control.chaos.faults import FAULTS
from control.cli.args import CHAOS_SCENARIOS
from tests.support.waiting import drop_kept_logs


def _chaos(tmp_path: Path, scenario: str, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    """`keybatch chaos SCENARIO ARGS --fault-at 2` in a clean environment: the command's
    result and its report."""
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, "-m", "control", "chaos", scenario, *args, "--fault-at", "2", "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYBATCH_")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    # Exit 1 is a finding, not a broken command (a killed replica stops all of `up` until
    # the supervisor restarts replicas); 2 would be a run that could not be set up.
    assert done.returncode in (0, 1), done.stderr[-2000:]
    report = json.loads(out.read_text())
    drop_kept_logs(done.stderr)
    return done, report


def test_replica_kill_reports_every_figure_and_leaves_nothing_running(tmp_path: Path) -> None:
    assert set(FAULTS) == set(CHAOS_SCENARIOS)  # every scenario the CLI offers has a fault
    done, report = _chaos(tmp_path, "replica-kill", "--replicas", "2", "--load", "0.1", "--duration", "6")
    assert "logs" not in report  # this machine's paths stay out of a stored report

    assert report["sent"] > 0
    assert isinstance(report["lost"], int) and isinstance(report["duplicated"], int)
    assert done.returncode == (0 if report["lost"] == 0 and report["duplicated"] == 0 and report["ok"] else 1)
    for key in ("answered", "wasted_results", "recover_s", "pre_fault_p99_ms", "affected", "rest", "status_503"):
        assert key in report, key
    for group in ("affected", "rest"):
        assert {"sent", "statuses", "p99_ms"} <= set(report[group]), report[group]
    assert report["affected"]["sent"] + report["rest"]["sent"] == report["sent"]
    assert sum(report["answered"].values()) + report["lost"] == report["sent"]
    [fault] = report["faults"]
    assert fault["action"] == "SIGKILL replica" and len(fault["targets"]) == 1, fault
    assert 2.0 <= fault["at_s"] < 6.0
    assert "lost (no HTTP answer)" in done.stdout and "time to recover" in done.stdout

    # Replicas, gateway processes and the broker it found are all gone.
    assert len(report["pids"]) >= 5  # broker, 2 replicas, gateway master and its workers
    deadline = time.monotonic() + 5
    while (alive := [pid for pid in report["pids"] if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive == []


def test_host_loss_stops_every_replica_of_one_simulated_host_at_once_then_kills_them(tmp_path: Path) -> None:
    _done, report = _chaos(
        tmp_path, "host-loss", "--replicas", "4", "--replicas-per-host", "2", "--load", "0.1", "--duration", "9"
    )
    [fault] = report["faults"]
    assert fault["action"].startswith("SIGSTOP host ") and fault["action"].endswith("then SIGKILL them"), fault
    assert len(fault["targets"]) == 2, fault
    host = fault["action"].split()[2]
    assert host.endswith(("-h1", "-h2")), host
    assert all(f"@{host}" in target for target in fault["targets"]), fault  # both replicas of that host
    assert 4.5 <= fault["ended_s"] - fault["at_s"] <= 7.0, fault
    assert report["sent"] > 0 and sum(report["answered"].values()) + report["lost"] == report["sent"]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_idle_hang_ups_and_cancels_leave_every_replica_serving(tmp_path: Path) -> None:
    """client-hangup --idle: each fault alone on an idle continuous replica, spaced wider
    than the stall watchdog's window (short here), so a replica left taken for busy by an
    abort would give up between them."""
    out = tmp_path / "idle.json"
    cmd = [sys.executable, "-m", "control", "chaos", "client-hangup", "--idle", "--replicas", "1"]
    cmd += ["--policy", "continuous", "--hangups", "2", "--cancels", "2", "--every", "1.6", "--tail", "1.6"]
    cmd += ["--json", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KEYBATCH_")}
    env.update(KEYBATCH_STALL_MS="300", KEYBATCH_HEARTBEAT_S="0.2")  # the watchdog acts within 1.2 s
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=90)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    report = json.loads(out.read_text())
    drop_kept_logs(done.stderr)
    assert "logs" not in report  # this machine's paths stay out of a stored report
    assert sum(report["hangups"].values()) == 2 and sum(report["cancels"].values()) == 2
    assert report["readiness"]["samples"] > 30
    assert report["replica_exits"] == [] and report["stall_restarts"] == 0, report
    assert report["readiness"]["ready_share"] == 1.0, report["readiness"]
    assert [a["status"] for a in report["next_requests"]] == [200]
    assert report["ok"] and done.returncode == 0
    assert "replica exits" in done.stdout and "PASS" in done.stdout
