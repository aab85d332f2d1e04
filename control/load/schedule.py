"""A load run's schedule, drawn before the run from its seed: arrival times, tiers and model mixes."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np

from control.core.vocab import FREE, PAID
from control.load.arrivals import rate_profile, typing_sessions
from control.load.spec import Arrival, LoadSpec


def mix_at(spec: LoadSpec, at_s: float) -> dict[str, float]:
    """Each model's share of the requests sent at `at_s`."""
    start = spec.models or {spec.model: 1.0}
    if spec.shift_to is None:
        return start
    if spec.shift_over_s > 0:
        moved = min(1.0, max(0.0, (at_s - spec.shift_from_s) / spec.shift_over_s))
    else:
        moved = 1.0 if at_s >= spec.shift_from_s else 0.0
    names = list(start) + [m for m in spec.shift_to if m not in start]
    return {m: (1 - moved) * start.get(m, 0.0) + moved * spec.shift_to.get(m, 0.0) for m in names}


def _pick(mix: dict[str, float], rng: random.Random) -> str:
    names = list(mix)
    return names[0] if len(names) == 1 else rng.choices(names, weights=list(mix.values()))[0]


def rate_fn(spec: LoadSpec) -> Callable[[float], float]:
    """The offered rate (req/s) at a second of the run: the simulator's profile, and the spike."""
    profile = rate_profile("poisson" if spec.arrivals == "typing" else spec.arrivals, spec.rps, spec.duration_s)

    def rate(at_s: float) -> float:
        if spec.spike_rps and spec.spike_from_s <= at_s < spec.spike_to_s:
            return spec.spike_rps
        return float(profile(np.float64(at_s)))

    return rate


def thinned_times(
    rate: Callable[[float], float], seconds: float, rng: random.Random, grid_s: float = 0.01
) -> list[float]:
    """Arrival times (s) of a Poisson process whose rate follows `rate`, by thinning: candidates
    at the peak rate, each kept with probability rate(t) / peak (Lewis and Shedler)."""
    peak = max(rate(k * grid_s) for k in range(int(seconds / grid_s) + 1))
    times: list[float] = []
    t = rng.expovariate(peak)
    while t < seconds:
        if rng.random() * peak < rate(t):
            times.append(t)
        t += rng.expovariate(peak)
    return times


def schedule(spec: LoadSpec) -> list[Arrival]:
    """Every request of the run, in order of sending; the same seed gives the same schedule."""
    tiers = random.Random(spec.seed)
    models = random.Random(spec.seed + 2)  # apart, so a mix leaves the arrivals and tiers as they were

    def tier() -> str:
        if spec.api_key:
            return "key"
        return PAID if tiers.random() < spec.paid_share else FREE

    if spec.arrivals == "typing":
        sessions = typing_sessions(
            np.random.default_rng(spec.seed), spec.rps, spec.duration_s, spec.keystrokes, spec.pause_ms
        )
        starts: dict[int, tuple[str, str]] = {}  # a session keeps its tier and model
        out = []
        for t_ms, session in zip(sessions.t_ms.tolist(), sessions.session.tolist(), strict=True):
            if session not in starts:
                starts[session] = (tier(), _pick(mix_at(spec, t_ms / 1000), models))
            out.append(Arrival(t_ms / 1000, *starts[session], session=session))
        return out
    if spec.arrivals == "poisson":  # flat: exponential gaps at the rate of the moment (the spike's)
        out, at_s = [], 0.0
        while at_s < spec.duration_s:
            out.append(Arrival(at_s, tier(), _pick(mix_at(spec, at_s), models)))
            at_s += tiers.expovariate(_rate(spec, at_s))
        return out
    times = thinned_times(rate_fn(spec), spec.duration_s, tiers)
    return [Arrival(t, tier(), _pick(mix_at(spec, t), models)) for t in times]


def _rate(spec: LoadSpec, at_s: float) -> float:
    return spec.spike_rps if spec.spike_rps and spec.spike_from_s <= at_s < spec.spike_to_s else spec.rps
