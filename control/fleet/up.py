"""`keybatch up`: broker, replicas and gateway as child processes, in the foreground.

A child that dies is restarted with backoff while the rest keep serving; a dead
replica's lease is released first, so what it held is served by the others.
Stopping (Ctrl-C or SIGTERM) goes front to back: the gateway stops accepting and
finishes the requests it holds, then the replicas finish what they buffered,
then the broker stops. Every child gets SIGTERM if the supervisor dies, even by
SIGKILL, so nothing is left running (docs/supervisor.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

# Imported at start, not at a replica's first death, whose re-queue they would delay.
from control.broker.leases import release_replica
from control.core import connect
from control.core.procs import child_of
from control.core.settings import Settings
from control.core.vocab import Policy
from control.fleet.credentials import Role, credentials_path, write_operator_url
from control.fleet.valkey import EmbeddedBroker

RESTART_FIRST_S = 0.5
RESTART_MAX_S = 10.0
HEALTHY_AFTER_S = 5.0  # a child that lived this long (booted and served) restarts at once
POLL_S = 0.1  # SIGCHLD wakes the loop on a death; this bounds a missed one
RELEASE_TIMEOUT_S = 0.5
# A replica started again boots (Python, Celery: a second or two of a core) at a low
# priority, so that on a shared host it does not take the CPU the serving processes
# need while the fleet is short of one; it gets the normal priority once it has booted.
RESTART_NICE = 10
# Warnings a child would print that the person running `keybatch up` cannot act on, each
# matched by the start of its message (PYTHONWARNINGS syntax; the user's own filters,
# listed after these, take precedence):
# - Celery's, when a replica runs as root (a container's default user);
# - gevent's, that ssl was imported before gunicorn's gevent worker patches it: the one
#   module it names as unpatched, redis.asyncio, is one the gateway never uses.
CHILD_WARNING_FILTERS = (
    "ignore:You're running the worker with superuser privileges:UserWarning",
    "ignore:Monkey-patching ssl after ssl has already been imported:RuntimeWarning",
)
RENICE_AFTER_S = 5.0
# A standby that took a dead replica's place is followed by a new one this much later, so
# that the new one's boot does not take the CPU the serving processes need while they
# catch up with what the death left them.
STANDBY_AFTER_S = 1.0
REPLICAS_PER_MODEL = 2  # the default: one can die or restart while the other serves


class PlanError(ValueError):
    """A deployment that cannot serve what it was asked to (a usage error)."""


@dataclass
class Plan:
    workers: int | None = None  # None: REPLICAS_PER_MODEL per model
    backend: str = "fixed"
    policy: Policy | None = None  # None: the POLICY setting
    models: list[str] = field(default_factory=list)
    port: int = 8000
    quiet: bool = False
    cells: int | None = None  # embedded brokers; None: one, or as many as CELLS names
    replicas_per_host: int = 0  # replicas grouped into simulated hosts of this many (0: one host)

    def replica_host(self, index: int, host: str) -> str:
        """The host replica `index` says it runs on: this one, or its simulated group's."""
        return f"{host}-h{index // self.replicas_per_host + 1}" if self.replicas_per_host else host

    def num_cells(self, settings: Settings) -> int:
        return self.cells or len(settings.cells) or 1

    def replica_cell(self, index: int, num_cells: int) -> int:
        """Each round of the models (one replica of each) to the next cell: every cell
        serves every model while there are replicas enough."""
        return (index // max(1, len(self.models))) % num_cells

    def num_workers(self) -> int:
        return self.workers if self.workers is not None else REPLICAS_PER_MODEL * len(self.models)

    def replica_models(self) -> list[str]:
        """Spread the workers over the models, round robin."""
        return [self.models[i % len(self.models)] for i in range(self.num_workers())]

    def models_without_replica(self) -> list[str]:
        return [m for m in self.models if m not in self.replica_models()]


def check_plan(settings: Settings, plan: Plan) -> None:
    """Fill in the models (all configured) and refuse a plan that cannot serve them."""
    if not plan.models:
        plan.models = list(settings.models)
    unknown = [m for m in plan.models if m not in settings.models]
    if unknown:
        raise PlanError(f"unknown model(s) {', '.join(unknown)}; configured: {', '.join(settings.models)}")
    if plan.cells is not None and plan.cells < 1:
        raise PlanError("--cells must be at least 1")
    if plan.cells is not None and settings.cells and plan.cells != len(settings.cells):
        raise PlanError(f"--cells {plan.cells} but KEYBATCH_CELLS names {len(settings.cells)} brokers")
    if (plan.cells or 1) > 1 and settings.redis_url and not settings.cells:
        raise PlanError("--cells with KEYBATCH_REDIS_URL: name every cell's broker in KEYBATCH_CELLS instead")
    cells = plan.num_cells(settings)
    served = {plan.replica_cell(i, cells) for i in range(plan.num_workers())}
    if len(served) < cells:
        bare_cells = ", ".join(str(c) for c in range(cells) if c not in served)
        raise PlanError(
            f"--workers {plan.num_workers()} leaves cell {bare_cells} without a replica: replicas go to the cells "
            f"one round of the {len(plan.models or settings.models)} models at a time"
        )
    bare = plan.models_without_replica()
    if bare:
        raise PlanError(
            f"--workers {plan.num_workers()} leaves {', '.join(bare)} without a replica: "
            f"{len(plan.models)} models need at least {len(plan.models)} "
            f"(the default is {REPLICAS_PER_MODEL} per model)"
        )


@dataclass
class Backoff:
    delay_s: float = RESTART_FIRST_S

    def after_death(self, lived_s: float) -> float:
        """The wait before the next restart: none after a long enough life (the fleet is
        short of the child until it is back); after a short one, doubling from the first."""
        if lived_s >= HEALTHY_AFTER_S:
            self.delay_s = RESTART_FIRST_S
            return 0.0
        delay = self.delay_s
        self.delay_s = min(delay * 2, RESTART_MAX_S)
        return delay


Kind = Literal["replica", "gateway", "broker"]


@dataclass
class Child:
    """One supervised place: a replica (its index in `System.workers`), the gateway or a
    cell's broker (its index in `System.brokers`)."""

    kind: Kind
    name: str
    index: int = 0
    started_at: float = 0.0
    restart_at: float | None = None  # set while it is dead
    renice_at: float | None = None  # a restarted replica's normal priority is due then
    backoff: Backoff = field(default_factory=Backoff)

    @property
    def label(self) -> str:
        return f"replica {self.name}" if self.kind == "replica" else self.kind


class System:
    """The processes of one keybatch deployment on this host."""

    def __init__(self, settings: Settings, plan: Plan) -> None:
        self.settings = settings
        self.plan = plan
        check_plan(settings, plan)
        self.brokers: list[EmbeddedBroker] = []  # embedded, one per cell
        self.workers: list[subprocess.Popen[bytes]] = []
        self.gateway: subprocess.Popen[bytes] | None = None
        # Booted replica processes, their engine loaded, waiting on stdin for a place.
        self.standbys: list[tuple[subprocess.Popen[bytes], float]] = []  # (process, started at)
        self.standby_due_at: float | None = None  # when the next standby is started
        self.standby_backoff = Backoff()
        self.children: list[Child] = []
        # The operator's URL of each cell (the supervisor's own calls, tests, tools); the
        # children get their role's (`child_url`).
        self.cell_urls: list[str] = list(settings.cells) or ([settings.redis_url] if settings.redis_url else [])
        self.num_cells = plan.num_cells(settings)
        self.credentials_file: Path | None = None  # where the operator's URL is left for the tools
        self.url = f"http://{settings.bind}:{plan.port}"
        # Children log to stderr; stdout carries only `keybatch ready: URL`.
        self.out = subprocess.DEVNULL if plan.quiet else sys.stderr

    @property
    def redis_url(self) -> str | None:
        """The first cell's operator URL."""
        return self.cell_urls[0] if self.cell_urls else None

    @property
    def broker(self) -> EmbeddedBroker | None:
        """The first cell's embedded broker."""
        return self.brokers[0] if self.brokers else None

    def child_url(self, role: Role, cell: int = 0) -> str:
        """The broker URL a child of `role` gets for a cell: an embedded broker's user for
        that role (a data-path child cannot act as the operator), else the configured URL."""
        if self.brokers:
            return self.brokers[cell].url_for(role)
        return self.cell_urls[cell]

    def env(self, role: Role, cell: int = 0) -> dict[str, str]:
        # In the environment (readable by this user alone), never on a command line (ps).
        env = dict(os.environ)
        env["KEYBATCH_REDIS_URL"] = self.child_url(role, cell)
        if self.num_cells > 1:
            env.pop("KEYBATCH_BROKER_URL", None)  # each child's broker is its cell's
            # A gateway serves every cell; a replica serves its REDIS_URL's and answers
            # through the others when its own broker does not take its answers.
            env["KEYBATCH_CELLS"] = json.dumps([self.child_url(role, i) for i in range(self.num_cells)])
        else:
            env.pop("KEYBATCH_CELLS", None)
        env["KEYBATCH_PORT"] = str(self.plan.port)
        served = {m: self.settings.models[m] for m in self.plan.models}
        env["KEYBATCH_MODELS"] = json.dumps(served)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env["PYTHONWARNINGS"] = ",".join(filter(None, [*CHILD_WARNING_FILTERS, os.environ.get("PYTHONWARNINGS")]))
        return env

    def start(self, timeout_s: float = 60.0) -> None:
        if not self.cell_urls:
            for i in range(self.num_cells):
                broker = EmbeddedBroker(
                    out=self.out,
                    maxmemory_mb=self.settings.broker_maxmemory_mb,
                    operator_password=self.settings.admin_token,
                )
                self.brokers.append(broker)
                self.cell_urls.append(broker.start())
                name = "embedded Valkey" if self.num_cells == 1 else f"embedded Valkey of cell {i}"
                self.children.append(Child("broker", name, index=i, started_at=time.monotonic()))
            self._leave_credentials()
        host = self.settings.host
        # Replicas of two regions on one host (tests, demos) must not share names.
        region = "" if self.settings.region == "local" else f".{self.settings.region}"
        for i, model in enumerate(self.plan.replica_models()):
            self.children.append(
                Child("replica", f"{model}-{i + 1}{region}@{self.plan.replica_host(i, host)}", index=i)
            )
        self.children.append(Child("gateway", "gateway"))
        for child in self.children:
            if child.kind != "broker":
                self._spawn(child)
        self._wait_ready(timeout_s)
        if self.settings.standby_replicas:
            self.standby_due_at = time.monotonic()  # after readiness: the replicas boot first

    def _replica_cmd(self, child: Child) -> list[str]:
        return [*self._worker_cmd(self.plan.replica_models()[child.index]), "--name", child.name]

    def _worker_cmd(self, model: str) -> list[str]:
        return [
            *[sys.executable, "-m", "control", "worker"],
            *["--model", model, "--backend", self.plan.backend, "--policy", self.plan.policy or self.settings.policy],
        ]

    def _replica_env(self, child: Child) -> dict[str, str]:
        env = self.env("replica", self.plan.replica_cell(child.index, self.num_cells))
        env["KEYBATCH_HOST"] = self.plan.replica_host(child.index, self.settings.host)
        return env

    def _spawn(self, child: Child) -> None:
        """Start the child's process and put it in its place (replaces a dead one)."""
        if child.kind == "broker":
            self.brokers[child.index].start()
        elif child.kind == "replica":
            restarted = child.index < len(self.workers)
            proc = _spawn(
                self._replica_cmd(child), self._replica_env(child), self.out, RESTART_NICE if restarted else 0
            )
            child.renice_at = time.monotonic() + RENICE_AFTER_S if restarted else None
            if child.index < len(self.workers):
                self.workers[child.index] = proc
            else:
                self.workers.append(proc)
        else:
            cmd = [sys.executable, "-m", "control", "api", "--port", str(self.plan.port)]
            self.gateway = _spawn(cmd, self.env("gateway"), self.out)
        child.started_at = time.monotonic()
        child.restart_at = None

    def _proc(self, child: Child) -> subprocess.Popen[bytes] | None:
        if child.kind == "broker":
            return self.brokers[child.index].process if self.brokers else None
        if child.kind == "replica":
            return self.workers[child.index]
        return self.gateway

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in [*self.workers, self.gateway]:
                if proc is not None and proc.poll() is not None:
                    self.stop()
                    raise SystemExit(f"a keybatch process exited during start: {proc.args!r}")
            try:
                with urllib.request.urlopen(f"{self.url}/readyz", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"keybatch was not ready within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 60.0) -> int:
        """Front to back; returns how many processes had to be killed."""
        killed, t0 = 0, time.monotonic()
        if self.gateway is not None:
            killed += _terminate([self.gateway], timeout_s)
        t1 = time.monotonic()
        standbys = [proc for proc, _ in self.standbys]
        self.standbys = []
        killed += _terminate([*standbys, *self.workers], timeout_s)
        t2 = time.monotonic()
        if not self.plan.quiet:
            print(f"keybatch: gateway stopped in {t1 - t0:.1f} s, replicas in {t2 - t1:.1f} s", file=sys.stderr)
        for broker in self.brokers:
            broker.stop()
        self.brokers = []
        if self.credentials_file is not None:
            self.credentials_file.unlink(missing_ok=True)
            self.credentials_file = None
        return killed

    def _leave_credentials(self) -> None:
        """The operator's URL in a file only this user can read, for `keybatch fleet`,
        `drain`, `dash`, `flower` (they look for it by the gateway's port)."""
        path = credentials_path(self.settings.secrets_dir, self.plan.port)
        write_operator_url(path, self.cell_urls)
        self.credentials_file = path
        if not self.plan.quiet:
            where = ", ".join(broker.address for broker in self.brokers)
            _log(f"embedded Valkey on {where}; the operator's credentials are in {path}")

    def wait(self) -> int:
        """Serve in the foreground, restarting what dies, until Ctrl-C or SIGTERM; then stop everything."""
        # Taken synchronously, not by a handler: a handler that takes a lock
        # (Event.set) deadlocks when a second signal lands inside it, as when
        # `timeout` sends its two SIGTERMs (docs/supervisor.md). Blocked signals stay pending.
        # SIGCHLD is taken the same way, to notice a death at once.
        stop_signals = {signal.SIGINT, signal.SIGTERM}
        waited = stop_signals | {signal.SIGCHLD}
        signal.pthread_sigmask(signal.SIG_BLOCK, waited)
        while True:
            info = signal.sigtimedwait(waited, self._next_wake_s(time.monotonic()))
            if info is not None and info.si_signo in stop_signals:
                break
            self.heal()
        print("keybatch: stopping (finishing requests in flight)", flush=True)
        return 1 if self.stop() else 0

    def _next_wake_s(self, now: float) -> float:
        due = [c.restart_at - now for c in self.children if c.restart_at is not None]
        if self.standby_due_at is not None:
            due.append(self.standby_due_at - now)
        return max(0.001, min([POLL_S, *due]))

    def heal(self) -> None:
        """Notice the children that died; restart those whose backoff has passed."""
        for child in self.children:
            if child.renice_at is not None and time.monotonic() >= child.renice_at:
                child.renice_at = None
                proc = self._proc(child)
                if proc is not None:
                    _renice(proc.pid, 0)
            if child.restart_at is None:
                proc = self._proc(child)
                code = proc.poll() if proc is not None else -1
                if code is not None:
                    self._on_death(child, proc, code)
            elif time.monotonic() >= child.restart_at:
                self._restart(child)
        self._keep_standbys()

    def _keep_standbys(self) -> None:
        """Forget a standby that died (another follows after a backoff); start one when due."""
        now = time.monotonic()
        for proc, started in list(self.standbys):
            if proc.poll() is not None:
                self.standbys.remove((proc, started))
                self._standby_died(proc, started)
        if self.standby_due_at is None or now < self.standby_due_at:
            return
        self.standby_due_at = None
        if len(self.standbys) >= self.settings.standby_replicas:
            return
        model = self.plan.replica_models()[0]
        cmd = [*self._worker_cmd(model), "--standby"]
        env = self.env("replica")
        try:
            proc = _spawn(cmd, env, self.out, RESTART_NICE, stdin=subprocess.PIPE)
        except OSError as exc:
            delay = self.standby_backoff.after_death(0.0)
            self.standby_due_at = now + delay
            _log(f"standby: start failed ({exc}); next try in {delay:.1f} s")
            return
        self.standbys.append((proc, now))
        if len(self.standbys) < self.settings.standby_replicas:
            self.standby_due_at = now  # the next at the next wake

    def _standby_died(self, proc: subprocess.Popen[bytes], started: float) -> None:
        """Another standby follows after a backoff (unless one is due sooner)."""
        code = proc.wait()
        now = time.monotonic()
        delay = self.standby_backoff.after_death(now - started)
        _log(f"standby (pid {proc.pid}) died ({_exit_reason(code)}); another in {delay:.1f} s")
        if self.standby_due_at is None or self.standby_due_at > now + delay:
            self.standby_due_at = now + delay

    def _take_standby(self, child: Child) -> bool:
        """Put a waiting standby in a dead replica's place: it becomes the replica (name,
        model, host, cell) and serves within a fraction of a boot. False: none was there."""
        while self.standbys:
            proc, started = self.standbys.pop(0)
            if proc.poll() is not None:
                self._standby_died(proc, started)
                continue
            place = {
                "name": child.name,
                "model": self.plan.replica_models()[child.index],
                "env": self._replica_env(child),
            }
            try:
                assert proc.stdin is not None
                proc.stdin.write(json.dumps(place).encode() + b"\n")
                proc.stdin.close()
            except (OSError, ValueError):  # it died since the last look
                proc.kill()
                self._standby_died(proc, started)
                continue
            _renice(proc.pid, 0)
            self.workers[child.index] = proc
            now = time.monotonic()
            child.started_at, child.restart_at, child.renice_at = now, None, None
            self.standby_due_at = now + STANDBY_AFTER_S
            _log(f"{child.label}: standby (pid {proc.pid}) took its place")
            return True
        return False

    def _on_death(self, child: Child, proc: subprocess.Popen[bytes] | None, code: int) -> None:
        now = time.monotonic()
        delay = child.backoff.after_death(now - child.started_at)
        pid = proc.pid if proc is not None else 0
        _log(f"{child.label} (pid {pid}) died ({_exit_reason(code)}) after {now - child.started_at:.1f} s")
        if child.kind != "broker" and pid:
            _end_group(pid)
        if child.kind == "replica":
            self._replica_died(child.name, self.plan.replica_cell(child.index, self.num_cells))
            if delay == 0.0 and self._take_standby(child):
                return
        child.restart_at = time.monotonic() + delay
        _log(f"{child.label}: restarting in {delay:.1f} s")

    def _restart(self, child: Child) -> None:
        try:
            self._spawn(child)
        except Exception as exc:  # noqa: BLE001 (a failed restart is retried, never fatal)
            delay = child.backoff.after_death(0.0)
            child.restart_at = time.monotonic() + delay
            _log(f"{child.label}: restart failed ({exc}); next try in {delay:.1f} s")
            return
        proc = self._proc(child)
        _log(f"{child.label} restarted (pid {proc.pid if proc else 0})")

    def _replica_died(self, name: str, cell: int = 0) -> None:
        """Release the dead replica's lease, so what it held is served by the others."""
        # Whatever this raises is logged: the supervisor keeps supervising.
        client = connect.client(
            self.cell_urls[cell], socket_timeout=RELEASE_TIMEOUT_S, socket_connect_timeout=RELEASE_TIMEOUT_S
        )
        try:
            released = release_replica(client, name, self.settings.batch_ms + self.settings.deadline_margin_ms)
            _log(f"replica {name}: released {released}")
        except Exception as exc:  # noqa: BLE001
            _log(f"replica {name}: release failed: {exc!r}")
        finally:
            client.close()


def _log(line: str) -> None:
    print(f"keybatch: {line}", file=sys.stderr, flush=True)


def _exit_reason(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def _end_group(pgid: int) -> None:
    """SIGTERM what the dead child left in its process group (a dead gunicorn
    master's workers): they finish what they hold and free the port."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass


def _spawn(
    cmd: list[str], env: dict[str, str], out: IO[str] | int | None, niceness: int = 0, stdin: int | None = None
) -> subprocess.Popen[bytes]:
    """A child in its own session (Ctrl-C reaches only the supervisor, which stops the
    children in order) that gets SIGTERM if the supervisor dies without stopping it."""
    preexec = child_of(os.getpid())

    def start() -> None:
        preexec()
        if niceness:
            os.nice(niceness)

    return subprocess.Popen(cmd, env=env, stdin=stdin, stdout=out, stderr=out, start_new_session=True, preexec_fn=start)


def _renice(pid: int, niceness: int) -> None:
    """Every thread of the process (Linux keeps a priority per thread)."""
    try:
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        threads = [pid]
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, niceness)
        except OSError:
            pass  # gone, or not ours to raise (a supervisor without the privilege)


def _terminate(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> int:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    killed = 0
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            killed += 1
    return killed
