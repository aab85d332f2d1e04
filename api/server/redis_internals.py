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
