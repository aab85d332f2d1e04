"""Which connections a gateway process holds, and which one gives way to a new one.

Pure bookkeeping (no sockets, no gevent): `control/serve.py` asks it on each accept
and tells it when a connection starts or ends a request. docs/decisions/0017.

- A new connection takes a slot of the general pool; so does every connection until
  a request of it is known to be paid (its header block is in, its key is paid).
  Such a connection moves to the paid reserve while the reserve has room, which
  frees its general slot: paid traffic keeps a share however the pool is taken.
- When the pool is full, a new connection takes the slot of the connection that
  has waited longest with no request in progress (before its first byte, in its
  header block, or kept alive between requests): it is shed, the new one stays.
  With none waiting (every slot serves a request) the new one is refused.
- One address holds at most `per_address` connections of the process (unless it
  is exempt, a front proxy); beyond, the same rule within that address's own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False)
class Conn:
    address: str
    shed: Callable[[], None] = field(repr=False)  # closes it; called at most once
    paid: bool = False  # in the paid reserve
    waiting: bool = True  # no request in progress
    open: bool = True


class ConnectionTable:
    def __init__(self, general: int, reserve: int, per_address: int = 0, exempt: frozenset[str] = frozenset()) -> None:
        self.general = general
        self.reserve = reserve
        self.per_address = per_address  # 0: no cap
        self.exempt = exempt
        self.used = {False: 0, True: 0}  # slots taken: general (False), reserve (True)
        # Waiting connections, longest waiting first (dicts keep insertion order).
        self._waiting: dict[bool, OrderedDict[Conn, None]] = {False: OrderedDict(), True: OrderedDict()}
        self._by_address: dict[str, OrderedDict[Conn, None]] = {}  # all of an address's, waiting ones in order
        self.shed_count = 0
        self.refused_count = 0

    def admit(self, address: str, shed: Callable[[], None]) -> Conn | None:
        """A slot for a new connection, or None: refuse it."""
        if self.per_address and address not in self.exempt:
            own = self._by_address.get(address)
            if own is not None and len(own) >= self.per_address:
                victim = next((c for c in own if c.waiting), None)
                if victim is None:
                    self.refused_count += 1
                    return None
                self._shed(victim)
        if self.used[False] >= self.general:
            victim = next(iter(self._waiting[False]), None)
            if victim is None:
                self.refused_count += 1
                return None
            self._shed(victim)
        conn = Conn(address, shed)
        self.used[False] += 1
        self._waiting[False][conn] = None
        self._by_address.setdefault(address, OrderedDict())[conn] = None
        return conn

    def busy(self, conn: Conn, paid: bool) -> None:
        """A request of `conn` has its header block in; `paid`: its key is paid."""
        if not conn.open:
            return
        self._waiting[conn.paid].pop(conn, None)
        conn.waiting = False
        if paid and not conn.paid and self._reserve_room():
            self.used[False] -= 1
            self.used[True] += 1
            conn.paid = True

    def waiting(self, conn: Conn) -> None:
        """`conn` finished a request and waits for the next: it now waited least."""
        if not conn.open:
            return
        conn.waiting = True
        self._waiting[conn.paid][conn] = None
        own = self._by_address[conn.address]
        own.move_to_end(conn)

    def release(self, conn: Conn) -> None:
        """`conn` closed (idempotent: a shed connection was released when shed)."""
        if not conn.open:
            return
        conn.open = False
        self.used[conn.paid] -= 1
        self._waiting[conn.paid].pop(conn, None)
        own = self._by_address[conn.address]
        del own[conn]
        if not own:
            del self._by_address[conn.address]

    def _reserve_room(self) -> bool:
        if self.used[True] < self.reserve:
            return True
        victim = next(iter(self._waiting[True]), None)
        if victim is None:
            return False
        self._shed(victim)
        return True

    def _shed(self, conn: Conn) -> None:
        self.release(conn)
        self.shed_count += 1
        conn.shed()
