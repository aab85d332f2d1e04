"""The scheduler's policy, on plain data (no model, no torch)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tasks.policy.scheduler import ContinuousScheduler, RunningRequest, SchedulerConfig, WaitingRequest

ROOT = Path(__file__).resolve().parents[2]


def make_scheduler(**overrides: object) -> ContinuousScheduler:
    config = {"max_slots": 4, "token_budget": 64, "prefill_chunk": 32, "policy": "continuous", **overrides}
    return ContinuousScheduler(SchedulerConfig(**config))  # type: ignore[arg-type]


def waiting(id: str, tokens: int = 10, tier: str = "free", arrival: int = 0) -> WaitingRequest:
    return WaitingRequest(id, tier, tokens, arrival)


def decoding(id: str, finished: bool = False) -> RunningRequest:
    return RunningRequest(id, 0, is_finished=finished)


def prefilling(id: str, left: int, tier: str = "free", arrival: int = 0) -> RunningRequest:
    return RunningRequest(id, left, tier, arrival)


@pytest.mark.parametrize(
    "config",
    [
        {"max_slots": 0},
        {"prefill_chunk": 0},
        {"max_slots": 8, "token_budget": 7},
        {"policy": "fifo"},
    ],
)
def test_config_checks_itself(config: dict) -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(**config)


def test_paid_before_free_then_arrival_order() -> None:
    queue = [waiting("f1", arrival=1), waiting("p2", tier="paid", arrival=2), waiting("f0", arrival=0)]
    queue.append(waiting("p3", tier="paid", arrival=3))
    out = make_scheduler(max_slots=3).schedule(queue, [])
    assert out.joined == ["p2", "p3", "f0"]


def test_admits_only_into_free_slots() -> None:
    out = make_scheduler(max_slots=3).schedule([waiting("a"), waiting("b", arrival=1)], [decoding("x"), decoding("y")])
    assert out.joined == ["a"]


def test_decodes_first_then_prefill_chunks_within_the_budget() -> None:
    sched = make_scheduler(max_slots=8, token_budget=40, prefill_chunk=32)
    running = [decoding("d1"), prefilling("long", 500, arrival=1), decoding("d2"), prefilling("next", 20, arrival=2)]
    out = sched.plan(running)
    assert out.decodes == ["d1", "d2"]
    # 40 - 2 decodes = 38 tokens: one full chunk of the long prompt, 6 of the next.
    assert out.prefills == {"long": 32, "next": 6}
    assert out.num_tokens == 40


def test_a_long_prompt_never_holds_decodes_back() -> None:
    sched = make_scheduler(max_slots=4, token_budget=16, prefill_chunk=8)
    running = [decoding("d"), prefilling("long", 1000)]
    for _ in range(5):
        out = sched.plan(running)
        assert out.decodes == ["d"]
        assert out.prefills == {"long": 8}


def test_paid_prefill_goes_first() -> None:
    out = make_scheduler(token_budget=32, prefill_chunk=32).plan(
        [prefilling("free", 100, arrival=0), prefilling("paid", 100, tier="paid", arrival=5)]
    )
    assert out.prefills == {"paid": 32}


def test_admitted_requests_prefill_in_the_same_step() -> None:
    sched = make_scheduler(token_budget=64, prefill_chunk=32)
    out = sched.schedule([waiting("a", 50), waiting("b", 50, arrival=1)], [])
    assert out.joined == ["a", "b"]
    assert out.prefills == {"a": 32, "b": 32}
    assert out.decodes == []


def test_continuous_releases_finished_at_once_and_refills() -> None:
    sched = make_scheduler(max_slots=2)
    out = sched.schedule([waiting("new")], [decoding("done", finished=True), decoding("busy")])
    assert out.released == ["done"]
    assert out.joined == ["new"]
    assert out.decodes == ["busy"]


def test_static_admits_only_into_an_empty_engine() -> None:
    sched = make_scheduler(policy="static", max_slots=4)
    assert sched.schedule([waiting("late")], [decoding("a")]).joined == []
    assert sched.schedule([waiting("a"), waiting("b", arrival=1)], []).joined == ["a", "b"]


def test_static_keeps_the_batch_until_all_finish() -> None:
    sched = make_scheduler(policy="static", max_slots=4)
    out = sched.schedule([waiting("late")], [decoding("a", finished=True), decoding("b")])
    assert out.released == []
    assert out.joined == []
    assert out.decodes == ["a", "b"]  # the finished row still runs, as a padded row of generate
    out = sched.schedule([waiting("late")], [decoding("a", finished=True), decoding("b", finished=True)])
    assert out.released == ["a", "b"]
    assert out.joined == ["late"]


def test_a_finished_request_never_prefills() -> None:
    sched = make_scheduler(policy="static")
    failed = RunningRequest("failed", 40, is_finished=True)
    out = sched.plan([failed, decoding("b")])
    assert out.prefills == {}
    assert out.decodes == ["b"]


def test_nothing_to_do_is_an_empty_plan() -> None:
    assert make_scheduler().schedule([], []).is_empty


def test_policy_code_imports_only_the_standard_library_and_the_vocabularies() -> None:
    """The vocabularies' module is itself standard library only (checked here too)."""
    for source in (ROOT / "tasks" / "policy" / "scheduler.py", ROOT / "control" / "core" / "vocab.py"):
        tree = ast.parse(source.read_text())
        imported = {
            (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        assert imported <= {"__future__", "dataclasses", "typing", "control.core.vocab"}, source


def test_a_burst_of_short_prompts_prefills_a_few_per_step() -> None:
    config = SchedulerConfig(max_slots=64, token_budget=512, prefill_chunk=256, max_prefills=8)
    running = [RunningRequest(f"r{i}", num_prefill_left=6, arrival=i) for i in range(50)]
    plan = ContinuousScheduler(config).plan(running)
    assert len(plan.prefills) == 8 and plan.num_tokens == 48
