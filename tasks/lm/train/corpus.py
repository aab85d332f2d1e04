"""The training text: the Python standard library's own source on this machine.

Every file has a fixed side of a training / held-out split (a hash of its path, about
5% held out), so the models never train on the files their quality is measured on and
the engine benchmark's prompts are unseen text too. Everything here is deterministic:
files come in sorted order and every random choice takes a seed.
"""

from __future__ import annotations

import functools
import hashlib
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tasks.lm.fim import END_OF_TEXT, FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX

MAX_FILE_BYTES = 200_000
HELD_OUT_PERCENT = 5
_SKIPPED_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__"}


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the standard library's folder, with forward slashes
    text: str


@dataclass(frozen=True)
class FimSample:
    """A cursor inside a file: the code before it, the code after it, and what goes between."""

    prefix: str
    suffix: str
    middle: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(path: str) -> bool:
    """The split: a hash of the relative path, so it does not move when files are added."""
    digest = hashlib.sha256(path.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


@functools.cache
def all_files() -> tuple[SourceFile, ...]:
    """Every usable `.py` file of the standard library, sorted by path."""
    root = stdlib_root()
    files = []
    for file in sorted(root.rglob("*.py")):
        rel = file.relative_to(root)
        if _SKIPPED_DIRS.intersection(rel.parts[:-1]) or file.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            files.append(SourceFile(rel.as_posix(), text))
    return tuple(files)


def training_files() -> list[SourceFile]:
    return [f for f in all_files() if not is_held_out(f.path)]


def held_out_files() -> list[SourceFile]:
    return [f for f in all_files() if is_held_out(f.path)]


def chunks(text: str, max_chars: int) -> Iterator[str]:
    """`text` in consecutive pieces of whole lines, each at most `max_chars` long
    (a single longer line is cut), so a piece fits a short training sequence."""
    piece: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        if size + len(line) > max_chars and piece:
            yield "".join(piece)
            piece, size = [], 0
        while len(line) > max_chars:
            yield line[:max_chars]
            line = line[max_chars:]
        if line:
            piece.append(line)
            size += len(line)
    if piece:
        yield "".join(piece)


def fim_split(text: str, rng: random.Random) -> FimSample:
    """Two cut points drawn uniformly over the characters (as StarCoder trains FIM)."""
    lo, hi = sorted(rng.randrange(len(text) + 1) for _ in range(2))
    return FimSample(prefix=text[:lo], suffix=text[hi:], middle=text[lo:hi])


def fim_document(sample: FimSample) -> str:
    """A sample in prefix-suffix-middle order, as the model learns it and `format_prompt` asks."""
    return f"{FIM_PREFIX}{sample.prefix}{FIM_SUFFIX}{sample.suffix}{FIM_MIDDLE}{sample.middle}{END_OF_TEXT}"


def _line_starts(text: str) -> list[int]:
    starts = [0]
    starts.extend(i + 1 for i, ch in enumerate(text) if ch == "\n" and i + 1 < len(text))
    return starts


@dataclass(frozen=True)
class PromptCut:
    path: str  # the held-out file it was cut from
    cursor: int  # where the prompt ends in that file's text
    prompt: str
    next_line: str


def prompt_samples(n: int, seed: int, min_chars: int = 300, max_chars: int = 1500) -> list[tuple[str, str]]:
    """`n` (prompt, next_line) pairs cut from held-out files (see `prompt_cuts`)."""
    return [(cut.prompt, cut.next_line) for cut in prompt_cuts(n, seed, min_chars, max_chars)]


def prompt_cuts(n: int, seed: int, min_chars: int = 300, max_chars: int = 1500) -> list[PromptCut]:
    """`n` prompts cut from held-out files at random points (a file is drawn in proportion
    to its length, so every held-out line is as likely a cursor as any other).

    A prompt is `min_chars`..`max_chars` of whole lines, so the cursor sits at the start of
    a new line; `next_line` is the line that follows in the file (without its newline) and
    is never blank. The same arguments always give the same cuts.
    """
    rng = random.Random(seed)
    files = [f for f in held_out_files() if len(f.text) > min_chars]
    weights = [len(f.text) for f in files]
    cuts: list[PromptCut] = []
    while len(cuts) < n:
        file = rng.choices(files, weights)[0]
        cut = _cut_prompt(file.text, rng, min_chars, max_chars)
        if cut is not None:
            cuts.append(PromptCut(file.path, *cut))
    return cuts


def _cut_prompt(text: str, rng: random.Random, min_chars: int, max_chars: int) -> tuple[int, str, str] | None:
    starts = _line_starts(text)
    end_index = rng.randrange(1, len(starts))  # the prompt ends where line `end_index` starts
    end = starts[end_index]
    fitting = [s for s in starts[:end_index] if min_chars <= end - s <= max_chars]
    next_line = text[end:].split("\n", 1)[0]
    if not fitting or not next_line.strip():
        return None
    return end, text[rng.choice(fitting) : end], next_line


def fim_samples(n: int, seed: int, max_context_chars: int = 1500) -> list[FimSample]:
    """`n` cursors inside held-out files, for FIM requests: the middle is the rest of a
    non-blank line from a point inside it; prefix and suffix are up to
    `max_context_chars` of the code around it (whole lines beyond the cursor's own)."""
    rng = random.Random(seed)
    files = held_out_files()
    samples: list[FimSample] = []
    while len(samples) < n:
        lines = rng.choice(files).text.splitlines(keepends=True)
        row = rng.randrange(len(lines))
        line = lines[row].rstrip("\n")
        if not line.strip():
            continue
        col = rng.randrange(len(line) - len(line.lstrip()), len(line))
        before = _tail_lines(lines[:row], max_context_chars - col) + line[:col]
        after = "\n" + _head_lines(lines[row + 1 :], max_context_chars - 1) if row + 1 < len(lines) else ""
        samples.append(FimSample(prefix=before, suffix=after, middle=line[col:]))
    return samples


def _tail_lines(lines: list[str], max_chars: int) -> str:
    """The last whole lines of `lines` that fit in `max_chars`."""
    size, first = 0, len(lines)
    while first > 0 and size + len(lines[first - 1]) <= max_chars:
        first -= 1
        size += len(lines[first])
    return "".join(lines[first:])


def _head_lines(lines: list[str], max_chars: int) -> str:
    """The first whole lines of `lines` that fit in `max_chars`."""
    size, last = 0, 0
    while last < len(lines) and size + len(lines[last]) <= max_chars:
        size += len(lines[last])
        last += 1
    return "".join(lines[:last])
