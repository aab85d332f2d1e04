"""One cell as a gateway process sees it: a broker, the connections and scripts it is
reached by, whether it answers, and what this process counts of its traffic.

A deployment has one cell or several (`Settings.cells`), each a whole keyspace on its own
broker with its own replicas. The gateway (api/gateway.py) holds one `Cell` per broker,
one reply listener and one health loop each, and one map of waiting requests for all.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import redis

from control.broker.registry import FleetView
from control.broker.scripts import Admit, Cancel, Rescue, Supersede, SweepDead
from control.core.connect import client_like
from control.policy import admission


class BrokerHealth:
    """Is the broker answering? It is down once a call failed or exceeded its bound and
    nothing has answered for `down_after_ms` (new requests then get 503 without trying;
    until then each finds out by its own bounded call, so a 503 still comes within the
    bound); every answer (an admission, a reply, the health loop's probe) marks it up.
    A process starved of CPU for a moment misses bounds with a healthy broker: that is
    not an outage while calls keep being answered."""

    def __init__(self, down_after_ms: float = 250.0) -> None:
        self.down_after_s = down_after_ms / 1000.0
        self._last_ok = time.monotonic()
        self._last_failure = 0.0

    def ok(self) -> None:
        self._last_ok = time.monotonic()

    def failed(self, exc: BaseException | None = None) -> None:
        """A call failed; a refused connection (no broker process there) is down at once."""
        now = time.monotonic()
        self._last_failure = now
        if exc is not None and isinstance(exc.__context__, ConnectionRefusedError):
            self._last_ok = min(self._last_ok, now - self.down_after_s)

    @property
    def silent_s(self) -> float:
        """How long nothing has answered, if a call failed since (0 when healthy)."""
        if self._last_failure <= self._last_ok:
            return 0.0
        return time.monotonic() - self._last_ok

    @property
    def is_down(self) -> bool:
        return self.silent_s >= self.down_after_s


class Cell:
    """One broker and what this gateway process keeps of it."""

    def __init__(self, index: int, client: redis.Redis, broker_timeout_ms: float, phased: bool = False) -> None:
        self.index = index
        self.redis = client
        # The registry is read in the background, on its own connection and with room to
        # answer: a read timed out on the request path's bound left a new process with an
        # empty view of the fleet, which answered its first requests 503 `no_replica`.
        # With `phased`, the replicas' launches too (ADMIT_PHASED).
        fleet_client = client_like(client, socket_timeout=1.0, socket_connect_timeout=0.5)
        self.fleet = FleetView(fleet_client, cell=index, phased=phased)
        self.health = BrokerHealth()
        self.wake = threading.Event()  # set: the health loop probes now, not at its next round
        self.admit = Admit(client)
        self.cancel = Cancel(client)
        self.supersede = Supersede(client)
        # Blocking reads and background probes get their own connections and bounds.
        bound_s = broker_timeout_ms / 1000.0
        self.listener = client_like(client, socket_timeout=3.0, socket_connect_timeout=1.0)
        self.prober = client_like(client, socket_timeout=bound_s, socket_connect_timeout=bound_s)
        self.sweep = SweepDead(self.prober)
        self.rescuer = client_like(client, socket_timeout=2.0, socket_connect_timeout=0.5)
        self.rescue = Rescue(self.rescuer)
        self.deaths: int | None = None  # replicas swept so far in this cell
        self.rescuing = False  # a RESCUE round is due: deaths counted meanwhile ride it
        self.epoch = ""  # its keyspace's, as the last sweep named it (control/broker/scripts.py)
        # Admissions not yet in the broker's traffic counters (traffic.arrival_field -> how
        # many): added every 100 ms with the sweep, not one command per request.
        self.arrivals: Counter[str] = Counter()
        self.arrivals_lock = threading.Lock()
        self.depth: dict[str, tuple[admission.Depths, float]] = {}  # model -> waiting, when seen
        # Paid requests per model that this process sent to this cell; and all it asked
        # the cell to admit, where admission counts the replicas' phases below capacity.
        self.paid_rate: dict[str, admission.RateMeter] = {}
        self.demand: dict[str, admission.RateMeter] = {}
        # ADMIT_OPEN: each model's gate, worked out from every gateway's requests asked of
        # this cell per second, read every `OPEN_REFRESH_MS` with the sweep (each gate keeps
        # when it was worked out); and when a read was last tried (time.monotonic()).
        self.open_gates: dict[str, admission.OpenGate] = {}
        self.asked_tried = 0.0
