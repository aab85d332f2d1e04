"""One place that turns a broker URL into redis-py clients and pools, and into kombu's broker URL.

Besides redis-py's own schemes (redis://, rediss://, unix://) a URL may name a set of
Redis Sentinels that watch one master (docs/decisions/0007)::

    sentinel://[[USER]:PASSWORD@]HOST[:PORT][,HOST[:PORT]...][/DB]?master=NAME[&sentinel_password=PW]

PORT defaults to 26379 and DB to 0. USER and PASSWORD are the master's (and its
replicas'), `sentinel_password` the sentinels' own `requirepass`, if any. TLS to
sentinels or to the master is not supported. A client built from such a URL asks the
sentinels for the master's address whenever it opens a connection, so after a
failover new connections go to the promoted replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelConnectionPool

SENTINEL_SCHEME = "sentinel"
SENTINEL_PORT = 26379
PLAIN_SCHEMES = ("redis", "rediss", "unix")
_SENTINEL_OPTIONS = {"master", "sentinel_password"}
KOMBU_SENTINEL_TIMEOUT_S = 2.0  # a replica's bound on a sentinel's answer (as on its own state client)


@dataclass(frozen=True)
class SentinelTarget:
    """What a sentinel:// URL says: where the sentinels are and which master they watch."""

    sentinels: tuple[tuple[str, int], ...]
    master: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None


def is_sentinel(url: str) -> bool:
    return url.startswith(f"{SENTINEL_SCHEME}://")


def check_url(url: str) -> None:
    """Raise ValueError with a reason when `url` is not one this module can connect to."""
    scheme = url.partition("://")[0] if "://" in url else ""
    if scheme == SENTINEL_SCHEME:
        parse_sentinel(url)
    elif scheme not in PLAIN_SCHEMES:
        raise ValueError("must be a redis://, rediss://, unix:// or sentinel:// URL")


def parse_sentinel(url: str) -> SentinelTarget:
    """Read a sentinel:// URL (syntax in the module docstring)."""
    parts = urlsplit(url)
    if parts.scheme != SENTINEL_SCHEME:
        raise ValueError("not a sentinel:// URL")
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, password = _credentials(userinfo)
    sentinels = tuple(_address(h) for h in hosts.split(","))
    query = parse_qs(parts.query, keep_blank_values=True)
    unknown = set(query) - _SENTINEL_OPTIONS
    if unknown:
        raise ValueError(f"sentinel:// URL: unknown option(s) {', '.join(sorted(unknown))}")
    master = query.get("master", [""])[-1]
    if not master:
        raise ValueError("sentinel:// URL needs ?master=NAME (the name the sentinels monitor)")
    path = parts.path.strip("/")
    if path and not path.isdigit():
        raise ValueError(f"sentinel:// URL: the database must be a number, not {path!r}")
    sentinel_password = query.get("sentinel_password", [None])[-1] or None
    return SentinelTarget(sentinels, master, int(path or 0), username, password, sentinel_password)


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    if not userinfo:
        return None, None
    user, colon, password = userinfo.partition(":")
    if not colon:  # redis-py reads a lone userinfo as the password
        return None, unquote(user)
    return unquote(user) or None, unquote(password) or None


def _address(text: str) -> tuple[str, int]:
    if text.startswith("["):  # [IPv6]:port
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = text.partition(":")
    if not host:
        raise ValueError("sentinel:// URL: a sentinel without a host")
    if port and not port.isdigit():
        raise ValueError(f"sentinel:// URL: bad port {port!r}")
    return host, int(port or SENTINEL_PORT)


# -- redis-py -------------------------------------------------------------------------


class SentinelBlockingConnectionPool(SentinelConnectionPool, redis.BlockingConnectionPool):
    """redis-py's sentinel pool with BlockingConnectionPool's bound: a caller waits up to
    `timeout` for a free connection instead of opening one past `max_connections`.

    The order of the bases is what makes it work: SentinelConnectionPool's `reset`,
    `owns_connection` (a connection to a former master is dropped when released) and
    connection class, BlockingConnectionPool's queue, `get_connection` and `release`.
    """


def client(url: str, **timeouts: Any) -> redis.Redis:
    """A client to the server (or the sentinels' current master) `url` names."""
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **timeouts)
    target = parse_sentinel(url)
    return _sentinel(target, timeouts).master_for(target.master, **_master_kwargs(target, timeouts))


def blocking_pool(url: str, max_connections: int, timeout: float, **timeouts: Any) -> redis.ConnectionPool:
    """A bounded pool: at most `max_connections`, a wait of at most `timeout` seconds for one."""
    if not is_sentinel(url):
        return redis.BlockingConnectionPool.from_url(url, max_connections=max_connections, timeout=timeout, **timeouts)
    target = parse_sentinel(url)
    return SentinelBlockingConnectionPool(
        target.master,
        _sentinel(target, timeouts),
        max_connections=max_connections,
        timeout=timeout,
        **_master_kwargs(target, timeouts),
        is_master=True,
    )


def client_like(like: redis.Redis, **overrides: Any) -> redis.Redis:
    """A client to the same server (or the same sentinels' master) with a plain pool of its
    own and other connection settings (timeouts)."""
    pool = like.connection_pool
    kwargs = {**pool.connection_kwargs, **overrides}
    if isinstance(pool, SentinelConnectionPool):
        kwargs.pop("connection_pool")  # the proxy of `pool`; the new pool makes its own
        new: redis.ConnectionPool = SentinelConnectionPool(
            pool.service_name, pool.sentinel_manager, connection_class=pool.connection_class, is_master=True, **kwargs
        )
    else:
        new = redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
    return redis.Redis(connection_pool=new)


def _sentinel(target: SentinelTarget, timeouts: dict[str, Any]) -> Sentinel:
    # The sentinels are asked with the same bounds as the master.
    bounds = {k: v for k, v in timeouts.items() if k.startswith("socket_")}
    return Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target, bounds))


def _sentinel_kwargs(target: SentinelTarget, bounds: dict[str, Any]) -> dict[str, Any]:
    """How to talk to the sentinels themselves. Without a retry policy of ours, redis-py
    gives each sentinel client its default one (3 retries, jittered backoff up to 8 s): a
    sentinel that is down then holds every master lookup for seconds, and the first answer
    after a failover comes that much later (docs/decisions/0007). One try each; the next
    sentinel is asked at once."""
    kwargs: dict[str, Any] = {"retry": Retry(NoBackoff(), 0), **bounds}
    if target.sentinel_password:
        kwargs["password"] = target.sentinel_password
    return kwargs


def _master_kwargs(target: SentinelTarget, timeouts: dict[str, Any]) -> dict[str, Any]:
    return {"db": target.db, "username": target.username, "password": target.password, **timeouts}


# -- kombu ----------------------------------------------------------------------------


def kombu_broker(url: str) -> tuple[str, dict[str, object]]:
    """The broker URL kombu understands and the transport options it needs besides.

    kombu's Redis transport takes sentinels as alternates, `sentinel://h1:p1;sentinel://h2:p2`,
    each with the database, and the master's name as the `master_name` transport option
    (kombu.transport.redis.SentinelChannel); how to talk to the sentinels (bounds, one
    try, their password) goes in `sentinel_kwargs`. Other URLs pass through unchanged.
    """
    if not is_sentinel(url):
        return url, {}
    target = parse_sentinel(url)
    userinfo = ""
    if target.password is not None:
        userinfo = f"{quote(target.username or '', safe='')}:{quote(target.password, safe='')}@"
    urls = [f"{SENTINEL_SCHEME}://{userinfo}{_netloc(host, port)}/{target.db}" for host, port in target.sentinels]
    bounds = {"socket_timeout": KOMBU_SENTINEL_TIMEOUT_S, "socket_connect_timeout": KOMBU_SENTINEL_TIMEOUT_S}
    options: dict[str, object] = {"master_name": target.master, "sentinel_kwargs": _sentinel_kwargs(target, bounds)}
    return ";".join(urls), options


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
