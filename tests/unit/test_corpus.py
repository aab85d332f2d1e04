"""The training text and the held-out prompts cut from it (no torch)."""

from __future__ import annotations

from tasks.lm.train import corpus


def test_the_split_is_fixed_disjoint_and_about_five_percent() -> None:
    train = {f.path for f in corpus.training_files()}
    held = {f.path for f in corpus.held_out_files()}
    assert train and held and not train & held
    assert 0.02 < len(held) / (len(train) + len(held)) < 0.1
    assert [f.path for f in corpus.held_out_files()] == sorted(held)
    skipped = ("/test/", "/tests/", "/idlelib/", "/lib2to3/", "/site-packages/")
    assert not any(part in f"/{path}" for path in train | held for part in skipped)


def test_prompts_end_at_a_line_end_and_their_next_line_follows_in_a_held_out_file() -> None:
    cuts = corpus.prompt_cuts(40, seed=3)
    held = {f.path: f.text for f in corpus.held_out_files()}
    for cut in cuts:
        assert 300 <= len(cut.prompt) <= 1500
        assert cut.prompt.endswith("\n") and cut.next_line.strip() and "\n" not in cut.next_line
        text = held[cut.path]
        assert text[: cut.cursor].endswith(cut.prompt) and text[cut.cursor :].startswith(cut.next_line)
    assert corpus.prompt_samples(40, seed=3) == [(c.prompt, c.next_line) for c in cuts]
    assert corpus.prompt_samples(40, seed=4) != corpus.prompt_samples(40, seed=3)


def test_fim_samples_put_back_together_are_the_file() -> None:
    held = [f.text for f in corpus.held_out_files()]
    for sample in corpus.fim_samples(30, seed=1):
        assert sample.middle.strip() and "\n" not in sample.middle
        assert any(sample.prefix + sample.middle + sample.suffix in text for text in held)
        assert len(sample.prefix) <= 1500 and len(sample.suffix) <= 1500


def test_chunks_are_whole_lines_that_join_back() -> None:
    text = "a = 1\n" * 100 + "x" * 50 + "\nend\n"
    pieces = list(corpus.chunks(text, 40))
    assert "".join(pieces) == text and all(len(p) <= 40 for p in pieces)
    assert all(p.endswith("\n") for p in pieces if len(p) < 40)
