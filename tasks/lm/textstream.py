"""The text of one completion as its tokens arrive: whole characters, never text a stop cuts.

Decoding is incremental the way vLLM's detokenizer does it: only the last few tokens are
decoded again at each step, and text that ends in half a UTF-8 character (U+FFFD from a
byte-level tokenizer) waits for the token that completes it. On top of that, the tail of
the text that could still be the start of a stop sequence is held back until the next
tokens show whether the stop completes. So every piece handed out is final, and the
pieces add up to the completion.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"  # what decoding half a UTF-8 character gives

Decode = Callable[[list[int]], str]  # token ids to text, special tokens left out


class TextStream:
    """Tokens in (`push`), safe text out (`take`), the rest at the end (`finish`)."""

    def __init__(self, decode: Decode, stops: list[str]) -> None:
        self._decode = decode
        self.stops = [s for s in stops if s]
        self.token_ids: list[int] = []
        self.text = ""  # decoded so far (cut at a stop once one is found)
        self.is_stopped = False
        self._prefix_offset = 0  # tokens before this were decoded into text for good
        self._read_offset = 0  # tokens before this are in `text`
        self._emitted = 0  # characters of `text` handed out

    def push(self, token_id: int) -> None:
        """Add one generated token; may find a stop sequence (then `is_stopped`)."""
        if self.is_stopped:
            return
        self.token_ids.append(token_id)
        self._append(self._decode_new(final=False))

    def take(self) -> str:
        """Text new since the last call that no stop sequence can cut any more."""
        end = len(self.text) if self.is_stopped else len(self.text) - self._held_back()
        delta = self.text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta

    def finish(self) -> str:
        """The request ends: decode what was waiting for more bytes and hand out the rest."""
        if not self.is_stopped:
            self._append(self._decode_new(final=True))
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return delta

    @property
    def emitted_text(self) -> str:
        return self.text[: self._emitted]

    def _decode_new(self, final: bool) -> str:
        before = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        after = self._decode(self.token_ids[self._prefix_offset :])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT) and not final):
            return ""  # nothing yet, or half a character: wait for the next token
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return after[len(before) :]

    def _append(self, new: str) -> None:
        if not new:
            return
        # A stop begins at or after `_emitted`: anything earlier that could start one was held back.
        self.text += new
        hits = [i for i in (self.text.find(s, self._emitted) for s in self.stops) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            self.is_stopped = True

    def _held_back(self) -> int:
        """Length of the longest tail of the unsent text that a stop sequence starts with."""
        pending = self.text[self._emitted :]
        longest = max((len(s) - 1 for s in self.stops), default=0)
        for size in range(min(longest, len(pending)), 0, -1):
            tail = pending[-size:]
            if any(s.startswith(tail) for s in self.stops):
                return size
        return 0
