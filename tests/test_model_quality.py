"""The quality measure: its syntax check, and a run over a quick model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.lm.quality import evaluate, parses
from tests.lm_fixtures import quick_model  # noqa: F401


@pytest.mark.parametrize(
    "line",
    [
        "return x",
        "        yield item",
        "def f(x):",
        "foo(a,",
        '"""A docstring that goes on',
        "else:",
        "elif x > 1:",
        "except ValueError as exc:",
        "finally:",
        "case [x, y]:",
        "@decorator",
        "import os  # why",
    ],
)
def test_lines_that_parse(line: str) -> None:
    assert parses(line)


@pytest.mark.parametrize("line", ["", "   ", ")", "x = = 1", "some prose words here", "def", "'abc", "print 'hi'"])
def test_lines_that_do_not(line: str) -> None:
    assert not parses(line)


def test_an_evaluation_scores_the_model_and_its_untrained_twin(quick_model: Path) -> None:  # noqa: F811
    result = evaluate(quick_model, n=6, seed=0)
    assert result["n"] == 6 and result["model"] == "kb-small"
    for kind in ("trained", "untrained"):
        assert set(result[kind]) == {"exact_match", "exact_match_outside_codec_tables", "parses", "empty"}
        assert all(0.0 <= v <= 1.0 for v in result[kind].values())
    assert 0.0 < result["reference"]["parses"] <= 1.0
