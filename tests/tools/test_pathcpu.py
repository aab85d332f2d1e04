"""`keybatch bench path-cpu`: what it runs for "this" side, and its arithmetic."""

from __future__ import annotations

import pytest

from control.bench.path_cpu import THIS_CHECKOUT, changed_calls, per_request_ms, ratios, side_medians
from control.cli.main import _parser


def test_this_side_runs_the_checkout_the_bench_is_in() -> None:
    # The checkout's root: its `control` package runs under PYTHONPATH, not the editable install's.
    assert (THIS_CHECKOUT / "control" / "__init__.py").is_file()
    assert (THIS_CHECKOUT / "control" / "bench" / "path_cpu.py").is_file()


def test_cpu_per_request_by_kind_and_total() -> None:
    before = {"gateway": 10.0, "replica": 5.0, "broker": 1.0}
    after = {"gateway": 10.5, "replica": 5.3, "broker": 1.1}
    figures = per_request_ms(before, after, answered=500)
    assert figures == pytest.approx({"gateway": 1.0, "replica": 0.6, "broker": 0.2, "total": 1.8})
    assert per_request_ms(before, before, answered=0)["total"] == 0.0


def test_medians_per_kind_and_ratios() -> None:
    def run(gateway: float, replica: float, broker: float) -> dict:
        return {"cpu_ms_per_request": {"gateway": gateway, "replica": replica, "broker": broker,
                                       "total": gateway + replica + broker}}  # fmt: skip

    this = side_medians([run(1.0, 1.0, 0.2), run(3.0, 0.5, 0.4), run(2.0, 2.0, 0.3)])
    # The total is the median of the runs' totals (2.2, 3.9, 4.3), not the sum of the medians.
    assert this == pytest.approx({"gateway": 2.0, "replica": 1.0, "broker": 0.3, "total": 3.9})
    other = {"gateway": 4.0, "replica": 1.0, "broker": 0.0, "total": 5.2}
    ratio = ratios(this, other)
    assert ratio.pop("broker") is None
    assert ratio == pytest.approx({"gateway": 0.5, "replica": 1.0, "total": 0.75})


@pytest.mark.parametrize("name", ["path-cpu", "gateway-cpu"])
def test_both_names_parse(name: str) -> None:
    args = _parser().parse_args(["bench", name, "--checkout", "elsewhere", "--rounds", "1"])
    assert (args.checkout, args.rounds, args.rate) == ("elsewhere", 1, 300.0)


def test_the_calls_that_changed_most_come_first() -> None:
    other = {"email/message.py:get": 9.0, "gevent/hub.py:sleep": 2.0, "api/app.py:create_app": 0.0}
    this = {"server/headers.py:get": 9.0, "gevent/hub.py:sleep": 0.0, "api/app.py:create_app": 0.0}
    changed = changed_calls(this, other, top=3)
    assert {name for name, _other, _this in changed[:2]} == {"email/message.py:get", "server/headers.py:get"}
    assert changed[2] == ("gevent/hub.py:sleep", 2.0, 0.0)
