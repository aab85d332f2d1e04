"""The quality measure: its validity check, and a run over a quick model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.lm.train import corpus
from tasks.lm.train.quality import Line, evaluate, is_valid, score
from tests.support.lm_fixtures import quick_model  # noqa: F401

BEFORE = """import os


class Walker:
    def walk(self, top):
        for name in os.listdir(top):
            print(name)
"""


@pytest.mark.parametrize(
    "line",
    [
        "            yield name",
        "            if name.startswith(",  # an open bracket: later lines close it
        "            try:",  # a block header: later lines give its body
        '            """A docstring that goes on',
        "        return None",  # out of the loop
        "        else:",  # the loop's else
        "def main():",  # out of the class
        "            # a comment",
    ],
)
def test_lines_that_keep_the_code_valid(line: str) -> None:
    assert is_valid(BEFORE, Line(line, ended=True))


@pytest.mark.parametrize(
    "line",
    [
        "",
        "            ",
        "                yield name",  # indented deeper than the block
        "        return None)",
        "            )",
        "            x = = 1",
        "            some prose words",
        "    else:",  # no `if` to continue
    ],
)
def test_lines_that_do_not(line: str) -> None:
    assert not is_valid(BEFORE, Line(line, ended=True))


def test_a_line_the_model_did_not_end_does_not_count() -> None:
    assert is_valid(BEFORE, Line("            name", ended=True))
    assert not is_valid(BEFORE, Line("            name", ended=False))


def test_the_true_lines_score_full_marks_and_near_misses_partial_ones() -> None:
    cuts = corpus.prompt_cuts(4, seed=0)
    truth = score([Line(cut.next_line + "  ", True) for cut in cuts], cuts)
    assert truth["exact_match"] == truth["edit_similarity"] == truth["valid"] == truth["ended"] == 1.0
    near = score([Line(cut.next_line[:-1], True) for cut in cuts], cuts)
    assert near["exact_match"] == 0.0 and 0.5 < near["edit_similarity"] < 1.0
    assert score([Line("", True) for _ in cuts], cuts)["blank"] == 1.0


def test_an_evaluation_scores_the_model_and_its_untrained_twin(quick_model: Path) -> None:  # noqa: F811
    result = evaluate(quick_model, n=6, seed=0)
    assert result["n"] == 6 and result["model"] == "kb-small"
    for kind in ("trained", "untrained"):
        assert set(result[kind]) == {
            "exact_match",
            "exact_match_outside_encodings",
            "edit_similarity",
            "valid",
            "ended",
            "blank",
        }
        assert all(0.0 <= v <= 1.0 for v in result[kind].values())
    assert result["reference"]["valid"] == 1.0
