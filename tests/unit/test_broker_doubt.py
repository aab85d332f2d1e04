"""A replica that doubts its broker: the engine's calls between steps leave it alone for a
window that doubles while it keeps failing, and come back at once once it answers."""

from __future__ import annotations

from tasks.replica.lease import BrokerDoubt


def test_each_failure_doubles_the_window_up_to_the_most_and_an_answer_ends_it() -> None:
    doubt = BrokerDoubt(first_ms=200.0, most_ms=1000.0)
    assert not doubt.skips() and not doubt.failed_within(10_000)
    windows = []
    for _ in range(5):
        doubt.failed()
        windows.append(doubt.until_ms - doubt.failed_ms)
    assert windows == [200.0, 400.0, 800.0, 1000.0, 1000.0]
    assert doubt.is_sure()
    assert doubt.skips() and doubt.failed_within(1000)
    doubt.answered()
    assert not doubt.skips()
    doubt.failed()
    assert doubt.until_ms - doubt.failed_ms == 200.0  # a new outage starts from the first window
    assert doubt.skips() and not doubt.is_sure()  # one failure: lease renewals go on
