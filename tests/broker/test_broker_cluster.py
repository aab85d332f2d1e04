"""Every Lua script of the request path on a real three-shard Valkey cluster, through
redis-py's RedisCluster, with keys as control/core/protocol.py builds them.

A script names most of its keys inside itself (from ARGV and from values it reads), so
the cluster cannot check them before it runs; each script here runs with a `#!lua`
line, under which Valkey refuses any key of another slot than the first one the script
touched, even on the same shard. So a key builder that leaves the hash tag out fails
here, whichever shard its slot happens to sit on. docs/decisions/0015-broker-sharding.md.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster
from redis.commands.core import Script

from control.broker import keys, lua, records
from control.broker.lua import ADMIT_LUA, CANCEL_LUA, OWNER_SLACK_MS
from control.core import protocol as p
from control.core.procs import child_of, free_port
from control.fleet.valkey import valkey_server_binary
from tests.support.deploy import MODEL

SLOTS = 16384
NUM_SHARDS = 3
START_TIMEOUT_S = 10.0


def _start_node(port: int, bus_port: int, folder: Path) -> subprocess.Popen[bytes]:
    command = [valkey_server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--daemonize", "no"]
    command += ["--save", "", "--appendonly", "no", "--loglevel", "warning"]
    command += ["--cluster-enabled", "yes", "--cluster-port", str(bus_port)]
    command += ["--cluster-config-file", str(folder / f"nodes-{port}.conf")]
    with open(folder / f"valkey-{port}.log", "wb") as log:
        return subprocess.Popen(command, cwd=folder, stdout=log, stderr=log, preexec_fn=child_of(os.getpid()))


def _until(check: object, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except redis.RedisError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"the cluster did not come up: {what}")


def _answers(clients: list[redis.Redis]) -> bool:
    try:
        _until(lambda: all(c.ping() for c in clients), "ping")
    except AssertionError:
        return False
    return True


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    """Three shards on loopback, slots split evenly, no replicas (CLUSTER ADDSLOTSRANGE and MEET)."""
    folder = tmp_path_factory.mktemp("cluster")
    ports = [free_port() for _ in range(NUM_SHARDS)]
    bus_ports = [free_port() for _ in range(NUM_SHARDS)]
    nodes = [_start_node(port, bus, folder) for port, bus in zip(ports, bus_ports, strict=True)]
    try:
        clients = [redis.Redis(host="127.0.0.1", port=port, socket_timeout=2.0) for port in ports]
        if any(node.poll() is not None for node in nodes) or not _answers(clients):
            said = " ".join((folder / f"valkey-{port}.log").read_text(errors="replace")[-200:] for port in ports)
            pytest.skip(f"valkey-server cannot run in cluster mode here: {said.strip()}")
        try:
            clients[0].execute_command("CLUSTER", "INFO")
        except redis.ResponseError as exc:
            pytest.skip(f"valkey-server cannot run in cluster mode here: {exc}")
        per_shard = SLOTS // NUM_SHARDS
        for i, client in enumerate(clients):
            last = SLOTS - 1 if i == NUM_SHARDS - 1 else (i + 1) * per_shard - 1
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per_shard, last)
        for port, bus in zip(ports[1:], bus_ports[1:], strict=True):
            clients[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port, bus)
        _until(
            lambda: (
                all(c.cluster("info")["cluster_state"] == "ok" for c in clients)
                and all(int(c.cluster("info")["cluster_known_nodes"]) == NUM_SHARDS for c in clients)
            ),
            "cluster_state ok on every shard",
        )
        client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", port) for port in ports])
        yield client
        client.close()
    finally:
        for node in nodes:
            node.terminate()
        for node in nodes:
            node.wait(5)


class Scripts:
    """The project's scripts, each made strict about slots with a `#!lua` line."""

    def __init__(self, client: RedisCluster) -> None:
        def strict(source: str) -> Script:
            return client.register_script(source if source.startswith("#!lua") else "#!lua\n" + source)

        self.admit = strict(ADMIT_LUA)
        self.cancel = strict(CANCEL_LUA)
        self.record = strict(lua.RECORD_LUA)
        self.claim = strict(lua.CLAIM_LUA)
        self.deliver = strict(lua.DELIVER_LUA)
        self.stream = strict(lua.STREAM_LUA)
        self.sweep_one = strict(lua.SWEEP_ONE_LUA)
        self.sweep_dead = strict(lua.SWEEP_DEAD_LUA)
        self.rescue = strict(lua.RESCUE_LUA)
        self.take_queued = strict(lua.TAKE_QUEUED_LUA)
        self.hedge = strict(lua.HEDGE_LUA)
        self.supersede = strict(lua.SUPERSEDE_LUA)
        self.listener = strict(lua.LISTENER_LUA)


def _admit(
    s: Scripts, key: str, attempt: str, gateway: str, session: str | None = None, keep_ms: int = 0, fair: int = 1000
) -> list:
    """As the gateway calls it (api/gateway.py, Gateway._enqueue): keys and arguments."""
    waiting = keys.waiting_key(MODEL, "paid")
    names = [keys.owner_key(key), waiting, keys.waiting_key(MODEL, "free"), keys.queue_key(MODEL, "paid")]
    if session:
        names.append(keys.session_key(session))
    done = "1" if keep_ms else ""  # the answer is kept
    message = f'{{"properties":{{"priority":0}},"body":"MSG-{attempt}"}}'
    args: list = ["", 60_000, 9e15, attempt, "paid", 100, 0, message, done, gateway]
    args += [keys.queue_key(MODEL, "paid", behind=True), 100, fair, 100, 100.0, 100.0, 8]
    return s.admit(keys=names, args=args)  # type: ignore[no-any-return]


def _held_record(attempt: str, key: str, deadline_ms: float) -> str:
    """deadline|queue|waiting set|request key, as the replica writes it (the owner keeps the message)."""
    return f"{deadline_ms:.0f}|{keys.queue_key(MODEL, 'paid')}|{keys.waiting_key(MODEL, 'paid')}|{key}"


def _result(attempt: str) -> str:
    item = p.Result(
        id=attempt,
        text="x",
        finish_reason="length",
        prompt_tokens=1,
        completion_tokens=1,
        replica="r1",
        backend="fixed",
        batch_size=1,
        batch_start_ms=0,
        batch_end_ms=1,
    )
    return item.model_dump_json()


def _now_ms(client: RedisCluster) -> float:
    seconds, micros = client.time()
    return seconds * 1000.0 + micros / 1000.0


def test_the_scripts_here_are_all_the_projects_scripts() -> None:
    assert set(lua.SOURCES) == {
        "ADMIT", "CANCEL", "RECORD", "CLAIM", "DELIVER", "STREAM", "SWEEP_ONE", "SWEEP_DEAD", "RESCUE",
        "TAKE_QUEUED", "HEDGE", "SUPERSEDE", "LISTENER",
    }  # fmt: skip  # a new script joins Scripts and the test below


def test_the_harness_refuses_a_script_that_crosses_slots(cluster: RedisCluster) -> None:
    crossing = cluster.register_script("#!lua\nredis.call('SET', KEYS[1], 1)\nreturn redis.call('GET', ARGV[1])")
    with pytest.raises(redis.ResponseError, match="same slot|non local key"):
        crossing(keys=["kb:a"], args=["kb:b"])  # two keys without a tag: different slots
    assert cluster.keyslot("kb:a") != cluster.keyslot("kb:b")
    cluster.delete("kb:a")


def test_every_lua_script_runs_on_one_shard_with_the_projects_keys(cluster: RedisCluster) -> None:
    s = Scripts(cluster)
    now = _now_ms(cluster)
    # Admission, supersede in the session, a join from another gateway.
    assert _admit(s, "t:a", "att-a", "gw-1", session="t:s")[0] == 1
    assert _admit(s, "t:b", "att-b", "gw-1", session="t:s", keep_ms=30_000)[0] == 1  # supersedes t:a
    assert cluster.get(keys.cancel_key("att-a")) == b"superseded"
    assert _admit(s, "t:b", "att-b2", "gw-2", keep_ms=30_000)[:1] == [3]  # joins att-b: gw-1 and gw-2 wait
    assert cluster.llen(keys.reply_key("gw-1")) == 1  # the supersede
    # A stale owner: the retry is admitted as a new attempt and the old one cancelled.
    cluster.set(keys.owner_key("t:stale"), f"gw-1|{keys.waiting_key(MODEL, 'paid')}|t|att-old", px=OWNER_SLACK_MS - 1)
    assert _admit(s, "t:stale", "att-new", "gw-1")[0] == 1
    assert cluster.get(keys.cancel_key("att-old")) == b"expired"
    # A tenant past its fair depth: behind the tier's others, its message saying so.
    assert _admit(s, "u:x", "att-x", "gw-1", fair=0)[-1] == b"1"
    assert b'"priority":3' in cluster.lindex(keys.queue_key(MODEL, "paid", behind=True), 0)
    assert cluster.zcard(keys.tenant_waiting_key(MODEL, "paid", "u")) == 1

    # The replica: its lease, held records, claims, streamed text, delivery.
    cluster.set(keys.lease_key("r1"), 1, px=60_000)
    cluster.sadd(keys.HOLDERS_KEY, "r1")
    member = records.pack_running("att-b", "r1", "host-a", "paid", 16, "t:b")  # copies may be made of it
    record = ["r1", MODEL, "att-b", _held_record("att-b", "t:b", now + 60_000), member]
    gone = _held_record("att-gone", "t:gone", now + 60_000)
    assert s.record(keys=[keys.held_key("r1")], args=[*record, "att-gone", gone, ""]) == 1
    assert cluster.zscore(keys.running_key(MODEL), member) == pytest.approx(now + 60_000, abs=1)
    cluster.set(keys.lease_key("r2"), 1, px=60_000)
    cluster.set(keys.claim_key("att-other"), "r2", px=60_000)  # running on r2, whose lease is alive
    assert s.claim(keys=[keys.held_key("r1")], args=["r1", 60_000, "att-b", "att-other"]) == [1, 0]
    chunk = p.Chunk(id="att-b", offset=0, text="x").model_dump_json()
    assert s.stream(keys=[keys.owner_key("t:b")], args=["t:b", "att-b", chunk]) == 2  # both gateways
    items = ["t:b", "att-b", 30_000, "result", _result("att-b"), "gw-1"]
    items += ["t:late", "att-late", 0, "result", _result("att-late"), "gw-1"]  # no owner: wasted
    dropped = p.Dropped(id="att-a", reason="superseded", replica="r1").model_dump_json()
    items += ["t:a", "att-a", 0, "dropped", dropped, "gw-1"]  # its owner went with the supersede: to gw-1
    assert s.deliver(keys=[keys.held_key("r1")], args=["r1", *items]) == [1, 1]
    assert cluster.get(keys.WASTED_KEY) == b"1"
    assert _admit(s, "t:b", "att-b3", "gw-1", keep_ms=30_000)[0] == 2  # the stored answer

    # A gateway's cancel, then a replica that died holding two requests: one re-queued, one expired.
    assert _admit(s, "t:c", "att-c", "gw-1")[0] == 1
    assert s.cancel(keys=[keys.owner_key("t:c")], args=["t:c", "cancelled", "t", "", "gw-1"]) == 1
    assert _admit(s, "t:d", "att-d", "gw-1")[0] == 1
    assert _admit(s, "t:e", "att-e", "gw-1")[0] == 1
    cluster.hset(keys.replica_key("r3"), "model", MODEL)
    cluster.zadd(keys.idle_key(MODEL), {"r3": now})
    cluster.zadd(keys.launch_key(MODEL), {"r3": now})
    late = ["r3", "", "att-d", _held_record("att-d", "t:d", now + 60_000), ""]
    assert s.record(keys=[keys.held_key("r3")], args=[*late, "att-e", _held_record("att-e", "t:e", now), ""]) == 2
    cluster.sadd(keys.HOLDERS_KEY, "r3")
    assert s.sweep_dead(keys=[keys.HOLDERS_KEY], args=[265])[:4] == [1, 1, 1, 1]  # r3 swept: d re-queued, e expired
    assert cluster.zscore(keys.waiting_key(MODEL, "paid"), "att-d") is not None
    assert cluster.get(keys.cancel_key("att-e")) == b"expired"
    cluster.delete(keys.lease_key("r1"))
    assert s.sweep_one(keys=[keys.held_key("r1")], args=["r1", 265]) == [0, 0]  # delivered all it held
    # A request a dead replica popped and never recorded: its gateway offers it for rescue.
    assert _admit(s, "t:f", "att-f", "gw-1")[0] == 1
    cluster.delete(keys.queue_key(MODEL, "paid"))  # popped, with everything before it
    offer = [
        "att-f",
        "t:f",
        keys.queue_key(MODEL, "paid"),
        keys.waiting_key(MODEL, "paid"),
        now + 60_000,
        now,
    ]
    assert s.rescue(keys=[keys.HOLDERS_KEY], args=[265, 0, *offer]) == [b"att-f"]  # looked at, not pushed
    assert s.rescue(keys=[keys.HOLDERS_KEY], args=[265, 1, *offer]) == 1
    assert cluster.lrange(keys.queue_key(MODEL, "paid"), 0, -1) == [
        b'{"properties":{"priority":0},"body":"MSG-att-f"}'
    ]  # the message its owner record kept

    # A take fills empty seats from the model's lists, paid first, no more than the total.
    lists = [keys.queue_key(MODEL, "paid"), keys.queue_key(MODEL, "free"), keys.queue_key(MODEL, "free", behind=True)]
    cluster.lpush(lists[1], "free-1", "free-2")
    taken = s.take_queued(keys=lists, args=[2, 1, "paid", 2, "free", 2, "behind"])  # two in all, one paid at most
    assert taken == [b'{"properties":{"priority":0},"body":"MSG-att-f"}', b"free-1"]

    # Free-slot hedging: r1's request in the running set, a copy taken by r2.
    assert _admit(s, "t:g", "att-g", "gw-1")[0] == 1
    cluster.set(keys.claim_key("att-g"), "r1", px=60_000)  # r1 runs it, its lease alive
    cluster.set(keys.lease_key("r1"), 1, px=60_000)
    member = "att-g|r1|host-a|paid|16|t:g"
    cluster.zadd(keys.running_key(MODEL), {member: now + 60_000})  # as r1's claim adds it
    assert s.hedge(keys=[keys.running_key(MODEL)], args=[MODEL, "r2", 0, member]) == [
        b'{"properties":{"priority":0},"body":"MSG-att-g"}'
    ]
    assert cluster.get(keys.copy_key("att-g")) == b"r2"
    # An answer typed through takes its session's place: the request in flight is superseded.
    assert _admit(s, "t:h", "att-h", "gw-1", session="t:s2")[0] == 1
    assert s.supersede(keys=[keys.session_key("t:s2")], args=["t:h2", 60_000]) == 1
    assert cluster.get(keys.cancel_key("att-h")) == b"superseded"
    # ADMIT_BUMP: a free request in line, then a paid one that pushes it past its last start.
    free = ["", 60_000, now + 150, "att-i", "free", 100, now, "MSG-att-i", "", "gw-1", *[""] * 7, 100, 1, 0]
    free_keys = [keys.owner_key("t:i"), keys.waiting_key(MODEL, "paid"), keys.waiting_key(MODEL, "free")]
    assert s.admit(keys=[*free_keys, keys.queue_key(MODEL, "free")], args=free)[0] == 1
    paid = ["", 60_000, now + 600, "att-j", "paid", 100, now, "MSG-att-j", "", "gw-1", *[""] * 7, 100, 1, 0]
    assert s.admit(keys=[keys.owner_key("t:j"), *free_keys[1:], keys.queue_key(MODEL, "paid")], args=paid)[0] == 1
    assert cluster.get(keys.cancel_key("att-i")) == b"bumped"
    # SINGLE_LISTENER: the holder renews its token, then hands it on to the turn list.
    listener = [keys.listener_key(MODEL), keys.listener_turn_key(MODEL)]
    cluster.set(listener[0], "r1", px=60_000)
    assert s.listener(keys=listener, args=["r1", 80]) == 1
    assert s.listener(keys=listener, args=["r1", ""]) == 1
    assert cluster.llen(listener[1]) == 1

    # Everything those scripts wrote sits in the one slot of the tag, on one shard.
    slot = cluster.keyslot(p.HASH_TAG)
    written = list(cluster.scan_iter(match="*", target_nodes=RedisCluster.ALL_NODES))
    assert len(written) > 15
    assert {cluster.keyslot(key) for key in written} == {slot}, written
