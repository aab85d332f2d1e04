"""Typed-through reuse, the policy: which prompt may take the rest of the last completion."""

from __future__ import annotations

from control.policy import reuse

OPTIONS = reuse.options_digest("kb-small", None, 16, 0.0, 1.0, [])
PROMPT = "def add(a, b):\n    "
TEXT = "return a + b\n"


def _previous() -> reuse.Previous:
    return reuse.remember(OPTIONS, PROMPT, TEXT, "length")


def test_a_prompt_that_adds_a_start_of_the_completion_gets_the_rest() -> None:
    assert reuse.typed_through(_previous(), OPTIONS, PROMPT + "ret") == "urn a + b\n"
    assert reuse.typed_through(_previous(), OPTIONS, PROMPT + "return a + b") == "\n"


def test_anything_else_goes_to_the_model() -> None:
    previous = _previous()
    assert reuse.typed_through(previous, OPTIONS, PROMPT) is None  # nothing typed
    assert reuse.typed_through(previous, OPTIONS, PROMPT + TEXT) is None  # all of it typed: nothing left
    assert reuse.typed_through(previous, OPTIONS, PROMPT + "rex") is None  # typed something else
    assert reuse.typed_through(previous, OPTIONS, "def sub(a, b):\n    ret") is None  # another prompt, as long
    assert reuse.typed_through(previous, OPTIONS, PROMPT[:-1] + "ret") is None  # an edit before the cursor
    other = reuse.options_digest("kb-small", "\n# end", 16, 0.0, 1.0, [])  # another suffix
    assert reuse.typed_through(previous, other, PROMPT + "ret") is None


def test_a_rest_that_would_start_with_a_combining_mark_goes_to_the_model() -> None:
    accented = reuse.remember(OPTIONS, PROMPT, "cafe\u0301 = 1\n", "length")  # "café", the accent apart
    assert reuse.typed_through(accented, OPTIONS, PROMPT + "caf") == "e\u0301 = 1\n"
    assert reuse.typed_through(accented, OPTIONS, PROMPT + "cafe") is None  # the rest would begin with the accent
    assert reuse.typed_through(accented, OPTIONS, PROMPT + "cafe\u0301") == " = 1\n"


def test_the_record_packs_and_a_damaged_one_reads_as_none() -> None:
    assert reuse.parse(reuse.pack(_previous())) == _previous()
    assert reuse.parse(b"{not json") is None and reuse.parse(b'{"text": "x"}') is None
    damaged = (
        reuse.pack(_previous())
        .replace('"prompt_chars":', '"prompt_chars":"')
        .replace(',"prompt_digest"', '","prompt_digest"')
    )
    assert reuse.parse(damaged) is None  # a length as a string: never a TypeError on the request path
    assert reuse.parse(b"[1]") is None
