"""The gateway's files on disk: what a killed gateway leaves is cleaned up by the next."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from api.server.serve import METRICS_DIR_PREFIX, remove_orphan_metric_dirs


def test_metric_dirs_of_dead_gateways_are_removed(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = tmp_path / f"{METRICS_DIR_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{METRICS_DIR_PREFIX}{os.getpid()}-def"
    other = tmp_path / "something-else"
    for d in (orphan, live, other):
        d.mkdir()
        (d / "counter_1.db").write_bytes(b"x")
    assert remove_orphan_metric_dirs(str(tmp_path)) == [str(orphan)]
    assert not orphan.exists() and live.exists() and other.exists()
