"""The docs against the code: the settings table in docs/operations.md names every field
of `Settings` with its default and nothing else, every file in docs/bench/ is in its
index, every repository path a doc names exists, and no doc or stored report names a
path of the machine it was written on.

`KEYBATCH_UPDATE_DOCS=1 python -m tests.tools.test_docs` prints the settings table,
meanings taken from the table in place (else from the field's description), to paste.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any

from pydantic_core import PydanticUndefined

from control.core.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations.md"
BENCH = ROOT / "docs" / "bench"
TABLE_HEAD = "| setting | default | meaning |"
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:work|tmp|home|root)/")
# A repository path as a doc names it: a file with its extension, or a folder with its
# slash, under the packages, the tests or the docs.
REPO_PATH = re.compile(
    r"(?<![\w./-])((?:api|control|tasks|tui|tests|docs)/(?:[\w*-]+/)*"
    r"(?:[\w*-]+\.(?:py|md|json|png|svg|lua|toml|txt|yml|yaml|sh|cfg|ini))?)(?![\w/-])"
)
PLACEHOLDER = re.compile(r"\b[A-Z]+\b")  # docs/bench/chaos-SCENARIO.json: any scenario


def _default(field: Any) -> str:
    """A field's default as the table writes it: unset, or its value as JSON."""
    if field.default_factory is socket.gethostname:
        return "this machine's name"
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if value is None:
        return "unset"
    if isinstance(value, Path):
        return f"`{value}`"
    return f"`{json.dumps(value)}`"


def expected_rows() -> dict[str, str]:
    """Setting name (as the environment spells it, without the prefix) -> its default."""
    return {name.upper(): _default(field) for name, field in Settings.model_fields.items()}


def table_rows(text: str) -> dict[str, tuple[str, str]]:
    """The settings table in `text`: name -> (default, meaning)."""
    lines = text.splitlines()
    start = lines.index(TABLE_HEAD) + 2
    rows = {}
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        name, default, meaning = cells[0].strip("`"), cells[1], " | ".join(cells[2:])
        assert name not in rows, f"{name} is in the table twice"
        rows[name] = (default, meaning)
    return rows


def render_table(meanings: dict[str, str]) -> str:
    lines = [TABLE_HEAD, "| --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        key = name.upper()
        meaning = meanings.get(key) or field.description or ""
        lines.append(f"| `{key}` | {_default(field)} | {meaning} |")
    return "\n".join(lines)


def test_settings_table_names_every_field_and_its_default() -> None:
    documented = table_rows(OPERATIONS.read_text())
    expected = expected_rows()
    assert sorted(set(expected) - set(documented)) == [], "settings missing from docs/operations.md"
    assert sorted(set(documented) - set(expected)) == [], "docs/operations.md names settings that do not exist"
    wrong = {name: (documented[name][0], value) for name, value in expected.items() if documented[name][0] != value}
    assert wrong == {}, "defaults in docs/operations.md differ from Settings: (documented, actual)"
    assert all(meaning for _, meaning in documented.values()), "a setting without a meaning"


def test_the_table_check_catches_a_missing_and_an_invented_setting() -> None:
    table = render_table({})
    rows = table_rows(table.replace("| `PORT` |", "| `PORTS` |"))
    assert "PORT" not in rows and "PORTS" in rows
    assert set(rows) != set(expected_rows())


def test_bench_index_lists_every_stored_file() -> None:
    index = (BENCH / "README.md").read_text()
    listed = set(re.findall(r"`([\w.-]+\.(?:json|png|svg))`", index))
    stored = {path.name for path in BENCH.iterdir() if path.name != "README.md"}
    assert sorted(stored - listed) == [], "files in docs/bench/ missing from its README"
    assert sorted(listed - stored) == [], "docs/bench/README.md lists files that are not there"


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted(BENCH.glob("*.json"))]


def test_no_doc_or_stored_report_names_a_machine_path() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {match.group(0)}"
        for path in _docs()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if (match := MACHINE_PATH.search(line))
    ]
    assert found == []


def test_the_path_scan_catches_a_machine_path() -> None:
    assert MACHINE_PATH.search('"log": "/tmp/keybatch-x/up.log"')
    assert MACHINE_PATH.search("KEYBATCH_MODELS_DIR=/work/models")
    assert not MACHINE_PATH.search("docs/bench/serving.json and /v1/completions")


def in_tree(path: str) -> bool:
    """Is the path in the tree, an all-caps part or a `*` standing for any name?"""
    if (ROOT / path).exists():
        return True
    pattern = PLACEHOLDER.sub("*", path).rstrip("/")
    return "*" in pattern and next(ROOT.glob(pattern), None) is not None


def missing_paths(text: str) -> list[str]:
    return [path for path in REPO_PATH.findall(text) if not in_tree(path)]


def test_every_repository_path_a_doc_names_exists() -> None:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [
        f"{path.relative_to(ROOT)}:{number}: {missing}"
        for path in docs
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for missing in missing_paths(line)
    ]
    assert found == []


def test_the_repository_path_scan_catches_a_file_that_is_not_there() -> None:
    text = "the loop (`tasks/replica/nowhere.py`), api/gateway.py, tasks/lm/ and docs/bench/chaos-SCENARIO.json"
    assert REPO_PATH.findall(text) == [
        "tasks/replica/nowhere.py",
        "api/gateway.py",
        "tasks/lm/",
        "docs/bench/chaos-SCENARIO.json",
    ]
    assert missing_paths(text) == ["tasks/replica/nowhere.py"]
    assert missing_paths("docs/bench/nowhere-SCENARIO.json and api/gone/") == [
        "docs/bench/nowhere-SCENARIO.json",
        "api/gone/",
    ]
    assert REPO_PATH.findall("`tasks/app` and tasks/worker.run_worker, docs/decisions/0017") == []


def test_stored_reports_are_valid_json() -> None:
    for path in BENCH.glob("*.json"):
        json.loads(path.read_text())


if __name__ == "__main__" and os.environ.get("KEYBATCH_UPDATE_DOCS") == "1":
    current = table_rows(OPERATIONS.read_text()) if TABLE_HEAD in OPERATIONS.read_text() else {}
    sys.stdout.write(render_table({name: meaning for name, (_, meaning) in current.items()}) + "\n")
