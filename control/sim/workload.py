"""A run's requests: when each is sent, its tier, model, region, session and sizes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from control.core.vocab import ARRIVALS, ArrivalProfile
from control.load.arrivals import FlatRate, rate_profile, typing_sessions

PROFILES = ARRIVALS  # the arrival shapes a workload can have


@dataclass
class Workload:
    """Every request of a run, in order of sending; arrays indexed by request."""

    t_ms: np.ndarray  # float64: when the client sent it (= reached a gateway; network is added apart)
    paid: np.ndarray  # bool
    model: np.ndarray  # int8: index into the model list
    region: np.ndarray  # int8
    prev: np.ndarray  # int32: the request of the same typing session this one supersedes, or -1
    prompt_tokens: np.ndarray  # int16
    output_tokens: np.ndarray  # int16

    def __len__(self) -> int:
        return len(self.t_ms)


def _times(rate_fn: Any, seconds: float, rng: np.random.Generator, bin_ms: float = 10.0) -> np.ndarray:
    """Arrival times (ms) of a Poisson process whose rate (req/s) follows `rate_fn(t_s)`."""
    if isinstance(rate_fn, FlatRate):  # exponential gaps: in order as drawn, no sort
        mean_gap_ms = 1000.0 / rate_fn.rps
        gaps = rng.exponential(mean_gap_ms, int(seconds * 1000.0 / mean_gap_ms * 1.01 + 100))
        t = np.cumsum(gaps)
        while t[-1] < seconds * 1000.0:  # rare: the draw ran short; draw on
            t = np.r_[t, t[-1] + np.cumsum(rng.exponential(mean_gap_ms, len(t) // 10 + 100))]
        return t[: np.searchsorted(t, seconds * 1000.0)]
    edges = np.arange(0.0, seconds * 1000.0, bin_ms)
    rates = np.maximum(np.asarray(rate_fn(edges / 1000.0), dtype=float), 0.0)
    counts = rng.poisson(rates * bin_ms / 1000.0)
    starts = np.repeat(edges, counts)
    return np.sort(starts + rng.uniform(0.0, bin_ms, len(starts)))


def make_workload(
    rps: float,
    seconds: float,
    *,
    profile: ArrivalProfile = "poisson",
    paid_fraction: float = 0.2,
    model_shares: list[float] | None = None,
    regions: int = 1,
    seed: int = 0,
    keystrokes: float = 6.0,
    pause_ms: float = 350.0,
) -> Workload:
    """Requests for a run. `typing`: sessions of `keystrokes` requests on average, one every
    typing pause (100 ms + exponential `pause_ms`); a session's next request supersedes
    its previous one. A session keeps its tier, model and region."""
    rng = np.random.default_rng(seed)
    shares = np.asarray(model_shares or [1.0], dtype=float)
    shares = shares / shares.sum()
    if profile == "typing":
        typing = typing_sessions(rng, rps, seconds, keystrokes, pause_ms)  # what `keybatch load` sends
        num_sessions, prev = typing.num_sessions, typing.prev
        session_paid = rng.random(num_sessions) < paid_fraction
        session_model = rng.choice(len(shares), num_sessions, p=shares)
        session_region = rng.integers(0, regions, num_sessions)
        t, sess = typing.t_ms, typing.session
        paid, model, region = session_paid[sess], session_model[sess], session_region[sess]
    else:
        t = _times(rate_profile(profile, rps, seconds), seconds, rng)
        n = len(t)
        prev = np.full(n, -1, dtype=np.int32)
        paid = rng.random(n) < paid_fraction
        model = rng.choice(len(shares), n, p=shares)
        region = rng.integers(0, regions, n)
    n = len(t)
    # max_tokens log-uniform 4..128 (as `keybatch bench policies`), prompts 100-500 tokens
    outputs = np.exp(rng.uniform(np.log(4), np.log(129), n)).astype(np.int16)
    prompts = rng.integers(100, 501, n).astype(np.int16)
    return Workload(  # copy=False: tens of millions of requests are not copied for nothing
        t.astype(np.float64, copy=False),
        paid.astype(bool, copy=False),
        model.astype(np.int8, copy=False),
        region.astype(np.int8, copy=False),
        prev.astype(np.int32, copy=False),
        prompts,
        outputs,
    )


# -- configuration ---------------------------------------------------------------------------
