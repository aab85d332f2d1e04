"""`python -m control up` as a child of the test, read through its ready line, its
children and the credentials it leaves."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import redis
import requests

from control.bench.harness import serves_port
from control.broker import keys
from control.core.procs import free_port
from control.core.settings import Settings
from control.fleet.credentials import credentials_path, read_operator_cells, read_operator_url
from tests.support.deploy import FREE_KEY, MODEL, PAID_KEY


@dataclass
class Up:
    proc: subprocess.Popen[str]
    port: int
    stderr: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, prompt: str = "def add(a, b):\n    ") -> int:
        body = {"model": MODEL, "prompt": prompt}
        try:
            return requests.post(f"{self.url}/v1/completions", json=body, timeout=10).status_code
        except requests.ConnectionError:
            return 0

    def posts(self, n: int) -> list[int]:
        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(self.post, [f"p{i}" for i in range(n)]))

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children()

    def replica(self, name_prefix: str) -> psutil.Process | None:
        for child in self.children():
            if any(arg.startswith(name_prefix) for arg in cmdline(child)):
                return child
        return None

    def standby(self) -> psutil.Process | None:
        """A standby waiting for a replica's place (`STANDBY_REPLICAS`), if one is there."""
        for child in self.children():
            if "--standby" in cmdline(child) and child.pid not in self.registered_pids():
                return child
        return None

    def registered_pids(self) -> set[int]:
        client = self.redis()
        return {int(client.hget(keys.replica_key(n.decode()), "pid") or 0) for n in client.smembers(keys.REPLICAS_KEY)}

    def broker(self) -> psutil.Process:
        return next(c for c in self.children() if "valkey" in c.name())

    def cell_urls(self) -> list[str]:
        """The operator's URL of each cell, as `up` left them for the tools."""
        return read_operator_cells(credentials_path(Settings().secrets_dir, self.port))

    def cell_broker(self, cell: int) -> psutil.Process:
        """The valkey-server child serving a cell (found by its port)."""
        port = urlsplit(self.cell_urls()[cell]).port
        return next(c for c in self.children() if "valkey" in c.name() and port and serves_port(c, port))

    def redis(self) -> redis.Redis:
        """The operator's client, by the URL `up` left for the operator's tools."""
        url = read_operator_url(credentials_path(Settings().secrets_dir, self.port))
        assert url is not None, "no operator credentials left by `keybatch up`"
        return redis.Redis.from_url(url, socket_timeout=2)

    def log(self) -> str:
        return self.stderr.read_text()


@contextmanager
def keybatch_up(*args: str, **settings: str) -> Iterator[Up]:
    """`python -m control up ARGS` on a free port, with these KEYBATCH_ settings, until
    its ready line; stopped after."""
    port = free_port()
    env = {**os.environ, "KEYBATCH_API_KEYS": json.dumps({PAID_KEY: "paid", FREE_KEY: "free"})}
    env.update({f"KEYBATCH_{k.upper()}": v for k, v in settings.items()})
    env.pop("KEYBATCH_REDIS_URL", None)
    with tempfile.NamedTemporaryFile("w+", prefix="keybatch-up-", suffix=".log") as err:
        # stderr to a file, not a pipe: nobody reads a pipe while the test runs,
        # and a full one would block every child that logs.
        proc = subprocess.Popen(
            [sys.executable, "-m", "control", "up", "--backend", "fixed", *args, "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
            text=True,
        )
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], 60)
            assert ready, "keybatch up printed nothing within 60 s"
            assert proc.stdout.readline().strip() == f"keybatch ready: http://127.0.0.1:{port}"
            yield Up(proc, port, Path(err.name))
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.NoSuchProcess:
        return []
