"""Which connections a gateway process holds, and which one gives way to a new one.

Pure bookkeeping (no sockets, no gevent): `api/server/serve.py` asks it on each accept
and tells it when a connection starts or ends a request. docs/decisions/0017.

- A new connection takes a slot of the general pool; so does every connection until
  a request of it is known to be paid (its header block is in, its key is paid).
  Such a connection moves to the paid reserve while the reserve has room, which
  frees its general slot: paid traffic keeps a share however the pool is taken.
- When the pool is full, a new connection takes the slot of the connection that
  has waited longest with no request in progress (before its first byte, in its
  header block, or kept alive between requests): it is shed, the new one stays.
  One whose next request has reached the socket but not the handler yet is not
  waiting for anything: it is passed over (the first `SHED_SCAN` are looked at), so
  a client never sees its sent request's connection closed without an answer.
- With none waiting (every general slot serves a request), the new connection
  may wait in the reserve on trial: its first request must be paid, or it is
  refused (with the general pool still full). Its slot is a free one of the
  reserve, else that of the longest waiting on trial, else that of the longest
  waiting paid one. With every reserve slot serving a request, refused.
- One address holds at most `per_address` connections of the process (unless it
  is exempt, a front proxy); beyond, the same rule within that address's own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Literal

Pool = Literal["general", "reserve", "trial"]  # trial: reserve slots held by connections not yet known paid
SHED_SCAN = 8  # waiting connections looked at for one to shed, longest waiting first


@dataclass(eq=False)
class Conn:
    address: str
    shed: Callable[[], None] = field(repr=False)  # closes it; called at most once
    has_input: Callable[[], bool] = field(default=lambda: False, repr=False)  # bytes unread by its handler
    pool: Pool = "general"
    waiting: bool = True  # no request in progress
    open: bool = True


class ConnectionTable:
    def __init__(self, general: int, reserve: int, per_address: int = 0, exempt: frozenset[str] = frozenset()) -> None:
        self.general = general
        self.reserve = reserve
        self.per_address = per_address  # 0: no cap
        self.exempt = exempt
        self.used: dict[Pool, int] = {"general": 0, "reserve": 0, "trial": 0}
        # Waiting connections of each pool, longest waiting first (dicts keep insertion order).
        self._waiting: dict[Pool, OrderedDict[Conn, None]] = {p: OrderedDict() for p in self.used}
        self._by_address: dict[str, OrderedDict[Conn, None]] = {}  # all of an address's, waiting ones in order
        self.shed_count = 0
        self.refused_count = 0

    def admit(
        self, address: str, shed: Callable[[], None], has_input: Callable[[], bool] = lambda: False
    ) -> Conn | None:
        """A slot for a new connection, or None: refuse it."""
        if self.per_address and address not in self.exempt:
            own = self._by_address.get(address)
            if own is not None and len(own) >= self.per_address:
                victim = _idle(c for c in own if c.waiting)
                if victim is None:
                    self.refused_count += 1
                    return None
                self._shed(victim)
        pool = self._room_for_new()
        if pool is None:
            self.refused_count += 1
            return None
        conn = Conn(address, shed, has_input, pool)
        self.used[pool] += 1
        self._waiting[pool][conn] = None
        self._by_address.setdefault(address, OrderedDict())[conn] = None
        return conn

    def busy(self, conn: Conn, paid: bool) -> bool:
        """A request of `conn` has its header block in; `paid`: its key is paid.
        False: the connection is on trial, its request is not paid and there is still
        no general slot: refuse the request."""
        if not conn.open:
            return True
        self._waiting[conn.pool].pop(conn, None)
        conn.waiting = False
        if conn.pool == "trial":
            if paid:
                self._move(conn, "reserve")
            elif self.used["general"] < self.general:
                self._move(conn, "general")
            else:
                return False
        elif paid and conn.pool == "general" and self._reserve_free():
            self._move(conn, "reserve")
        return True

    def waiting(self, conn: Conn) -> None:
        """`conn` finished a request and waits for the next: it now waited least."""
        if not conn.open:
            return
        conn.waiting = True
        self._waiting[conn.pool][conn] = None
        self._by_address[conn.address].move_to_end(conn)

    def release(self, conn: Conn) -> None:
        """`conn` closed (idempotent: a shed connection was released when shed)."""
        if not conn.open:
            return
        conn.open = False
        self.used[conn.pool] -= 1
        self._waiting[conn.pool].pop(conn, None)
        own = self._by_address[conn.address]
        del own[conn]
        if not own:
            del self._by_address[conn.address]

    def _room_for_new(self) -> Pool | None:
        if self.used["general"] < self.general:
            return "general"
        if (victim := _idle(iter(self._waiting["general"]))) is not None:
            self._shed(victim)
            return "general"
        return "trial" if self._reserve_room() else None

    def _reserve_free(self) -> bool:
        return self.used["reserve"] + self.used["trial"] < self.reserve

    def _reserve_room(self) -> bool:
        """A reserve slot for a connection on trial: free, or made free by shedding
        the longest waiting on trial, else the longest waiting paid one."""
        if self._reserve_free():
            return True
        for pool in ("trial", "reserve"):
            victim = _idle(iter(self._waiting[pool]))
            if victim is not None:
                self._shed(victim)
                return True
        return False

    def _move(self, conn: Conn, pool: Pool) -> None:
        self.used[conn.pool] -= 1
        self.used[pool] += 1
        conn.pool = pool

    def _shed(self, conn: Conn) -> None:
        self.release(conn)
        self.shed_count += 1
        conn.shed()


def _idle(candidates: Iterator[Conn]) -> Conn | None:
    """The first of the longest-waiting candidates that has no request on its way in."""
    for conn in islice(candidates, SHED_SCAN):
        if not conn.has_input():
            return conn
    return None
