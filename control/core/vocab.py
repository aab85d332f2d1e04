"""The closed vocabularies, each named once: service tiers, batching policies, engine
backends, the reasons a request ends that cross processes, the arrival shapes of a load
and the completion-length range of the workloads. Its own module, so policy code can name
them without importing the settings (and through them a Redis client)."""

from typing import Literal, get_args

Tier = Literal["paid", "free"]
TIERS: tuple[Tier, ...] = get_args(Tier)
PAID, FREE = TIERS

Policy = Literal["static", "continuous"]
POLICIES: tuple[Policy, ...] = get_args(Policy)

Backend = Literal["fixed", "hf"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)

# Why a request left the queue unanswered by a model; the replica tells the gateway.
# expired: past its deadline; gone: the client hung up; retried: a retry on another
# gateway took the request over; unavailable: the broker stopped answering; no_replica:
# the model lost its last replica while the request waited.
DropReason = Literal["cancelled", "superseded", "expired", "gone", "retried", "unavailable", "no_replica", "bumped"]
DROP_REASONS: tuple[DropReason, ...] = get_args(DropReason)
# Those a replica counts in its registry entry, as `dropped_<reason>`.
COUNTED_DROPS: tuple[DropReason, ...] = ("cancelled", "superseded", "expired", "gone")
# Why a completion ended: a stop sequence, or its max_tokens.
FinishReason = Literal["stop", "length"]
FINISH_REASONS: tuple[FinishReason, ...] = get_args(FinishReason)

# Arrival shapes of a load, the same in the simulator and the load generator.
ArrivalProfile = Literal["poisson", "bursts", "diurnal", "typing"]
ARRIVALS: tuple[ArrivalProfile, ...] = get_args(ArrivalProfile)

# Completion lengths of the workloads: max_tokens is drawn log-uniform in this range.
MIN_TOKENS, MAX_TOKENS = 4, 128
