"""Request bodies for benchmarks of the real models: what an IDE sends.

- `mixed`: prompts of 300-1,500 characters cut from held-out source files at a line
  end, `max_tokens` log-uniform between 4 and 128 (median about 23: most completions
  are a line or two, a few are a whole block).
- `shared_prefix`: the same files completed again and again further down, as a user
  typing through a file does: each prompt is the file from its first line to the
  cursor, so requests of one file share their header (the prefix cache's case).

The files come from tasks/lm/train/corpus.py (no torch is imported).

And when requests are sent, where that is more than a rate:
- `typing_sessions` (from `control/load/arrivals.py`, which the simulator draws too): users typing,
  one request per pause between keystrokes, each superseding the one before it in its
  session.
"""

from __future__ import annotations

import math
import random

from control.core.vocab import MAX_TOKENS, MIN_TOKENS
from control.load.arrivals import TypingSessions, typing_sessions


def max_tokens(rng: random.Random) -> int:
    return round(math.exp(rng.uniform(math.log(MIN_TOKENS), math.log(MAX_TOKENS))))


def mixed(n: int, seed: int = 0) -> list[dict]:
    from tasks.lm.train.corpus import prompt_samples

    rng = random.Random(seed)
    return [
        {"prompt": prompt, "max_tokens": max_tokens(rng), "temperature": 0.0}
        for prompt, _next_line in prompt_samples(n, seed)
    ]


def shared_prefix(n: int, seed: int = 0, per_file: int = 8, min_chars: int = 1200, max_chars: int = 2400) -> list[dict]:
    """`per_file` requests per file, the cursor moving down; files interleaved in turn."""
    from tasks.lm.train.corpus import held_out_files

    rng = random.Random(seed)
    files = [f.text for f in held_out_files() if len(f.text) > max_chars]
    rng.shuffle(files)
    groups = []
    for text in files[: math.ceil(n / per_file)]:
        cuts = sorted(rng.randrange(min_chars, max_chars) for _ in range(per_file))
        groups.append([_at_line_end(text, cut) for cut in cuts])
    bodies = []
    for turn in range(per_file):  # one request of each file in turn: they interleave as users do
        for group in groups:
            bodies.append({"prompt": group[turn], "max_tokens": max_tokens(rng), "temperature": 0.0})
    return bodies[:n]


def _at_line_end(text: str, cut: int) -> str:
    end = text.rfind("\n", 0, cut)
    return text[: end + 1] if end > 0 else text[:cut]


__all__ = ["TypingSessions", "max_tokens", "mixed", "shared_prefix", "typing_sessions"]
