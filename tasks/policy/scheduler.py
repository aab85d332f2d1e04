"""Which waiting requests join an engine and what each running one computes in the next step.

Pure policy in the shape of nano-vllm's scheduler and vLLM v1's: the engine hands in
the waiting requests and the running ones, and gets back a `SchedulerOutput`. Each step
has a token budget; every decoding request costs one token of it, and what is left goes
to prefill chunks, so a long prompt holds the running decodes back by one chunk at most.

Two policies share it:

- continuous: requests join free slots between any two steps, paid before
  free, then in arrival order; a finished request leaves at once.
- static: requests join only an empty engine, and the batch stays (its
  finished requests included, as padded rows of `generate` do) until all have finished.

No torch here: the engine holds the tensors, this module only counts tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from control.core.vocab import FREE, PAID, POLICIES, Policy, Tier


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one engine; checks itself when built."""

    max_slots: int = 64  # the most requests running at once (rows of the KV cache)
    token_budget: int = 512  # tokens computed per step: one per decode, the rest for prefill
    prefill_chunk: int = 256  # the most prompt tokens one request prefills in a step
    policy: Policy = "continuous"
    # Each request's prefill is a forward of its own, with a fixed cost besides its tokens:
    # a burst of short prompts joining together would otherwise make one step of dozens
    # of forwards, stalling the running decodes (and the replica's lease) for its length.
    max_prefills: int = 8

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        if self.max_slots < 1:
            raise ValueError(f"max_slots must be at least 1, not {self.max_slots}")
        if self.prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, not {self.prefill_chunk}")
        if self.max_prefills < 1:
            raise ValueError(f"max_prefills must be at least 1, not {self.max_prefills}")
        # Every running request may decode in the same step; a request still prefilling
        # holds a slot no decode uses, so at least one token is left for it.
        if self.token_budget < self.max_slots:
            raise ValueError(
                f"token_budget ({self.token_budget}) must be at least max_slots ({self.max_slots}): "
                "a step decodes one token for each running request and prefills with the rest"
            )


@dataclass(frozen=True)
class WaitingRequest:
    """A request added to the engine and not yet given a slot."""

    id: str
    tier: Tier
    num_prompt_tokens: int
    arrival: int  # order of arrival in this engine (smaller came first)


@dataclass(frozen=True)
class RunningRequest:
    """A request holding a slot."""

    id: str
    num_prefill_left: int  # prompt tokens not yet in its KV cache; 0 once it decodes
    tier: Tier = FREE
    arrival: int = 0
    is_finished: bool = False  # static policy: finished, kept in the batch until the batch ends

    @property
    def is_decoding(self) -> bool:
        return self.num_prefill_left == 0


@dataclass
class SchedulerOutput:
    """One step's plan."""

    joined: list[str] = field(default_factory=list)  # waiting requests that take a slot now
    decodes: list[str] = field(default_factory=list)  # running requests that decode one token
    prefills: dict[str, int] = field(default_factory=dict)  # request id -> prompt tokens to prefill now
    released: list[str] = field(default_factory=list)  # finished requests whose slots free now

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(self.prefills.values())

    @property
    def is_empty(self) -> bool:
        return not (self.joined or self.decodes or self.prefills or self.released)


def _priority(request: WaitingRequest | RunningRequest) -> tuple[bool, int]:
    return request.tier != PAID, request.arrival


class ContinuousScheduler:
    """Joins, then the step's plan. `schedule` does both for an engine whose joining
    requests prefill their whole prompt; an engine that reuses cached prefixes calls
    `join`, learns how much of each prompt it already holds, then calls `plan`."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    @property
    def is_static(self) -> bool:
        return self.config.policy == "static"

    def release(self, running: list[RunningRequest]) -> list[str]:
        """Finished requests whose slots free now: at once (continuous), or all of them
        once every request of the batch has finished (static)."""
        finished = [r.id for r in running if r.is_finished]
        if self.is_static and len(finished) < len(running):
            return []
        return finished

    def join(self, waiting: list[WaitingRequest], num_running: int) -> list[str]:
        """Waiting requests that take a free slot now: paid first, then by arrival."""
        if self.is_static and num_running:
            return []
        free = self.config.max_slots - num_running
        return [r.id for r in sorted(waiting, key=_priority)[: max(0, free)]]

    def plan(self, running: list[RunningRequest]) -> SchedulerOutput:
        """Decodes first (one token each); the rest of the budget prefills, paid first."""
        decodes = [r.id for r in running if r.is_decoding]
        budget = self.config.token_budget - len(decodes)
        prefills: dict[str, int] = {}
        # A finished request never prefills; a static batch's finished rows still decode (padding).
        for request in sorted((r for r in running if not (r.is_decoding or r.is_finished)), key=_priority):
            if budget <= 0 or len(prefills) == self.config.max_prefills:
                break
            num_tokens = min(request.num_prefill_left, self.config.prefill_chunk, budget)
            prefills[request.id] = num_tokens
            budget -= num_tokens
        return SchedulerOutput(decodes=decodes, prefills=prefills)

    def schedule(self, waiting: list[WaitingRequest], running: list[RunningRequest]) -> SchedulerOutput:
        """Release, join and plan one step, every joining prompt to be prefilled whole."""
        released = self.release(running)
        gone = set(released)
        staying = [r for r in running if r.id not in gone]
        joining = self.join(waiting, len(staying))
        by_id = {r.id: r for r in waiting}
        joined = [RunningRequest(i, by_id[i].num_prompt_tokens, by_id[i].tier, by_id[i].arrival) for i in joining]
        out = self.plan(staying + joined)
        out.joined, out.released = joining, released
        return out
