"""`keybatch bench floor`: both apps answer every request through gunicorn and gevent, and
the report holds a CPU figure for each."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from control.bench.floor import APPS, run_floor


def test_the_floor_serves_both_apps_and_reports_each(tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    assert run_floor(argparse.Namespace(rate=40.0, duration=1.0, rounds=1, json=str(out))) == 0
    report = json.loads(out.read_text())
    assert set(report["runs"]) == set(APPS)
    for runs in report["runs"].values():
        assert runs[0]["answered"] == runs[0]["sent"] > 0
        assert runs[0]["cpu_ms_per_request"] > 0
