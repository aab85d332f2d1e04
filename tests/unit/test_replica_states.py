"""The replica life cycle: one table of allowed moves, illegal ones refused."""

from __future__ import annotations

import pytest

from control.core.lifecycle import TRANSITIONS, IllegalTransition, ReplicaState, can_transition, parse, transition

S = ReplicaState


@pytest.mark.parametrize(
    "path",
    [
        [S.STARTING, S.SERVING, S.DRAINING, S.DRAINED, S.MOVING, S.SERVING],  # a move
        [S.SERVING, S.DRAINING, S.SERVING],  # a drain called off
        [S.SERVING, S.DRAINING, S.DRAINED, S.SERVING],  # resumed
        [S.SERVING, S.DRAINING, S.DRAINED, S.STOPPING, S.STOPPED],  # drained for maintenance
        [S.DRAINED, S.MOVING, S.DRAINED],  # the other model failed to load
    ],
)
def test_the_operator_paths_are_allowed(path: list[ReplicaState]) -> None:
    state = path[0]
    for wanted in path[1:]:
        state = transition(state, wanted)
    assert state == path[-1]


@pytest.mark.parametrize(
    ("current", "wanted"),
    [
        (S.SERVING, S.MOVING),  # a move drains first
        (S.SERVING, S.DRAINED),  # drained only after draining
        (S.STARTING, S.DRAINING),
        (S.MOVING, S.DRAINING),
        (S.STOPPING, S.SERVING),
        (S.STOPPED, S.SERVING),
        (S.STALLED, S.SERVING),
        (S.SERVING, S.SERVING),
    ],
)
def test_illegal_moves_are_refused_with_what_is_allowed(current: ReplicaState, wanted: ReplicaState) -> None:
    assert not can_transition(current, wanted)
    with pytest.raises(IllegalTransition, match=f"a {current.label} replica cannot become {wanted.label}"):
        transition(current, wanted)


def test_finished_states_come_last_and_only_serving_takes_work() -> None:
    assert [s for s in S if s.is_finished] == [S.STOPPING, S.STALLED, S.STOPPED]
    assert [s for s in S if s.takes_work] == [S.SERVING]
    assert all(not TRANSITIONS[s] or s == S.STOPPING for s in S if s.is_finished)
    assert all(s in TRANSITIONS for s in S)


def test_published_labels_parse_back() -> None:
    assert all(parse(s.label) == s for s in S)
    assert parse("ready") == S.SERVING  # what replicas published before the table
    assert parse("sleeping") is None  # a newer replica's word: not taken for serving
