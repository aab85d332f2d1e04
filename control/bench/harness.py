"""The deployment harness the tests, the benchmarks and the fault runs share: a private
Valkey, replicas and the gateway, started, waited on until ready, warmed, stopped, with
the child environment they run in and their logs kept or dropped.

`Deployment` runs `python -m control up` as a child process and finds its processes by
role; `in_process` (and `fixed_fleet`, `hf_fleet` over it) runs the same `System` in this
process. The child is what the fault runs and the benchmarks need: the fault runs test
the supervisor itself (its restarts, its stop, what a kill of it leaves), the
gateway-CPU benchmark runs another checkout's `control` (`cwd`), and the benchmarks
measure the deployment an operator runs. The tests and the serving benchmarks reach
into the children one by one (a replica's process, the broker's, the gateway's), which
`System` holds as its own.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import redis

from control.broker.registry import read_fleet
from control.core import connect
from control.core.procs import free_port
from control.core.settings import Settings
from control.core.vocab import FREE, PAID, Backend, Policy, Tier
from control.fleet.credentials import credentials_path, read_operator_cells, read_operator_url
from control.fleet.up import Plan, System

MODEL = "kb-small"
PAID_KEY, FREE_KEY = "harness-paid", "harness-free"  # the clients a caller without its own gets
READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 30.0
# What a harness sets for its deployments; a value inherited from the caller's
# environment would point them at someone else's broker or port.
OWN_SETTINGS = ("KEYBATCH_REDIS_URL", "KEYBATCH_BROKER_URL", "KEYBATCH_PORT", "KEYBATCH_PEERS", "KEYBATCH_REGION")


class DeploymentError(Exception):
    """The deployment could not be set up: it did not start, or did not warm."""


def api_keys(paid_key: str, free_key: str) -> str:
    """KEYBATCH_API_KEYS for one paid and one free client."""
    keys: dict[str, Tier] = {paid_key: PAID, free_key: FREE}
    return json.dumps(keys)


def child_env(paid_key: str = PAID_KEY, free_key: str = FREE_KEY, **settings: str) -> dict[str, str]:
    """The caller's environment for `up` (PATH, the venv), without what points at another
    deployment, with these clients and KEYBATCH_ settings."""
    env = {k: v for k, v in os.environ.items() if k not in OWN_SETTINGS}
    env["KEYBATCH_API_KEYS"] = api_keys(paid_key, free_key)
    env.update({f"KEYBATCH_{k.upper()}": v for k, v in settings.items()})
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def warm(url: str, replicas: int, key: str, model: str = MODEL) -> None:
    """Readiness is not warmth: the first batch of a replica runs slow; one request per replica."""
    body = json.dumps({"model": model, "prompt": "def warm():\n    ", "max_tokens": 4}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    for _ in range(replicas):
        req = urllib.request.Request(f"{url}/v1/completions", body, headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                resp.read()
        except (urllib.error.URLError, OSError) as exc:
            raise DeploymentError(f"warm-up request to {url} failed: {exc}") from None


class Deployment:
    """One `keybatch up` subprocess; its processes are found by role among its
    descendants each time they are needed (a supervisor may have replaced them)."""

    def __init__(
        self,
        name: str,
        replicas: int,
        env: dict[str, str],
        cwd: str | None = None,
        models: Sequence[str] = (MODEL,),
        backend: Backend = "fixed",
        policy: Policy | None = None,  # None: the POLICY setting of `env`
        cells: int = 1,
        replicas_per_host: int = 0,
    ) -> None:
        self.name = name
        self.cells = cells
        self.replicas_per_host = replicas_per_host
        self.backend, self.policy = backend, policy
        self.cwd = cwd  # the checkout whose `control` runs (default: this one)
        self.replicas_wanted = replicas
        self.models = list(models)  # `up --models`: its replicas go round robin over this list
        self.env = env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[str] | None = None
        self.seen: dict[int, psutil.Process] = {}  # every process of it ever found, for the final sweep
        fd, self.log_path = tempfile.mkstemp(prefix=f"keybatch-chaos-{name}-", suffix=".log")
        os.close(fd)

    def start(self) -> None:
        cmd = [sys.executable, "-m", "control", "up", "--backend", self.backend]
        cmd += ["--policy", self.policy] if self.policy else []
        cmd += ["--workers", str(self.replicas_wanted)]
        cmd += ["--cells", str(self.cells)] if self.cells > 1 else []
        cmd += ["--replicas-per-host", str(self.replicas_per_host)] if self.replicas_per_host else []
        cmd += ["--models", ",".join(self.models), "--port", str(self.port)]
        with open(self.log_path, "ab") as logfile:
            self.proc = subprocess.Popen(
                cmd, env=self.env, cwd=self.cwd, stdout=subprocess.PIPE, stderr=logfile, text=True
            )
        self._wait_ready()
        self.remember()

    def _wait_ready(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        while (remaining := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([self.proc.stdout], [], [], remaining)
            if not readable:
                break
            line = self.proc.stdout.readline()
            if not line:
                raise DeploymentError(f"`keybatch up` ({self.name}) exited during start; its log: {self.log_path}")
            if line.startswith("keybatch ready:"):
                return
        raise DeploymentError(f"`keybatch up` ({self.name}) not ready in {READY_TIMEOUT_S:.0f} s; log: {self.log_path}")

    def descendants(self) -> list[psutil.Process]:
        if self.proc is None:
            return []
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    def remember(self) -> None:
        for proc in self.descendants():
            self.seen.setdefault(proc.pid, proc)
        for broker in [self.broker(), *self.cell_brokers()]:
            if broker is not None:
                self.seen.setdefault(broker.pid, broker)

    def replicas(self) -> list[tuple[str, psutil.Process]]:
        """(replica name, process), sorted by name so a seed picks the same victim. A
        standby is one once it took a replica's place and registered under its name."""
        procs = [(role(proc), proc) for proc in self.descendants()]
        found = [(arg(proc, "--name"), proc) for kind, proc in procs if kind == "replica"]
        standbys = [proc for kind, proc in procs if kind == "standby"]
        if standbys:
            named = self.registered_names()
            found += [(named[proc.pid], proc) for proc in standbys if proc.pid in named]
        return sorted(((name or str(proc.pid), proc) for name, proc in found), key=lambda pair: pair[0])

    def registered_names(self) -> dict[int, str]:
        """Each registered replica's name by its pid, from every cell's registry."""
        named: dict[int, str] = {}
        for url in self.cell_urls() or [u for u in [self.redis_url()] if u]:
            client = connect.client(url, socket_timeout=2, socket_connect_timeout=2)
            try:
                named.update((info.pid, info.name) for info in read_fleet(client))
            except redis.RedisError:
                continue
            finally:
                client.close()
        return named

    def replica_pids(self) -> list[int]:
        return [proc.pid for _name, proc in self.replicas()]

    def gateway_workers(self) -> list[psutil.Process]:
        """The gateway's worker processes: gateway processes whose parent is one too."""
        gateways = [proc for proc in self.descendants() if role(proc) == "gateway"]
        pids = {proc.pid for proc in gateways}
        return sorted((proc for proc in gateways if parent_pid(proc) in pids), key=lambda proc: proc.pid)

    def redis_url(self) -> str | None:
        """The operator's broker URL that `up` left for the tools; else (a broker `up` was
        given) the one it gave its children. Neither is known before they start."""
        url = read_operator_url(self._credentials())
        if url is not None:
            return url
        for proc in self.descendants():
            try:
                url = proc.environ().get("KEYBATCH_REDIS_URL")
            except psutil.Error:
                continue
            if url:
                return url
        return None

    def cell_urls(self) -> list[str]:
        """The operator's URL of each cell that `up` left for the tools."""
        return read_operator_cells(self._credentials())

    def _credentials(self) -> Path:
        """Where `up` leaves the operator's URLs (its SECRETS_DIR, by its port)."""
        secrets_dir = self.env.get("KEYBATCH_SECRETS_DIR")
        where = Path(secrets_dir).expanduser() if secrets_dir else Settings().secrets_dir
        return credentials_path(where, self.port)

    def cell_brokers(self) -> list[psutil.Process | None]:
        """Each cell's valkey-server child of `up`, in the cells' order (None: not found)."""
        brokers = [proc for proc in self.descendants() if role(proc) == "broker"]
        found: list[psutil.Process | None] = []
        for url in self.cell_urls():
            port = urlsplit(url).port
            found.append(next((proc for proc in brokers if port and serves_port(proc, port)), None))
        return found

    def broker(self) -> psutil.Process | None:
        """A valkey-server child of `up`, else the daemon listening on the children's broker port."""
        for proc in self.descendants():
            if role(proc) == "broker":
                return proc
        url = self.redis_url()
        port = urlsplit(url).port if url else None
        if port is None:
            return None
        for proc in psutil.process_iter(["name", "cmdline"]):
            if role(proc) == "broker" and serves_port(proc, port):
                return proc
        return None

    def stop(self) -> dict[str, object]:
        """SIGTERM to `up` (it stops its children); then whatever of ours outlived it is killed."""
        self.remember()
        for proc in self.seen.values():  # a stopped process cannot hear SIGTERM
            send_signal(proc, signal.SIGCONT)
        code, started = None, time.monotonic()
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                code = self.proc.wait()
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        left = [proc for proc in self.seen.values() if alive(proc)]
        for proc in left:
            send_signal(proc, signal.SIGKILL)
        psutil.wait_procs(left, timeout=5)
        return {
            "name": self.name,
            "exit_code": code,
            "stop_s": round(time.monotonic() - started, 2),
            "left_running": [describe(proc, role(proc)) for proc in left],
        }


def role(proc: psutil.Process) -> str:
    try:
        name = proc.name()
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return ""
    if "valkey-server" in name or "valkey-server" in cmdline:
        return "broker"
    if "control worker" in cmdline:
        return "standby" if "--standby" in cmdline else "replica"
    if "control api" in cmdline or "keybatch-api" in cmdline:  # the latter: gunicorn's process titles
        return "gateway"
    return ""


def arg(proc: psutil.Process, flag: str) -> str | None:
    try:
        cmdline = proc.cmdline()
    except psutil.Error:
        return None
    return cmdline[cmdline.index(flag) + 1] if flag in cmdline[:-1] else None


def parent_pid(proc: psutil.Process) -> int:
    try:
        return proc.ppid()
    except psutil.Error:
        return 0


def serves_port(proc: psutil.Process, port: int) -> bool:
    try:
        if " ".join(proc.cmdline()).endswith(f":{port}"):  # valkey titles itself "valkey-server HOST:PORT"
            return True
        return any(c.laddr and c.laddr.port == port for c in proc.net_connections("tcp"))
    except psutil.Error:
        return False


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def send_signal(proc: psutil.Process, sig: int) -> bool:
    try:
        proc.send_signal(sig)  # psutil refuses a pid that now belongs to another process
    except psutil.Error:
        return False
    return True


def describe(proc: psutil.Process, label: str = "") -> str:
    return f"{label} (pid {proc.pid})" if label else f"pid {proc.pid}"


@contextmanager
def in_process(plan: Plan, keys: Mapping[str, Tier], settings: Mapping[str, str] | None = None) -> Iterator[System]:
    """`plan` as `System` in this process, with these clients and KEYBATCH_ settings set in
    this process's environment while it runs (the children inherit it), restored after."""
    saved = dict(os.environ)
    os.environ["KEYBATCH_API_KEYS"] = json.dumps(dict(keys))
    os.environ.pop("KEYBATCH_REDIS_URL", None)
    os.environ.update({f"KEYBATCH_{k.upper()}": v for k, v in (settings or {}).items()})
    try:
        system = System(Settings(), plan)
        system.start()
        try:
            yield system
        finally:
            system.stop()
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextmanager
def fixed_fleet(
    workers: int, paid_key: str, free_key: str, max_batch: int | None = None, policy: Policy = "static"
) -> Iterator[tuple[str, str, Settings]]:
    """Fixed-latency replicas of the first configured model, warmed by 2 s of load: the
    gateway's URL, the model, and the settings the deployment runs (its broker's URL in them)."""
    from control.load.generator import generate
    from control.load.spec import LoadSpec

    model = next(iter(Settings().models))
    settings = {"max_batch": str(max_batch)} if max_batch is not None else {}
    plan = Plan(workers=workers, policy=policy, models=[model], port=free_port(), quiet=True)
    with in_process(plan, {paid_key: PAID, free_key: FREE}, settings) as system:
        generate(LoadSpec(system.url, 50, 2.0, model, free_key=free_key), show_progress=False)
        yield system.url, model, system.settings.model_copy(update={"redis_url": system.redis_url})


@contextmanager
def hf_fleet(workers: int, policy: Policy, model: str, paid_key: str, free_key: str, **settings: str) -> Iterator[str]:
    """Replicas of the real model under `policy`, warmed; the gateway's URL. While it runs,
    this process's KEYBATCH_REDIS_URL is its broker (what `Settings().state_url` reads)."""
    from control.load.generator import generate
    from control.load.spec import LoadSpec

    plan = Plan(workers=workers, backend="hf", policy=policy, models=[model], port=free_port(), quiet=True)
    with in_process(plan, {paid_key: PAID, free_key: FREE}, settings) as system:
        spec = LoadSpec(system.url, 2.0, 3.0, model, free_key=free_key, deadline_ms=10_000)
        generate(spec, show_progress=False)  # first steps run slow (allocation, first kernels)
        if system.redis_url:
            os.environ["KEYBATCH_REDIS_URL"] = system.redis_url
        yield system.url
