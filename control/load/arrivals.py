"""Arrival shapes, drawn the same by the simulator and the load generator: the offered
rate over time of each profile (`rate_profile`), and users in typing sessions
(`typing_sessions`), one request per pause between keystrokes, each superseding the one
before it in its session. numpy only: the simulator imports this with the policy code."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from control.core.vocab import ARRIVALS, ArrivalProfile


@dataclass(frozen=True)
class FlatRate:
    """A constant offered rate."""

    rps: float

    def __call__(self, t_s: np.ndarray) -> np.ndarray:
        return np.full_like(t_s, self.rps)


def rate_profile(profile: ArrivalProfile, rps: float, seconds: float) -> Any:
    """Offered rate over time: flat, flat with bursts, or one day compressed into the run."""
    if profile in ("poisson", "typing"):
        return FlatRate(rps)
    if profile == "bursts":  # 3x the rate for 2 s out of every 20 s
        return lambda t: np.where((t % 20.0) >= 18.0, 3.0 * rps, rps)
    if profile == "diurnal":  # night at 20% of the peak, the peak (= rps) at mid-run
        return lambda t: rps * (0.2 + 0.8 * (1.0 - np.cos(2.0 * np.pi * t / seconds)) / 2.0)
    raise ValueError(f"profile must be one of {', '.join(ARRIVALS)}, not {profile!r}")


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
