"""The batching policy is one setting (`KEYBATCH_POLICY`) with one default: every command's
`--policy` and the supervisor's plan fall back to it."""

from __future__ import annotations

import pytest

from control.cli.main import _parser
from control.core.settings import Settings
from control.fleet.up import Child, Plan, System

COMMANDS = [["up"], ["worker", "--model", "kb-small"], ["chaos", "replica-kill"], ["capacity"]]


def test_the_setting_defaults_to_static_and_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().policy == "static"
    monkeypatch.setenv("KEYBATCH_POLICY", "continuous")
    assert Settings().policy == "continuous"


@pytest.mark.parametrize("argv", COMMANDS, ids=lambda argv: argv[0])
def test_no_command_spells_a_default_of_its_own(argv: list[str]) -> None:
    assert _parser().parse_args(argv).policy is None
    assert _parser().parse_args([*argv, "--policy", "continuous"]).policy == "continuous"


def test_a_plan_without_a_policy_starts_its_replicas_with_the_setting() -> None:
    settings = Settings(redis_url="redis://127.0.0.1:1", policy="continuous")
    replica = Child("replica", "kb-small-0")
    plans = [(Plan(models=["kb-small"]), "continuous"), (Plan(models=["kb-small"], policy="static"), "static")]
    for plan, wanted in plans:
        cmd = System(settings, plan)._replica_cmd(replica)
        assert cmd[cmd.index("--policy") + 1] == wanted
