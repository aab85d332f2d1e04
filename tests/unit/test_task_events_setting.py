"""The task-events setting: watched by default, and the old switch's true and false still
read as always and off."""

from __future__ import annotations

import pytest

from control.core.settings import Settings


@pytest.mark.parametrize(
    ("given", "read"),
    [
        ("watched", "watched"),
        ("always", "always"),
        ("off", "off"),
        ("true", "always"),
        ("False", "off"),
        ("1", "always"),
    ],
)
def test_task_events_read_the_old_switch_as_always_or_off(given: str, read: str) -> None:
    assert Settings(task_events=given).task_events == read


def test_task_events_default_to_watched_and_refuse_other_words() -> None:
    assert Settings().task_events == "watched"
    with pytest.raises(ValueError):
        Settings(task_events="sometimes")
