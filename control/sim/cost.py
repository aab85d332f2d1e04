"""What a batch costs: the engine's measured curve, and the request mix it is priced at."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from control.core.vocab import MAX_TOKENS, MIN_TOKENS

MEAN_OUTPUT_TOKENS = (MAX_TOKENS - MIN_TOKENS) / math.log(MAX_TOKENS / MIN_TOKENS)  # log-uniform
CONTEXT_TOKENS = 400.0  # a 100-500 token prompt and part of its answer


@dataclass(frozen=True)
class CostModel:
    """A batch's time from the engine's measured curve (`keybatch bench engine`'s JSON):
    decode step time by context and batch size, prefill time by prompt tokens."""

    decode_ms: dict[int, dict[int, float]]  # context tokens -> batch size -> ms per step
    prefill_ms: dict[int, float]  # prompt tokens -> ms for one request's prefill
    name: str = ""
    step_overhead_ms: float = 0.0  # a step's work besides its forwards (scheduling, sampling)

    @classmethod
    def from_file(cls, path: str | Path) -> CostModel:
        data = json.loads(Path(path).read_text())
        try:
            decode = {int(c): {int(b): float(ms) for b, ms in row.items()} for c, row in data["decode_ms"].items()}
            prefill = {int(t): float(ms) for t, ms in data["prefill_ms"].items()}
        except (KeyError, AttributeError, ValueError) as exc:
            raise ValueError(f"{path}: not an engine curve (decode_ms, prefill_ms): {exc}") from exc
        if not decode or not prefill:
            raise ValueError(f"{path}: empty decode_ms or prefill_ms")
        name = data.get("model", {})
        name = name.get("name", Path(path).stem) if isinstance(name, dict) else str(name)
        return cls(decode, prefill, str(name), float(data.get("step_overhead_ms", 0.0)))

    def as_json(self) -> dict[str, Any]:
        """What `from_file` reads."""
        return {
            "model": {"name": self.name},
            "decode_ms": {str(c): {str(b): ms for b, ms in row.items()} for c, row in self.decode_ms.items()},
            "prefill_ms": {str(t): ms for t, ms in self.prefill_ms.items()},
            "step_overhead_ms": self.step_overhead_ms,
        }

    def scaled(self, decode: float, prefill: float, step_overhead_ms: float | None = None) -> CostModel:
        """The same curve with every decode step and prefill taking these multiples, and
        each step `step_overhead_ms` besides its forwards (default: this curve's)."""
        return CostModel(
            {c: {b: ms * decode for b, ms in row.items()} for c, row in self.decode_ms.items()},
            {t: ms * prefill for t, ms in self.prefill_ms.items()},
            self.name,
            self.step_overhead_ms if step_overhead_ms is None else step_overhead_ms,
        )

    def step_ms(self, batch: int, context: float) -> float:
        """One decode step for `batch` rows at `context` tokens: interpolated in both, and
        made monotone in batch size (the measured table has noise from a shared machine)."""
        row = self.decode_ms[min(self.decode_ms, key=lambda c: abs(c - context))]
        sizes = sorted(row)
        times = np.maximum.accumulate([row[s] for s in sizes])  # a bigger batch never steps faster
        if batch > sizes[-1]:  # beyond the table: linear in rows
            return float(times[-1]) * batch / sizes[-1]
        return float(np.interp(batch, sizes, times))

    def prefill_ms_for(self, tokens: int) -> float:
        """One prompt's prefill, in chunks of the largest measured size, interpolated."""
        sizes = sorted(self.prefill_ms)
        chunk = sizes[-1]
        whole, rest = divmod(max(tokens, 1), chunk)
        total = whole * self.prefill_ms[chunk]
        if rest:
            total += float(np.interp(rest, sizes, [self.prefill_ms[s] for s in sizes]))
        return total

    def batch_ms(self, prompts: list[int], outputs: list[int]) -> float:
        """A static batch: every prompt prefilled, then the longest output's steps for all rows."""
        longest = max(outputs)
        context = sum(prompts) / len(prompts) + longest / 2
        step = self.step_ms(len(prompts), context) + self.step_overhead_ms
        return sum(self.prefill_ms_for(t) for t in prompts) + longest * step

    def expected_batch_ms(self, size: int, samples: int = 200, seed: int = 7) -> float:
        """The mean time of a batch of `size` requests from the workload's mix (what a replica
        on this engine publishes as its `batch_ms`: measured, not assumed)."""
        rng = np.random.default_rng(seed)
        total = 0.0
        for _ in range(samples):
            prompts = rng.integers(100, 501, size).tolist()
            outputs = np.exp(rng.uniform(np.log(4), np.log(129), size)).astype(int).tolist()
            total += self.batch_ms(prompts, outputs)
        return total / samples


# -- workload -------------------------------------------------------------------------------
