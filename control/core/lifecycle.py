"""A replica's life cycle: its states and the one table of moves between them.

Policy layer: no Celery, Redis or torch. The replica asks `transition` before it
changes state, the operator API asks it before it sends a command, and the registry
(`control/broker/registry.py`) parses the state a replica publishes with `parse`.

    starting -> serving -> draining -> drained -> moving -> serving
                              |           |
                              +-> serving +-> serving (resume)
    any live state -> stopping -> stopped; serving or draining -> stalled (the
    replica exits to be restarted)

Finished states come last, so `is_finished` is one comparison.
"""

from __future__ import annotations

from enum import IntEnum


class ReplicaState(IntEnum):
    STARTING = 0
    SERVING = 1  # takes work from its model's queue (ready, unless `why_not_ready` says otherwise)
    DRAINING = 2  # takes no new work; finishes what it holds
    DRAINED = 3  # holds nothing, takes nothing
    MOVING = 4  # loading another model and switching queues
    STOPPING = 5
    STALLED = 6  # its engine hung: it exits and is restarted
    STOPPED = 7

    @property
    def label(self) -> str:
        """As published in the registry and shown by `keybatch fleet`."""
        return self.name.lower()

    @property
    def is_finished(self) -> bool:
        return self >= ReplicaState.STOPPING

    @property
    def takes_work(self) -> bool:
        return self == ReplicaState.SERVING


S = ReplicaState
TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    S.STARTING: frozenset({S.SERVING, S.STOPPING}),
    S.SERVING: frozenset({S.DRAINING, S.STOPPING, S.STALLED}),
    S.DRAINING: frozenset({S.DRAINED, S.SERVING, S.STOPPING, S.STALLED}),
    S.DRAINED: frozenset({S.SERVING, S.MOVING, S.DRAINING, S.STOPPING}),  # draining: a late message arrived
    S.MOVING: frozenset({S.SERVING, S.DRAINED, S.STOPPING}),  # drained: the other model failed to load
    S.STOPPING: frozenset({S.STOPPED}),
    S.STALLED: frozenset(),
    S.STOPPED: frozenset(),
}


class IllegalTransition(ValueError):
    def __init__(self, current: ReplicaState, wanted: ReplicaState) -> None:
        allowed = ", ".join(s.label for s in sorted(TRANSITIONS[current])) or "nothing"
        super().__init__(f"a {current.label} replica cannot become {wanted.label} (allowed: {allowed})")
        self.current = current
        self.wanted = wanted


def can_transition(current: ReplicaState, wanted: ReplicaState) -> bool:
    return wanted in TRANSITIONS[current]


def transition(current: ReplicaState, wanted: ReplicaState) -> ReplicaState:
    """`wanted`, if a replica in `current` may move to it; else IllegalTransition."""
    if not can_transition(current, wanted):
        raise IllegalTransition(current, wanted)
    return wanted


# What replicas before this table published; a fleet upgraded one replica at a time
# keeps serving (a not-ready one also publishes `why_not_ready`, which keeps it unready).
_EARLIER = {"ready": ReplicaState.SERVING, "not_ready": ReplicaState.SERVING}


def parse(label: str) -> ReplicaState | None:
    """A published state; None for one this version does not know (a newer replica)."""
    try:
        return ReplicaState[label.upper()]
    except KeyError:
        return _EARLIER.get(label)
