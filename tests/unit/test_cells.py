"""Which cell carries a request: its own while every cell answers, the same from every
process, and a lost cell's requests spread over the others."""

from __future__ import annotations

from collections import Counter

import pytest

from control.core.settings import Settings
from control.policy.cells import cell_order, home_cell


def test_one_cell_takes_everything() -> None:
    assert cell_order("t:r:1", 1) == [0]


def test_the_order_is_every_cell_once_and_the_same_on_every_call() -> None:
    for i in range(200):
        order = cell_order(f"t:r:{i}", 5)
        assert sorted(order) == list(range(5))
        assert cell_order(f"t:r:{i}", 5) == order
        assert home_cell(f"t:r:{i}", 5) == order[0]


def test_routes_spread_evenly_and_a_lost_cell_spreads_over_the_rest() -> None:
    homes = Counter(cell_order(f"t:r:{i}", 3)[0] for i in range(9000))
    assert all(2700 <= n <= 3300 for n in homes.values()), homes
    # Cell 0 lost: its routes' next cells are the two others, about half each (a neighbour
    # taking them all would double its load).
    seconds = Counter(order[1] for i in range(9000) if (order := cell_order(f"t:r:{i}", 3))[0] == 0)
    assert set(seconds) == {1, 2} and min(seconds.values()) > 0.4 * sum(seconds.values()), seconds


def test_a_cell_added_moves_only_the_routes_it_takes() -> None:
    routes = [f"t:s:{i}" for i in range(6000)]
    moved = [r for r in routes if home_cell(r, 3) != home_cell(r, 4)]
    assert all(home_cell(r, 4) == 3 for r in moved)  # only to the new cell
    assert 0.2 < len(moved) / len(routes) < 0.3  # about a quarter


def test_cells_is_a_json_list_of_distinct_broker_urls() -> None:
    settings = Settings(cells=["redis://a:1/0", "redis://b:2/0"])
    assert settings.cell_urls == ["redis://a:1/0", "redis://b:2/0"]
    assert settings.broker == "redis://a:1/0"  # without REDIS_URL, the first cell's
    with pytest.raises(ValueError, match="appears twice"):
        Settings(cells=["redis://a:1/0", "redis://a:1/0"])
    with pytest.raises(ValueError):
        Settings(cells=["http://a:1"])
    assert Settings(redis_url="redis://c:3/0").cell_urls == ["redis://c:3/0"]
