"""redis-py internals the gateway relies on: the one module that reaches into them.

An upgrade of redis-py or gevent that moves what this touches fails
`tests/broker/test_adapters.py`, which checks it in a monkey-patched interpreter against a
real Valkey.
"""

from __future__ import annotations


def unpatched_pool_checks() -> None:
    """Let redis-py check pooled connections with the real `select.poll`.

    Before lending a connection, redis-py polls its socket with a zero timeout
    (is there stale data, did the server close it?). Under gevent's monkey
    patching that poll builds and starts event-loop watchers, for a check that
    never blocks. The original poll answers the same question with one syscall
    (what each costs: docs/decisions/0006).
    """
    import select
    import types

    from gevent import monkey

    if not monkey.is_module_patched("select"):
        return
    from redis._parsers import hiredis

    original = types.ModuleType("select")
    original.__dict__.update(vars(select))
    original.poll = monkey.get_original("select", "poll")  # type: ignore[attr-defined]  # ModuleType declares none
    hiredis.select = original


def cooperative_pool_queue(pool: object) -> None:
    """A bounded pool's queue of idle connections as gevent's own queue.

    redis-py's BlockingConnectionPool keeps its connections in the standard library's
    LifoQueue, whose Condition asks, on every get and put, whether its lock is held by
    trying it without blocking; gevent's lock answers a failed try by switching to the
    hub and back (`gevent.sleep()`, for spin locks). So each lend and each return cost
    two greenlet switches and the Python of a Condition over gevent's lock. gevent's
    LifoQueue keeps the contract the pool relies on (a get that waits at most its
    timeout, then raises queue.Empty; put_nowait raising queue.Full when full).
    Only under gevent's monkey patching, before the pool lends its first connection.
    """
    import redis
    from gevent import monkey

    if not monkey.is_module_patched("threading") or not isinstance(pool, redis.BlockingConnectionPool):
        return
    from gevent.queue import LifoQueue

    pool.queue_class = LifoQueue
    pool.reset()  # a new queue of the class, filled with placeholders as the pool made it


POOL_TELEMETRY = ("get_pool_name", "record_connection_count", "record_connection_wait_time")


def quiet_pool_telemetry() -> None:
    """No OpenTelemetry bookkeeping on a pool's lend and return when none is configured.

    redis-py 8 names the pool (an f-string) and calls its recorder four times for each
    lend and return, each call asking for a collector that is not there: about 17 calls
    a request for nothing (docs/decisions/0024). With no provider set up (keybatch sets
    none), the pool's module gets functions that do nothing in their place; with one,
    nothing changes.
    """
    from redis import connection
    from redis.observability.providers import get_observability_instance

    if get_observability_instance().get_provider_manager() is not None:
        return
    for name in POOL_TELEMETRY:
        setattr(connection, name, _nothing)


def _nothing(*_args: object, **_kwargs: object) -> str:
    return ""
