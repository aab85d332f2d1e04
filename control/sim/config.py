"""What a simulated run is: the fleet, the policy's knobs, the budget and the faults."""

from __future__ import annotations

from dataclasses import dataclass, field

from control.sim.cost import CostModel
from tasks.policy.collector import REST_HORIZON
from tasks.policy.hedging import HedgeMode


@dataclass
class SimConfig:
    replicas: list[int]  # per model: replicas in each region
    models: list[str] = field(default_factory=lambda: ["kb-small"])
    regions: int = 1
    max_batch: int = 64
    batch_ms: float = 250.0  # fixed batch time, unless `costs` gives a model a curve
    # A fixed batch takes batch_ms plus up to this much more (uniform); admission then paces
    # slots by the mean, as a live gateway paces them by the cycle its replicas measure.
    batch_jitter_ms: float = 0.0
    costs: dict[str, CostModel] = field(default_factory=dict)
    policy: str = "static"  # or "continuous": tasks/policy/scheduler.py plans each step, a cost model prices it
    max_wait_ms: float = 20.0
    pull_lead_ms: float = 40.0
    pull_early: bool = False  # PULL_EARLY: a busy replica that frees first pulls before its lead too
    # SINGLE_LISTENER: an arrival goes to an idle replica already gathering a batch (its
    # buffer not empty), not to the next idle one in the BRPOP line, so idle replicas do
    # not split arrivals and start small batches together (live, the one idle replica that
    # holds the model's listener token waits on the queue, and hands it on at its start).
    concentrate_idle: bool = False
    # LEAD_YIELDS (with `concentrate_idle`): a busy replica pulls in its lead only while no
    # peer is idle (read as its lead starts), so the arrivals go to the idle one gathering.
    lead_yields: bool = True
    margin_ms: float = 15.0
    budget_ms: float = 540.0  # the client's deadline at the gateway (the SLO less the network)
    max_queue_paid: int = 4096
    max_queue_free: int = 2048
    admission_refresh_ms: float = 10.0  # how often a group's admission limits are worked out again
    # ADMIT_PHASED: below capacity, admission counts the starts the replicas' phases hold
    # (read every `launch_refresh_ms`, as a gateway reads the launch list), where they hold
    # more than the worst phase does.
    admit_phased: bool = False
    # ADMIT_BUMP: a free request is admitted with no room kept for paid arrivals; a paid one
    # waits behind paid ones only, and the first free request in the queue it would push
    # past its last start leaves, refused 429 ("bumped").
    admit_bump: bool = False
    # ADMIT_OPEN: while the demand over the last seconds is below the replicas' rate
    # (`admission.is_open`), a request is admitted as deep as the best phase allows.
    admit_open: bool = True
    launch_refresh_ms: float = 50.0
    host_size: int = 8  # replicas a host carries (a group's replicas fill hosts in turn)
    # Free-slot hedging (tasks/policy/hedging.py): a static batch's empty slots carry
    # copies of requests running on another host's replicas, or buffered there for their
    # next batch: "off", "paid" or "all". `hedge_buffered` False copies running ones only
    # (the rule before buffered requests were copied live too, for comparison).
    hedge: HedgeMode = "off"
    hedge_buffered: bool = True
    # HEDGE_IDLE: an idle replica that does not listen for arrivals, while enough of its
    # model's replicas stay idle (`hedging.idle_mode`), runs a batch of copies of requests
    # whose batch runs on another host; it looks every `hedging.look_ms` while idle.
    hedge_idle: bool = False
    host_loss_at_s: float | None = None  # one host of the first group dies then
    # Which: the first (its replicas first in the BRPOP line), or the one whose replicas
    # run and hold the most requests then (a single loss of an idle host costs nothing, and
    # which host is idle at a moment is chance).
    host_loss_busiest: bool = False
    restart_s: float = 5.0  # and is back this long after
    detect_ms: float = 400.0  # lease (300 ms) lapsed + the next sweep (every 100 ms)
    lease_ms: float = 300.0  # a lost replica's requests may be copied until its lease lapses
    # What a lost replica's last pull took goes back to the queue this long after the loss
    # at the soonest: its pulse lapses (60-100 ms), a gateway's health loop sees the death
    # (every 100 ms) and RESCUE's two looks, 30 ms apart, find it unrecorded.
    rescue_ms: float = 160.0
    region_loss_at_s: float | None = None  # region 0 is lost then
    resend_ms: float = 100.0  # a client's retry of a lost region's request reaches another region
    # What a lost region had in flight reaches the other regions marked stranded
    # (`Pending.stranded`, X-Keybatch-Stranded live): a replica holding one gathers the
    # rest of the burst (`Collector.launch_at`) instead of starting its first few alone.
    stranded: bool = True
    # Broker cells of one region, played by the regions of the run: cell 0's broker is lost
    # then. What waits in it, or its replicas took and did not start, moves to the other
    # cells `cell_move_ms` later (the gateway's move); what they run is answered through
    # another cell; new requests go to the others.
    cell_loss_at_s: float | None = None
    cell_move_ms: float = 100.0
    # A BRPOP sent before the gate shut takes one more message (kombu lets it finish); the
    # replica then "hand_back"s it to the front of the queue (the live default), or "keep"s
    # it for its next batch (KEYBATCH_HAND_BACK_PULLS=0); "none": a gate that also stops a
    # BRPOP already sent (no such consumer exists; what the simulator did before).
    pull_in_flight: str = "hand_back"
    # What a static batch leaves in its replica's buffer goes back to the front of the queue
    # for a peer's start, and urgency looks less far (HAND_BACK_REST, off by default live too).
    hand_back_rest: bool = False
    rest_horizon: float = REST_HORIZON  # of a slot: how far urgency looks then
    # A replica whose last batch was full delays a due batch by a gap after a peer's latest
    # launch (`Collector.staggered_start_ms`), as a live one does. Off: it starts at once,
    # and saturated replicas start their batches in clumps.
    stagger_saturated: bool = True

    def __post_init__(self) -> None:
        if len(self.replicas) != len(self.models) or min(self.replicas) < 1:
            raise ValueError("one replica count (>= 1) per model")
        if self.hedge not in ("off", "paid", "all"):
            raise ValueError(f"hedge must be off, paid or all, not {self.hedge!r}")
        if not 0 < self.lease_ms <= self.detect_ms:
            raise ValueError("a lease lapses before its loss is detected (0 < lease_ms <= detect_ms)")
        if self.policy not in ("static", "continuous"):
            raise ValueError(f"policy must be static or continuous, not {self.policy!r}")
        if self.policy == "continuous" and set(self.models) - set(self.costs):
            raise ValueError("the continuous policy needs a cost model (an engine curve) for every model")
        if self.pull_in_flight not in ("hand_back", "keep", "none"):
            raise ValueError(f"pull_in_flight must be hand_back, keep or none, not {self.pull_in_flight!r}")
        if self.regions < 1 or (self.region_loss_at_s is not None and self.regions < 2):
            raise ValueError("region loss needs at least two regions")


# -- the simulated parts ---------------------------------------------------------------------
