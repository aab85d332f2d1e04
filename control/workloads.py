"""Request bodies for benchmarks of the real models: what an IDE sends.

- `mixed`: prompts of 300-1,500 characters cut from held-out source files at a line
  end, `max_tokens` log-uniform between 4 and 128 (median about 23: most completions
  are a line or two, a few are a whole block).
- `shared_prefix`: the same files completed again and again further down, as a user
  typing through a file does: each prompt is the file from its first line to the
  cursor, so requests of one file share their header (the prefix cache's case).

The files come from tasks/lm/corpus.py (no torch is imported).

And when requests are sent, where that is more than a rate:
- `typing_sessions`: users typing, one request per pause between keystrokes, each
  superseding the one before it in its session (the simulator's `typing` profile draws
  the same process, with the same draws in the same order).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

MIN_TOKENS, MAX_TOKENS = 4, 128


def max_tokens(rng: random.Random) -> int:
    return round(math.exp(rng.uniform(math.log(MIN_TOKENS), math.log(MAX_TOKENS))))


def mixed(n: int, seed: int = 0) -> list[dict]:
    from tasks.lm.corpus import prompt_samples

    rng = random.Random(seed)
    return [
        {"prompt": prompt, "max_tokens": max_tokens(rng), "temperature": 0.0}
        for prompt, _next_line in prompt_samples(n, seed)
    ]


def shared_prefix(n: int, seed: int = 0, per_file: int = 8, min_chars: int = 1200, max_chars: int = 2400) -> list[dict]:
    """`per_file` requests per file, the cursor moving down; files interleaved in turn."""
    from tasks.lm.corpus import held_out_files

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


@dataclass(frozen=True)
class TypingSessions:
    """Requests of typing sessions in order of sending; arrays indexed by request."""

    t_ms: np.ndarray  # float64: when it is sent
    session: np.ndarray  # int64: which session sends it
    prev: np.ndarray  # int64: the request of the same session it supersedes, or -1
    num_sessions: int


def typing_sessions(
    rng: np.random.Generator, rps: float, seconds: float, keystrokes: float = 6.0, pause_ms: float = 350.0
) -> TypingSessions:
    """Sessions start at random over the run, `rps * seconds / keystrokes` of them on
    average; each sends `keystrokes` requests on average (geometric), one every typing pause
    (100 ms + exponential `pause_ms`). Requests after `seconds` are not sent."""
    num_sessions = rng.poisson(rps * seconds / keystrokes)
    lengths = rng.geometric(1.0 / keystrokes, num_sessions)
    owner = np.repeat(np.arange(num_sessions), lengths)
    gaps = 100.0 + rng.exponential(pause_ms, len(owner))
    first = np.r_[0, np.cumsum(lengths)[:-1]]
    gaps[first] = 0.0
    cum = np.cumsum(gaps)
    t = np.repeat(rng.uniform(0.0, seconds * 1000.0, num_sessions), lengths) + cum - np.repeat(cum[first], lengths)
    prev_raw = np.arange(len(owner)) - 1
    prev_raw[first] = -1
    order = np.argsort(t, kind="stable")
    order = order[t[order] < seconds * 1000.0]
    rank = np.full(len(t), -1, dtype=np.int64)
    rank[order] = np.arange(len(order))
    prev = np.where(prev_raw[order] >= 0, rank[np.maximum(prev_raw[order], 0)], -1)
    return TypingSessions(t[order].astype(np.float64), owner[order], prev.astype(np.int64), int(num_sessions))
