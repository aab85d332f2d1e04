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
