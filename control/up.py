"""`keybatch up`: broker, replicas and gateway as child processes, in the foreground.

Stopping (Ctrl-C or SIGTERM) goes front to back: the gateway stops accepting and
finishes the requests it holds, then the replicas finish what they buffered,
then the broker stops. Nothing is left running.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from control.broker import EmbeddedBroker
from control.settings import Settings


@dataclass
class Plan:
    workers: int = 2
    backend: str = "fixed"
    policy: str = "static"
    models: list[str] = field(default_factory=list)
    port: int = 8000
    quiet: bool = False

    def replica_models(self) -> list[str]:
        """Spread the workers over the models, round robin."""
        return [self.models[i % len(self.models)] for i in range(self.workers)]


class System:
    """The processes of one keybatch deployment on this host."""

    def __init__(self, settings: Settings, plan: Plan) -> None:
        self.settings = settings
        self.plan = plan
        if not plan.models:
            plan.models = list(settings.models)
        unknown = [m for m in plan.models if m not in settings.models]
        if unknown:
            raise SystemExit(f"unknown model(s) {', '.join(unknown)}; configured: {', '.join(settings.models)}")
        self.broker: EmbeddedBroker | None = None
        self.workers: list[subprocess.Popen[bytes]] = []
        self.gateway: subprocess.Popen[bytes] | None = None
        self.redis_url = settings.redis_url
        self.url = f"http://{settings.host}:{plan.port}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        assert self.redis_url is not None
        env["KEYBATCH_REDIS_URL"] = self.redis_url
        env["KEYBATCH_PORT"] = str(self.plan.port)
        served = {m: self.settings.models[m] for m in self.plan.models}
        env["KEYBATCH_MODELS"] = json.dumps(served)
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env

    def start(self, timeout_s: float = 60.0) -> None:
        if self.redis_url is None:
            self.broker = EmbeddedBroker()
            self.redis_url = self.broker.start()
        env = self.env()
        # Children log to stderr; stdout carries only `keybatch ready: URL`.
        out = subprocess.DEVNULL if self.plan.quiet else sys.stderr
        host = socket.gethostname()
        # Replicas of two regions on one host (tests, demos) must not share names.
        region = "" if self.settings.region == "local" else f".{self.settings.region}"
        for i, model in enumerate(self.plan.replica_models(), start=1):
            cmd = [
                sys.executable,
                "-m",
                "control",
                "worker",
                "--model",
                model,
                "--backend",
                self.plan.backend,
                "--policy",
                self.plan.policy,
                "--name",
                f"{model}-{i}{region}@{host}",
            ]
            self.workers.append(_spawn(cmd, env, out))
        cmd = [sys.executable, "-m", "control", "api", "--port", str(self.plan.port)]
        self.gateway = _spawn(cmd, env, out)
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for proc in [*self.workers, self.gateway]:
                if proc is not None and proc.poll() is not None:
                    self.stop()
                    raise SystemExit(f"a keybatch process exited during start: {proc.args}")
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
        killed += _terminate(self.workers, timeout_s)
        t2 = time.monotonic()
        if not self.plan.quiet:
            print(f"keybatch: gateway stopped in {t1 - t0:.1f} s, replicas in {t2 - t1:.1f} s", file=sys.stderr)
        if self.broker is not None:
            self.broker.stop()
            self.broker = None
        return killed

    def wait(self) -> int:
        """Serve in the foreground until Ctrl-C or SIGTERM; then stop everything."""
        # Taken synchronously, not by a handler: a handler that takes a lock
        # (Event.set) deadlocked when a second signal landed inside it, as the two
        # SIGTERMs of `timeout` (child, then group) did. Blocked signals stay pending.
        stop_signals = {signal.SIGINT, signal.SIGTERM}
        signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
        while signal.sigtimedwait(stop_signals, 0.5) is None:
            dead = [proc for proc in [*self.workers, self.gateway] if proc and proc.poll() is not None]
            if dead:
                print(f"keybatch: a process exited unexpectedly: {dead[0].args}", file=sys.stderr)
                self.stop()
                return 1
        print("keybatch: stopping (finishing requests in flight)", flush=True)
        return 1 if self.stop() else 0


def _spawn(cmd: list[str], env: dict[str, str], out: object) -> subprocess.Popen[bytes]:
    """A child in its own session (Ctrl-C reaches only the supervisor, which stops the
    children in order) that gets SIGTERM if the supervisor dies without stopping it."""
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=out, start_new_session=True, preexec_fn=_term_with_parent)


def _term_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


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
