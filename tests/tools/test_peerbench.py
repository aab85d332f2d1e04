"""`keybatch bench peer`: its command line loads neither torch nor the peer's server, the
peer serves a model folder offline and its process group dies with the bench, and what
"recovered after a burst" means."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from control.bench.peer import PeerServer, Probe, first_answer, peer_process, recovery_index, stop_group, wait_ready
from control.core.procs import free_port
from tests.support.waiting import alive, until

ROOT = Path(__file__).resolve().parents[2]


def test_bench_peer_help_imports_no_torch_no_server() -> None:
    code = (
        "import sys\n"
        "from control.cli.main import main\n"
        "try:\n"
        "    main(['bench', 'peer', '--help'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0, exc.code\n"
        "banned = ['torch', 'transformers', 'fastapi', 'uvicorn']\n"
        "print('loaded:' + ','.join(sorted(m for m in sys.modules if m.split('.')[0] in banned)))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    *help_lines, loaded = done.stdout.strip().splitlines()
    assert loaded == "loaded:"
    assert "pip install -e .[peer]" in " ".join(" ".join(help_lines).split())  # argparse wraps the line


def test_stop_group_kills_what_the_peer_started() -> None:
    # A leader that ignores SIGTERM, with a child of its own: both must be gone.
    script = "trap '' TERM; sleep 60 & sleep 60"
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    assert until(lambda: len(psutil.Process(proc.pid).children()) == 2, timeout_s=5)
    group = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children())]
    stop_group(proc, grace_s=0.5)
    assert until(lambda: alive(group) == [], timeout_s=5)


@pytest.mark.slow
def test_the_peer_serves_a_model_folder_offline_and_dies_with_the_bench(tmp_path: Path) -> None:
    pytest.importorskip("fastapi", reason="the peer needs `pip install -e .[peer]`")
    from tests.support.tiny_lm import build_tiny_llama

    folder = str(build_tiny_llama(tmp_path / "tiny"))
    small_cache = ["--cb-num-blocks", "8", "--cb-max-batch-tokens", "256"]  # else it reserves GBs of this machine
    server = PeerServer(folder, free_port(), threads=1, continuous=True, extra=small_cache)
    with peer_process(server, tmp_path / "serve.log") as proc:
        assert wait_ready(server, proc, timeout_s=120) > 0
        body = {"model": folder, "prompt": "def add(a, b):\n", "max_tokens": 4, "temperature": 0.0}
        assert first_answer(server.url, body, timeout_s=120) > 0  # with continuous batching, on the CPU
        group = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    assert until(lambda: alive(group) == [], timeout_s=5)


def _probes(latencies: list[float | None]) -> list[Probe]:
    """One probe a second; None: no answer."""
    return [Probe(float(i), 0 if ms is None else 200, ms or 10_000.0) for i, ms in enumerate(latencies)]


def test_recovery_is_the_first_probe_after_which_all_are_normal() -> None:
    probes = _probes([40, 45, 900, None, 2000, 300, 48, 44, 41, 43])
    assert recovery_index(probes, threshold_ms=60) == 6


def test_one_slow_probe_after_recovery_is_not_a_relapse() -> None:
    probes = _probes([900, 50, 40, 95, 42, 41, 44])
    assert recovery_index(probes, threshold_ms=60) == 1


def test_recovery_does_not_start_on_a_slow_probe() -> None:
    # The window [95, 40, 41] has a normal p50, but the probe it starts with was slow.
    probes = _probes([900, 800, 95, 40, 41, 42])
    assert recovery_index(probes, threshold_ms=60) == 3


def test_two_slow_probes_at_the_end_are_not_recovered() -> None:
    assert recovery_index(_probes([40, 41, 42, 900, None]), threshold_ms=60) is None
    assert recovery_index(_probes([40]), threshold_ms=60) is None  # too few probes to tell
