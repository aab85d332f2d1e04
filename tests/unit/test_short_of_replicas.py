"""A model is short of replicas while fewer are ready than within the last 30 s: its region
then sends what it must refuse for want of room to a peer (`api/peers.py`)."""

from __future__ import annotations

from control.broker.registry import SHORT_WINDOW_S, track_peaks


def test_a_drop_is_short_until_the_count_is_back() -> None:
    peaks = track_peaks({}, {"a": 2}, 0.0)
    peaks = track_peaks(peaks, {"a": 0}, 1.0)  # the region's broker and replicas killed
    assert peaks["a"] == (2, 0.0)
    peaks = track_peaks(peaks, {"a": 1}, 1.2)  # a standby took one place
    assert peaks["a"][0] == 2
    peaks = track_peaks(peaks, {"a": 2}, 2.0)  # the other booted
    assert peaks["a"] == (2, 2.0)


def test_a_lower_count_becomes_the_peak_once_the_old_one_is_a_window_old() -> None:
    peaks = track_peaks({}, {"a": 4}, 0.0)
    peaks = track_peaks(peaks, {"a": 3}, SHORT_WINDOW_S)
    assert peaks["a"] == (4, 0.0)  # still short, at the window's edge
    peaks = track_peaks(peaks, {"a": 3}, SHORT_WINDOW_S + 0.25)
    assert peaks["a"] == (3, SHORT_WINDOW_S + 0.25)


def test_a_model_gone_from_the_registry_counts_zero_and_a_new_one_starts_at_its_count() -> None:
    peaks = track_peaks({}, {"a": 2}, 0.0)
    peaks = track_peaks(peaks, {"b": 1}, 0.5)
    assert peaks == {"a": (2, 0.0), "b": (1, 0.5)}
