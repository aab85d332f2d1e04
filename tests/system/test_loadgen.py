"""The load client: its arrival processes and model mixes (pure, seeded), and one short run
against a real deployment of two models with typing sessions."""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest

from control.cli.main import main
from control.load.generator import completions_path
from control.load.printing import plot
from control.load.schedule import mix_at, schedule
from control.load.spec import LoadSpec, Record, parse_mix
from control.load.summary import report, under_slo_from
from control.load.workloads import typing_sessions
from control.sim.workload import make_workload
from tests.support.deploy import FREE_KEY, PAID_KEY, deployment

PNG = b"\x89PNG\r\n\x1a\n"


def spec(**fields: object) -> LoadSpec:
    base: dict = {"url": "http://127.0.0.1:1", "rps": 100.0, "duration_s": 100.0}
    return LoadSpec(**{**base, **fields})


def rate_in(times: list[float], start: float, end: float) -> float:
    return sum(start <= t < end for t in times) / (end - start)


def test_poisson_has_the_mean_rate_and_the_seed_fixes_the_schedule() -> None:
    arrivals = schedule(spec(rps=200.0, paid_share=0.3))
    assert len(arrivals) == pytest.approx(20_000, rel=0.03)
    assert sum(a.tier == "paid" for a in arrivals) / len(arrivals) == pytest.approx(0.3, abs=0.02)
    assert [a.at_s for a in arrivals] == sorted(a.at_s for a in arrivals)
    assert schedule(spec(rps=200.0, paid_share=0.3)) == arrivals
    assert schedule(spec(rps=200.0, paid_share=0.3, seed=2)) != arrivals


def test_bursts_are_three_times_the_rate_for_two_seconds_of_every_twenty() -> None:
    times = [a.at_s for a in schedule(spec(arrivals="bursts", rps=100.0, duration_s=200.0))]
    in_burst = [t for t in times if t % 20 >= 18]
    assert len(in_burst) / 20.0 == pytest.approx(300.0, rel=0.05)  # 10 bursts of 2 s
    assert (len(times) - len(in_burst)) / 180.0 == pytest.approx(100.0, rel=0.05)
    assert len(times) == pytest.approx(100 * 180 + 300 * 20, rel=0.03)


def test_diurnal_runs_from_night_to_the_peak_mid_run_and_back() -> None:
    times = [a.at_s for a in schedule(spec(arrivals="diurnal", rps=200.0, duration_s=100.0))]
    assert rate_in(times, 0, 4) == pytest.approx(200 * 0.2, rel=0.15)  # night: 20% of the peak
    assert rate_in(times, 48, 52) == pytest.approx(200.0, rel=0.1)  # the peak mid-run
    assert rate_in(times, 96, 100) == pytest.approx(200 * 0.2, rel=0.15)
    assert len(times) == pytest.approx(200 * 100 * 0.6, rel=0.03)  # mean of 0.2 + 0.8 (1 - cos) / 2


def test_typing_sessions_are_the_simulators_and_each_keeps_its_tier_and_model() -> None:
    for seed in (0, 3):
        w = make_workload(40.0, 30.0, profile="typing", seed=seed)
        s = typing_sessions(np.random.default_rng(seed), 40.0, 30.0)
        assert np.array_equal(w.t_ms, s.t_ms) and np.array_equal(w.prev, s.prev)

    arrivals = schedule(spec(arrivals="typing", rps=40.0, duration_s=60.0, paid_share=0.5, models={"a": 0.5, "b": 0.5}))
    assert len(arrivals) == pytest.approx(40 * 60, rel=0.1)
    sessions: dict[int, list] = defaultdict(list)
    for a in arrivals:
        sessions[a.session].append(a)
    assert len(sessions) == pytest.approx(40 * 60 / 6, rel=0.15)  # 6 keystrokes a session on average
    for requests in sessions.values():
        assert len({(a.tier, a.model) for a in requests}) == 1
        gaps = [b.at_s - a.at_s for a, b in zip(requests, requests[1:], strict=False)]
        assert all(gap >= 0.1 for gap in gaps)  # a pause is at least 100 ms
    assert Counter(a.tier for a in arrivals)["paid"] / len(arrivals) == pytest.approx(0.5, abs=0.1)


def test_the_mix_moves_linearly_from_one_to_the_other_during_the_shift() -> None:
    s = spec(models={"kb-small": 0.8, "kb-large": 0.2}, shift_to={"kb-small": 0.2, "kb-large": 0.8})
    s.shift_from_s, s.shift_over_s = 40.0, 20.0
    assert mix_at(s, 10.0) == {"kb-small": 0.8, "kb-large": 0.2}
    assert mix_at(s, 50.0) == pytest.approx({"kb-small": 0.5, "kb-large": 0.5})
    assert mix_at(s, 60.0) == pytest.approx({"kb-small": 0.2, "kb-large": 0.8})
    arrivals = schedule(s)
    before = [a.model for a in arrivals if a.at_s < 40]
    during = [a.model for a in arrivals if 45 <= a.at_s < 55]
    after = [a.model for a in arrivals if a.at_s >= 60]
    assert before.count("kb-large") / len(before) == pytest.approx(0.2, abs=0.03)
    assert during.count("kb-large") / len(during) == pytest.approx(0.5, abs=0.06)
    assert after.count("kb-large") / len(after) == pytest.approx(0.8, abs=0.03)
    # the mix is drawn apart: the arrivals and tiers are those of one model alone
    assert [a.at_s for a in arrivals] == [a.at_s for a in schedule(spec())]


def test_mixes_and_urls_are_read_or_refused_with_the_reason() -> None:
    assert parse_mix("kb-small=3,kb-large=1") == {"kb-small": 0.75, "kb-large": 0.25}
    for bad in ("kb-small", "kb-small=x", "kb-small=-1", "a=0,b=0", "a=1,a=2", "=1"):
        with pytest.raises(ValueError, match="mix"):
            parse_mix(bad)
    assert completions_path("http://h:8000") == "/v1/completions"
    assert completions_path("http://h:8000/v1/") == "/v1/completions"
    assert completions_path("http://h/proxy/v1") == "/proxy/v1/completions"
    with pytest.raises(ValueError, match="arrivals"):
        spec(arrivals="sine")


@pytest.mark.parametrize(
    "argv",
    [
        ["--url", "https://example.invalid"],
        ["--models", "kb-small"],
        ["--api-key", "k", "--profile", "paid"],
        ["--shift-from-s", "3"],
        ["--arrivals", "typing", "--keystrokes", "0"],
    ],
)
def test_bad_arguments_exit_2_with_the_reason(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["load", "--rps", "1", "--duration", "1", *argv]) == 2
    assert capsys.readouterr().err.startswith("keybatch load: ")


def record(sent_s: float, model: str, status: int = 200, latency_ms: float = 100.0, code: str = "") -> Record:
    return Record(sent_s, "free", status, latency_ms, model=model, code=code, answered_s=sent_s + latency_ms / 1000)


def test_windows_say_when_a_models_p99_came_back_under_the_slo(tmp_path: Path) -> None:
    records = [record(t / 10, "kb-large", latency_ms=900.0 if 5 <= t / 10 < 10 else 100.0) for t in range(200)]
    records += [record(t / 10, "kb-small") for t in range(200)]
    records += [record(3.0, "kb-small", 409, 5.0, "superseded"), record(4.0, "kb-small", 429, 2.0, "overloaded")]
    out = report(spec(duration_s=20.0), records, window_s=5.0, slo_ms=500.0)
    large = out["windows"]["by_model"]["kb-large"]
    assert [row["p99_ms"] for row in large] == [100.0, 900.0, 100.0, 100.0]
    assert out["slo"]["p99_under_slo_from_s"] == {"all": 10.0, "kb-large": 10.0, "kb-small": 0.0}
    assert under_slo_from(large[:2], 500.0) is None
    small = out["by_model"]["kb-small"]["all"]
    assert small["superseded"] == 1 and small["status_429"] == 1 and small["other"] == 0
    assert small["statuses"] == {"200": 200, "409 superseded": 1, "429": 1}
    assert small["ok_share"] == pytest.approx(200 / 201)  # the superseded one is not counted against it
    assert small["sent_rps"] == pytest.approx(202 / 20)
    path = tmp_path / "load.png"
    plot(out, str(path), "two models")
    assert path.read_bytes()[:8] == PNG


def test_typing_sessions_and_a_mix_shift_against_two_models(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "load.json", tmp_path / "load.png"
    with deployment(workers=2, models=("kb-small", "kb-large")) as d:
        code = main(
            [
                "load",
                "--url",
                d.url,
                "--rps",
                "30",
                "--duration",
                "4",
                "--arrivals",
                "typing",
                "--pause-ms",
                "50",
                "--models",
                "kb-small=0.8,kb-large=0.2",
                "--shift-to",
                "kb-small=0.2,kb-large=0.8",
                "--shift-from-s",
                "1",
                "--shift-over-s",
                "2",
                "--profile",
                "mixed",
                "--paid-key",
                PAID_KEY,
                "--free-key",
                FREE_KEY,
                "--deadline-ms",
                "2000",
                "--window-s",
                "1",
                "--slo-ms",
                "1000",
                "--json",
                str(out_json),
                "--plot",
                str(out_png),
            ]
        )
    assert code == 0
    out = json.loads(out_json.read_text())
    records = [Record(**r) for r in out["records"]]
    everything = out["summary"]["all"]
    assert everything["sent"] == len(records) > 40
    assert everything["superseded"] > 0 and everything["statuses"]["200"] > 0
    assert everything["no_answer"] == 0 and everything["other"] == 0
    assert everything["ok_share"] == 1.0  # within a 2 s budget on an idle deployment, the rest is answered 200
    # a request superseded is one whose session sent a newer request
    last_sent = {r.session: max(o.sent_s for o in records if o.session == r.session) for r in records}
    assert all(r.session and r.sent_s < last_sent[r.session] for r in records if r.is_superseded)
    assert set(out["by_model"]) == {"kb-small", "kb-large"}
    for model in ("kb-small", "kb-large"):
        row = out["by_model"][model]["all"]
        assert row["sent"] == sum(r.model == model for r in records) > 0
        assert row["p50_ms"] <= row["p90_ms"] <= row["p99_ms"]
        assert len(out["windows"]["by_model"][model]) == 4
        assert {"paid", "free"} <= set(out["by_model"][model]) or row["sent"] < 10
    assert out["slo"]["slo_ms"] == 1000.0
    assert out_png.read_bytes()[:8] == PNG
    assert not math.isnan(everything["p99_ms"])
