"""What steps of an engine cost, measured as they run (moving medians, no constants).

The engine records each decode forward (by batch size), each prefill chunk (by tokens)
and each whole step; the replica's collector and the gateway's admission ask for the
expected time of the next step and of a typical request at the present load.

Each figure is the median of its last `WINDOW` samples, not a mean: a forward that
ran long for a reason of its own (the first, cold one; a process stopped or starved of
its core mid-step) is one sample among several and moves no estimate, where it would
pull a moving average up for many samples, and admission would refuse budgets the
engine meets.
"""

from __future__ import annotations

import math
from collections import deque
from statistics import median

WINDOW = 9  # samples per figure: a median that four far-off ones in a row cannot move out of the rest's range


class Recent:
    """The median of the last `WINDOW` samples of one figure."""

    def __init__(self) -> None:
        self.samples: deque[float] = deque(maxlen=WINDOW)
        self.value: float | None = None

    def add(self, sample: float) -> float:
        self.samples.append(sample)
        self.value = median(self.samples)
        return self.value


def batch_bucket(batch: int) -> int:
    """Batch sizes are averaged by power of two (1, 2, 4, ... 64)."""
    return 1 << max(0, batch - 1).bit_length()


class StepCosts:
    """Moving medians of forward times, and of the requests' shape."""

    def __init__(self, prompt_prior: float, completion_prior: float) -> None:
        self.decode_ms: dict[int, float] = {}  # batch bucket -> ms of one decode forward
        self.prefill_ms_per_token: float | None = None
        self.step_ms: float | None = None
        self.prefill_tokens_per_step: float | None = None
        # A typical request, until requests show otherwise: tokens to prefill, tokens generated,
        # and (static) the longest completion of a batch, which the whole batch waits for.
        self.prompt_tokens = prompt_prior
        self.completion_tokens = completion_prior
        self.batch_completion_tokens = completion_prior
        self._decode: dict[int, Recent] = {}
        self._recent = {name: Recent() for name in ("prefill_ms_per_token", "step_ms", "prefill_tokens_per_step")}
        for name, prior in (
            ("prompt_tokens", prompt_prior),
            ("completion_tokens", completion_prior),
            ("batch_completion_tokens", completion_prior),
        ):
            self._recent[name] = Recent()
            self._recent[name].add(prior)  # a sample: the first request shifts the shape, not sets it

    def record_decode(self, batch: int, ms: float) -> None:
        bucket = batch_bucket(batch)
        self.decode_ms[bucket] = self._decode.setdefault(bucket, Recent()).add(ms)

    def record_prefill(self, num_tokens: int, ms: float) -> None:
        if num_tokens > 0:
            self.prefill_ms_per_token = self._recent["prefill_ms_per_token"].add(ms / num_tokens)

    def record_step(self, ms: float, num_prefill_tokens: int) -> None:
        self.step_ms = self._recent["step_ms"].add(ms)
        self.prefill_tokens_per_step = self._recent["prefill_tokens_per_step"].add(num_prefill_tokens)

    def record_request(self, num_prefilled: int, num_generated: int) -> None:
        self.prompt_tokens = self._recent["prompt_tokens"].add(num_prefilled)
        self.completion_tokens = self._recent["completion_tokens"].add(num_generated)

    def record_batch(self, longest_completion: int) -> None:
        self.batch_completion_tokens = self._recent["batch_completion_tokens"].add(longest_completion)

    def decode(self, batch: int) -> float:
        """Expected ms of a decode forward over `batch` rows: the measured bucket, else a
        straight line between the nearest measured ones (beyond the largest: proportional,
        which overestimates, as a decode's cost grows slower than its batch)."""
        if batch <= 0 or not self.decode_ms:
            return 0.0
        bucket = batch_bucket(batch)
        if bucket in self.decode_ms:
            return self.decode_ms[bucket]
        below = [b for b in self.decode_ms if b < bucket]
        above = [b for b in self.decode_ms if b > bucket]
        if below and above:
            lo, hi = max(below), min(above)
            share = (bucket - lo) / (hi - lo)
            return self.decode_ms[lo] + share * (self.decode_ms[hi] - self.decode_ms[lo])
        if below:
            lo = max(below)
            return self.decode_ms[lo] * bucket / lo
        return self.decode_ms[min(above)]

    def prefill(self, num_tokens: float) -> float:
        return (self.prefill_ms_per_token or 0.0) * num_tokens

    def step(self, num_decodes: int, num_prefill_tokens: float) -> float:
        return self.decode(num_decodes) + self.prefill(num_prefill_tokens)

    def request(self, load: int, prefill_chunk: int, static: bool) -> float:
        """Join to finish of a typical request with `load` requests running beside it (itself
        included): its prefill steps, then one step per generated token; every step carries
        the decodes of the others and their share of prefill."""
        others_prefill = self.prefill_tokens_per_step or 0.0
        decode_step = self.step(load, others_prefill)
        prefill_steps = math.ceil(self.prompt_tokens / prefill_chunk)
        completion = self.batch_completion_tokens if static else self.completion_tokens
        return prefill_steps * decode_step + self.prefill(self.prompt_tokens) + completion * decode_step
