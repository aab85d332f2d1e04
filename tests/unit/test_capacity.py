"""`keybatch capacity`: the statement's arithmetic, the search, and the command's edges."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from control.cli.main import main
from control.sim.capacity import Inputs, arithmetic, parse_models, plan
from control.sim.cost import CostModel

ROOT = Path(__file__).resolve().parents[2]


def test_the_statements_arithmetic() -> None:
    a = arithmetic(Inputs(rps=40_000, max_batch=64, batch_ms=250, headroom=0.2, regions=3, models={"m": 1.0}))
    assert a["replica_rps_full"] == 256.0
    assert a["replica_rps_half"] == 128.0
    assert a["replicas_exact"] == 156.25
    assert a["replicas_min"] == 157
    assert a["replicas_with_headroom"] == 196  # 40,000 / (0.8 x 256) = 195.3
    assert a["per_region_one_lost"] == 98  # 20,000 / 204.8 = 97.7
    assert a["replicas_arithmetic"] == 294


def test_broker_cells_hold_a_region_lost_and_one_cell_lost_within_the_planned_core() -> None:
    cells = arithmetic(Inputs(rps=40_000, regions=3))["broker_cells"]
    # 12,500 req/s a core at half a core: 6,250 a cell; 20,000 a surviving region needs 4,
    # and one more so that a cell lost too leaves 5,000 each (40% of a core).
    assert cells["cells_per_region"] == 5
    assert cells["cell_rps_one_region_lost"] == 4000.0
    assert cells["cell_rps_one_region_and_one_cell_lost"] == 5000.0
    assert cells["core_share_one_region_and_one_cell_lost"] == 0.4
    slower = arithmetic(Inputs(rps=40_000, regions=3, broker_core_rps=4150))["broker_cells"]
    assert slower["cells_per_region"] == 11
    assert slower["core_share_one_region_and_one_cell_lost"] <= 0.5
    assert arithmetic(Inputs(rps=100, regions=3))["broker_cells"]["cells_per_region"] == 2  # a spare even when small


def test_search_finds_a_count_that_meets_the_slo_with_a_region_lost() -> None:
    inputs = Inputs(rps=2_000, regions=3, models={"m": 1.0}, sim_seconds=6, search_seconds=6)
    out = plan(inputs)
    assert out["met"]
    per_region = out["replicas_per_region"]
    assert per_region >= 4  # 1,000 req/s per surviving region / 256 = 3.9
    assert out["p99_ms"] <= 600.0
    fewer = [t for t in out["search"]["m"] if t["replicas"] < per_region]
    assert all(t["p99_ms"] is None or t["p99_ms"] > 600 or t["answered_200_share"] < 0.999 for t in fewer)


def test_spare_hosts_add_to_the_count_the_search_found() -> None:
    inputs = Inputs(rps=2_000, regions=3, models={"m": 1.0}, sim_seconds=6, search_seconds=6)
    found = plan(inputs)
    spared = plan(replace(inputs, spare_hosts=1, host_size=2))
    assert found["spare_per_region"] == 0 and spared["spare_per_region"] == 2
    assert spared["searched_per_region_by_model"] == found["replicas_per_region_by_model"]
    assert spared["replicas_per_region"] == found["replicas_per_region"] + 2
    assert spared["replicas"] == 3 * spared["replicas_per_region"]
    with pytest.raises(ValueError):
        Inputs(rps=2_000, spare_hosts=-1)


def test_a_host_lost_at_the_recommended_count_costs_fewer_answers_with_hedging() -> None:
    from control.sim.capacity import host_loss

    inputs = Inputs(rps=6_000, regions=3, models={"m": 1.0}, sim_seconds=10, host_size=2)
    loss = host_loss(inputs, ["m"], [16], 2_000.0, "every region up")  # half the capacity used
    assert loss["host"] == "2 replicas of m" and loss["lost_at_s"] == 5.0
    assert loss["off"]["not_200"] > loss["all"]["not_200"], loss
    assert loss["off"]["hedged"] == 0 < loss["all"]["hedge_wins"] <= loss["all"]["hedged"]


def test_the_engine_curve_makes_a_batch_cost_its_longest_output() -> None:
    cost = CostModel.from_file(ROOT / "docs/bench/engine-small.json")
    short = cost.batch_ms([300] * 64, [4] * 64)
    long = cost.batch_ms([300] * 64, [128] * 63 + [4])
    assert long > short + 100 * cost.step_ms(64, 400) * 0.9
    assert cost.step_ms(64, 128) >= cost.step_ms(16, 128) >= cost.step_ms(1, 128)


def test_bad_input_is_refused_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError):
        parse_models("kb-small=lots")
    assert main(["capacity", "--models", "kb-small=lots"]) == 2
    assert main(["capacity", "--cost-model", "/nonexistent.json"]) == 2
    assert main(["capacity", "--headroom", "1.5"]) == 2
    assert "keybatch capacity:" in capsys.readouterr().err


def test_json_has_the_figures(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "capacity",
        "--rps",
        "1500",
        "--models",
        "kb-small",
        "--sim-seconds",
        "4",
        "--search-seconds",
        "4",
        "--json",
    ]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("replica_rps_full", "replica_rps_half", "replicas_min", "replicas", "p50_ms", "p99_ms"):
        assert key in out
    assert out["replica_rps_full"] == 256.0
    assert set(out["simulated"]["per_tier"]) == {"paid", "free"}


def test_fleet_scope_loses_a_region_and_draws_the_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    plot = tmp_path / "p99.png"
    args = ["capacity", "--rps", "1500", "--models", "kb-small", "--sim-seconds", "6", "--search-seconds", "3"]
    assert main([*args, "--scope", "fleet", "--json", "--plot", str(plot)]) == 0
    out = json.loads(capsys.readouterr().out)
    regions = out["simulated"]["per_region"]
    assert regions["resent"]["requests"] > 0  # what region 0 held went to the others
    assert regions["0"]["requests"] < regions["1"]["requests"]  # nothing new reached it after the loss
    assert regions["after_the_loss"]["answered_200_share"] >= 0.97  # the resent ones had spent part of their budget
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert [p["load"] for p in out["load_curve"]["kb-small"]][:2] == [0.5, 0.7]


def test_paid_and_free_by_load_in_a_regions_queue() -> None:
    from control.sim.capacity import tier_curve

    inputs = Inputs(rps=6_000, regions=3, models={"m": 1.0}, paid_fraction=0.3, search_seconds=10)
    low, high = tier_curve(inputs, "m", 2, [0.5, 2.0])  # 2 x 64 per 250 ms: 512 req/s
    assert (low["rps"], high["rps"]) == (256.0, 1024.0)
    assert low["free"]["answered_200_share"] == 1.0 and high["free"]["answered_200_share"] < 0.5
    assert high["paid"]["answered_200_share"] >= 0.99  # 60% of capacity: all of it fits
    assert high["paid"]["p99_ms"] < high["free"]["p99_ms"]
    assert main(["capacity", "--tiers-by-load", "0.5,x"]) == 2
    assert main(["capacity", "--tiers-by-load", "-1"]) == 2
