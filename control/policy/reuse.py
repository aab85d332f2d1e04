"""Typed-through reuse: a session's next prompt that only adds what its last completion
suggested is answered with the rest of that completion, without the model. Policy code:
no I/O; the gateway keeps each session's last completion in the broker.

An IDE sends a request at every pause in typing. When the user types the characters the
last completion proposed, the new prompt is the old one plus those characters, and the
model would (at temperature 0, and the sampled text is as good a sample otherwise) go on
with the rest of the same completion. So:

- the same model, suffix and sampling options as the last request of the session;
- its prompt starts with the last prompt (compared by length and a BLAKE2b digest, so the
  broker keeps no prompt text), and what follows is a non-empty start of the last
  completion, shorter than all of it;
- the answer is the rest of the completion, with the last one's finish reason;
- never a rest that starts inside a character: a combining mark after what was typed
  (an accent the completion put on the typed letter) would reach the client alone.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Previous:
    """A session's last completion, as kept between its requests."""

    options: str  # `options_digest` of the request that got it
    prompt_chars: int
    prompt_digest: str
    text: str
    finish_reason: str


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def options_digest(
    model: str, suffix: str | None, max_tokens: int, temperature: float, top_p: float, stop: list[str]
) -> str:
    """What besides the prompt must match for a completion to be reused."""
    return _digest(json.dumps([model, suffix, max_tokens, temperature, top_p, stop]))


def remember(options: str, prompt: str, text: str, finish_reason: str) -> Previous:
    return Previous(options, len(prompt), _digest(prompt), text, finish_reason)


def typed_through(previous: Previous, options: str, prompt: str) -> str | None:
    """The rest of the previous completion when `prompt` is the previous prompt plus a
    start of it; None when it is not."""
    if options != previous.options or len(prompt) <= previous.prompt_chars:
        return None
    typed = prompt[previous.prompt_chars :]
    if len(typed) >= len(previous.text) or not previous.text.startswith(typed):
        return None
    rest = previous.text[len(typed) :]
    if unicodedata.combining(rest[0]):  # the typed letter is not the completion's character
        return None
    if _digest(prompt[: previous.prompt_chars]) != previous.prompt_digest:
        return None
    return rest


def pack(previous: Previous) -> str:
    return json.dumps(asdict(previous), separators=(",", ":"))


_TYPES = {"options": str, "prompt_chars": int, "prompt_digest": str, "text": str, "finish_reason": str}


def parse(raw: bytes | str) -> Previous | None:
    """None for a record that does not read (written by another version, or damaged)."""
    try:
        fields = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(fields, dict) or set(fields) != set(_TYPES):
        return None
    if not all(type(fields[name]) is kind for name, kind in _TYPES.items()):
        return None
    return Previous(**fields)
