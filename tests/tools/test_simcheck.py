"""`keybatch bench simcheck` end to end on a short run: the live fleet and the simulator
at the same load, side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_simcheck_reports_live_and_simulated_figures_for_each_load(tmp_path: Path) -> None:
    out = tmp_path / "simcheck.json"
    cmd = [sys.executable, "-m", "control", "bench", "simcheck", "--loads", "0.2", "--duration", "3"]
    done = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["command"].startswith("keybatch bench simcheck --loads 0.2")
    (row,) = report["rows"]
    assert row["load"] == 0.2 and row["rps"] > 0
    live, sim = row["live"], row["sim"]
    assert live["ok_share"] > 0.9 and sim["answered_200_share"] > 0.9
    # Both see a 250 ms batch plus the wait to fill it: neither can be faster than a batch.
    assert live["p50_ms"] >= 250 and sim["p50_ms"] >= 250
    assert row["ratio_p50"] == round(live["p50_ms"] / row["sim_with_overhead"]["p50_ms"], 3)
    assert live["taken_shut"] >= live["handed_back"] >= 0 and sim["taken_shut"] >= 0
    assert report["hf"] is None
