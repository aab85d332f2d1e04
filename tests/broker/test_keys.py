"""Key names: made in control/broker/keys.py alone, and spelled by no Lua script."""

from __future__ import annotations

import ast
from pathlib import Path

from control.broker import keys, lua
from control.core import protocol as p

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIRS = ("api", "control", "tasks", "tui")


def _string_constants(path: Path) -> list[str]:
    return [
        n.value
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def _lua_strings() -> dict[Path, list[str]]:
    found: dict[Path, list[str]] = {}
    for folder in SOURCE_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            lua = [s for s in _string_constants(path) if "redis.call(" in s or "ARGV[" in s or "KEYS[" in s]
            if lua:
                found[path.relative_to(ROOT)] = lua
    return found


def test_every_key_is_made_from_its_parts_under_the_one_prefix() -> None:
    assert keys.key("lease", "r1") == "{kb}:lease:r1" == keys.lease_key("r1")
    assert keys.owner_key("acme:r1") == "{kb}:req:acme:r1"
    assert keys.waiting_key("m", "free", behind=True) == "{kb}:waiting:m:free:behind"
    assert keys.tenant_waiting_key("m", "paid", "acme") == "{kb}:waiting:m:paid:t:acme"
    assert keys.queue_key("m", "paid") == p.queue_name("m") == "{kb}.m"
    assert keys.queue_key("m", "free", behind=True) == "{kb}.m:9"
    assert keys.requeued_key("a1") == "{kb}:requeued:a1" and keys.DEATHS_KEY == "{kb}:deaths"


def test_no_lua_string_in_the_tree_spells_the_key_prefix() -> None:
    lua = _lua_strings()
    assert lua, "the scan found no Lua at all: it looks in the wrong place"
    spelled = {str(path): [s[:60] for s in strings if keys.PREFIX in s or "kb:" in s] for path, strings in lua.items()}
    assert {path: hits for path, hits in spelled.items() if hits} == {}


def test_all_lua_lives_in_the_scripts_module_and_the_envelope() -> None:
    assert set(_lua_strings()) <= {Path("control/broker/lua.py"), Path("control/broker/envelope.py")}


def test_the_prefix_reaches_a_script_only_through_its_prelude() -> None:
    for name, source in lua.SOURCES.items():
        assert source.count(keys.PREFIX) == lua.PRELUDE.count(keys.PREFIX), name
        assert lua.PRELUDE in source, name


def test_a_lanes_keys_are_the_ones_their_functions_make() -> None:
    for tier in ("paid", "free"):
        lane = keys.lane_keys("m", tier)
        assert lane.waiting == keys.waiting_key("m", tier)
        assert lane.waiting_behind == keys.waiting_key("m", tier, behind=True)
        assert (lane.waiting_paid, lane.waiting_free) == (keys.waiting_key("m", "paid"), keys.waiting_key("m", "free"))
        assert lane.waiting_paid_behind == keys.waiting_key("m", "paid", behind=True)
        assert lane.waiting_free_behind == keys.waiting_key("m", "free", behind=True)
        assert (lane.queue, lane.queue_behind) == (keys.queue_key("m", tier), keys.queue_key("m", tier, behind=True))
