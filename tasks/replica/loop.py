"""The batching loop, one turn at a time: take, settle, run, deliver.

- take: one round trip checks the whole buffer (and what runs) for cancels and brings
  paid requests still in the queue; cancelled and expired requests leave, a batch is
  popped if one is due;
- settle: tell the waiting-room and the gateways which requests left the buffer, and
  claim the batch (a request another replica claimed first runs there);
- run: hand the batch to the engine's own thread (device.py): a static batch is staged
  to start the moment the engine frees, a continuous engine's joins go in before its
  next step;
- deliver: answer every finished request in one delivery script.

The engine never waits for these: the loop takes and settles the next batch while the
engine runs this one, and answers a finished batch while the next runs (an overlapped
cycle). Both policies run these same phases; `policies.py` holds only what differs.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import TYPE_CHECKING

from control.broker import records
from control.core import protocol as p
from control.core.vocab import FREE, PAID
from tasks.engine.contract import StepOutput
from tasks.policy import hedging
from tasks.policy.collector import Pending
from tasks.replica.broker import BrokerError
from tasks.replica.intake import Intake, held
from tasks.replica.lease import monotonic_ms
from tasks.replica.operations import Operations
from tasks.replica.policies import ContinuousPolicy, Finished, Policy, StaticPolicy

if TYPE_CHECKING:
    from tasks.replica.core import ReplicaCore

log = logging.getLogger(__name__)

# With other cells to answer through: a broker that failed a call this recently is not
# waited on (its bound) before a batch's answers go through another cell.
BROKER_DOUBT_MS = 1000.0

# Why a buffered request left with no notice: it can no longer finish a batch here, and a
# copy of it runs on another host's replica, which may still answer it in time.
TO_COPY = "to_copy"
# How far past the take's start its expiry check may fall (the round trip between): the
# requests that may expire at the take are the ones whose copy keys it reads.
EXPIRY_LOOKAHEAD_MS = 50.0


class Loop:
    def __init__(self, replica: ReplicaCore, intake: Intake, ops: Operations) -> None:
        self.replica = replica
        self.intake = intake
        self.ops = ops
        self.policy: Policy = (
            ContinuousPolicy(replica, self) if replica.engine.continuous else StaticPolicy(replica, self, intake.hold)
        )
        self.in_hand: list[Pending] = []  # taken from the buffer, not yet answered nor in the engine
        intake.copyable = replica.config.hedge != "off" and not replica.engine.continuous
        self.copies_while_idle = intake.copyable and replica.config.hedge_idle
        self._looked_ms = 0.0  # when an idle turn last looked for copies to run

    def run(self) -> None:
        r = self.replica
        while (due := self.policy.wait()) is not None:
            self.in_hand = []
            try:
                r.renew_lease_if_due()
                self.ops.check_drained()
                r.collector.config.batch_ms = self.policy.batch_ms()  # measured, where the engine can
                self.policy.finish()
                if due and self.policy.takes():
                    started = monotonic_ms()  # the take's start: a policy times its lead from it
                    self.in_hand, dropped, rest = self.take()
                    self.in_hand = self.settle(self.in_hand, dropped, rest)
                    self.policy.run(self.in_hand, started)
                elif self._may_copy_while_idle():
                    started = monotonic_ms()
                    self.in_hand = self.copy_while_idle()
                    self.policy.run(self.in_hand, started)
            except Exception as exc:  # Redis away, a bad message: never let the loop die
                if isinstance(exc, BrokerError):
                    r.doubt.failed()
                log.exception("batching loop error; %d requests in hand, %d running", len(self.in_hand), len(r.joined))
                self.fail()
                r.stopped.wait(0.1)
        self.policy.close()

    # -- take ----------------------------------------------------------------------

    def take(self) -> tuple[list[Pending], dict[str, list[Pending]], list[Pending]]:
        """The batch, what left the buffer (by reason), and what the batch leaves that goes
        back to the queue (`Policy.pop_rest`)."""
        r = self.replica
        with r.cond:
            ids = r.collector.ids()
            room, behind, fill = self.policy.room() if r.is_taking() else (0, 0, 0)
            expiring = r.collector.expiring_ids(r.clock.now_ms() + EXPIRY_LOOKAHEAD_MS) if self.intake.copyable else []
        # One round trip: cancels for the whole buffer and what runs, and requests still in
        # the queue: paid ones that would otherwise ride behind free ones already buffered
        # (and free ones in line behind buffered requests of a tenant beyond its share), and
        # any, paid first, for the seats the buffer leaves empty; and whether a copy runs of
        # what may expire here.
        spreads = self.policy.spreads()
        reasons, late_paid, launches, copies = r.broker.take(
            r.model, ids + list(r.joined), room, behind, fill, spreads, expiring
        )
        now = r.clock.now_ms()
        self._abort_gone_running(reasons, now)
        with r.cond:
            dropped = self._add_late_paid_and_drop_gone(late_paid, reasons, now, copies)
            if launches is not None:  # the peers' phases as of now: a batch not full waits for its own
                r.gate.peers(launches=launches)
                r.collector.stagger_from(r.gate.peer_launches, r.collector.last_batch, now)
            batch = self.policy.pop(now)
            rest = self.policy.pop_rest(batch)
        if late_paid:  # those launched now are recorded by the launch itself (`settle`), those
            gone = {pending.id for pending in batch + rest}  # handed back by the next taker
            self.policy.record([job for job, _raw in late_paid if job.id not in gone])
        return batch, {reason: group for reason, group in dropped.items() if group}, rest

    def _add_late_paid_and_drop_gone(
        self, late_paid: list[tuple[p.Job, str]], reasons: dict[str, str], now_ms: float, copies: set[str]
    ) -> dict[str, list[Pending]]:
        """Under the lock: paid requests taken late join the buffer; cancelled and expired
        ones leave it (returned by reason). One that can no longer finish a batch here but
        has a copy running elsewhere leaves as `TO_COPY`: the copy may still answer it in time."""
        collector = self.replica.collector
        dropped: dict[str, list[Pending]] = defaultdict(list)
        for job, raw in late_paid:
            collector.add(self.intake.pending(job, raw))
        for pending in collector.remove(set(reasons)):
            dropped[reasons[pending.id]].append(pending)
        for pending in collector.pop_expired(now_ms):
            dropped[TO_COPY if pending.id in copies else "expired"].append(pending)
        return dropped

    def _abort_gone_running(self, reasons: dict[str, str], now_ms: float) -> None:
        """A running request whose client went (or whose deadline passed) leaves at this
        step: its slot is free for the next request (continuous: a static batch runs
        nothing between its batches)."""
        r = self.replica
        gone: dict[str, list[Pending]] = defaultdict(list)
        running = max(1, len(r.joined))
        for attempt, (pending, joined) in list(r.joined.items()):
            reason = reasons.get(attempt) or ("expired" if now_ms > pending.deadline_ms else None)
            if reason is None:
                continue
            r.stats.waste(1, max(0.0, now_ms - joined) / running)  # ran until now for nobody
            self.policy.abort([attempt])
            del r.joined[attempt]
            r.streams.forget(attempt)
            gone[reason].append(pending)
        if not gone:
            return
        notices = [p.Dropped(id=pd.id, reason=reason, replica=r.name) for reason, group in gone.items() for pd in group]
        r.broker.reply(notices, [held(pd).job for group in gone.values() for pd in group])
        self._count_dropped(gone)

    def _count_dropped(self, dropped: dict[str, list[Pending]]) -> None:
        for reason, group in dropped.items():
            self.replica.stats.dropped[reason] += len(group)
            if reason != TO_COPY:  # its copy's replica reports how it ends
                self.replica.events.revoked(group, reason)

    # -- settle ----------------------------------------------------------------------

    def settle(self, batch: list[Pending], dropped: dict[str, list[Pending]], rest: list[Pending]) -> list[Pending]:
        """Tell the waiting-room and the gateways which requests left the buffer, hand back
        `rest` to the front of the queue, and claim the batch; returns the part of it this
        replica may run. If the broker fails, `rest` stays buffered here."""
        r = self.replica
        if not batch and not dropped:
            return batch
        claim, finish = None, None
        if batch:
            now = r.clock.now_ms()
            claim = (r.lease_ms(), int(max(pd.deadline_ms for pd in batch) - now) + 1000, now)
            finish = self.policy.hedge_finish_ms(now) if r.config.hedge != "off" else None
        scan_from = None if finish is None else finish + r.collector.config.margin_ms
        try:
            settled = r.broker.settle(
                r.model,
                [(held(pd).job, held(pd).message) for pd in batch],
                [(held(pd).job, reason) for reason, group in dropped.items() if reason != TO_COPY for pd in group],
                claim,
                scan_from,
                self._running_members(batch) if scan_from is not None else (),
                [held(pd).job for pd in rest],
                [held(pd).job for pd in dropped.get(TO_COPY, [])],
                r.host() if self.intake.copyable else None,
            )
        except BrokerError:
            self._keep_buffered(rest)
            if r.fallback is None or not batch:
                raise
            # The broker went with the batch in hand: run it unclaimed and answer through
            # another cell. Its gateways may run a request again elsewhere too; the first
            # answer wins.
            r.doubt.failed()
            log.warning("the broker did not take the claim of %d requests: running them all the same", len(batch))
            settled = None
        if settled is not None:
            r.stats.rest_handed_back += len(rest)
            r.gate.peers(idle=settled.peers_idle, launches=settled.launches)
            batch = self._keep_claimed(batch, settled.claimed)
            if finish is not None and batch:
                batch = batch + self.hedge(batch, settled.running, finish)
        self._count_dropped(dropped)
        return batch

    def _keep_buffered(self, rest: list[Pending]) -> None:
        """The hand-back did not reach the broker: what it held waits here for the next
        batch (a late paid request among it is recorded as held now)."""
        if not rest:
            return
        with self.replica.cond:
            for pending in rest:
                self.replica.collector.add(pending)
        self.policy.record([held(pd).job for pd in rest if held(pd).message])

    def _running_members(self, batch: list[Pending]) -> list[tuple[str, float]]:
        """The batch's entries in the model's running set (member, deadline), written with
        its claim: what another host's batch may copy (`hedge`)."""
        r = self.replica
        host = r.host()
        members = []
        for pd in batch:
            job = held(pd).job
            if not job.stream:  # a stream's text must come from one run
                held(pd).member = records.pack_running(pd.id, r.name, host, pd.tier, job.max_tokens, job.key)
                members.append((held(pd).member, pd.deadline_ms))
        return members

    def hedge(self, batch: list[Pending], running: list[tuple[bytes, float]], finish_ms: float) -> list[Pending]:
        """Free-slot hedging: the batch's empty slots take second copies of requests running,
        or buffered for the next batch, on another host (tasks/policy/hedging.py); the
        copies to add to the batch. A copy is
        neither held nor claimed here: the first answer wins, the other is counted as a
        wasted hedge. One script call, only when there is something to copy."""
        r = self.replica
        # A copy no longer than the batch's own requests: it must not make the batch longer.
        longest = max(held(pd).job.max_tokens for pd in batch)
        candidates = _candidates(running, {pd.id for pd in batch}, longest)
        room = r.collector.config.max_batch - len(batch)
        margin = r.collector.config.margin_ms
        return self._take_copies(hedging.pick(r.config.hedge, room, r.host(), finish_ms, margin, candidates), 0)

    def _take_copies(self, chosen: list[hedging.Candidate], least_idle: int) -> list[Pending]:
        """Second copies of the `chosen` requests (`hedging.pick`), as the HEDGE script
        lets this replica take them."""
        r = self.replica
        if not chosen:
            return []
        try:
            taken = r.broker.hedge(r.model, [c.key for c in chosen], least_idle)
        except BrokerError:
            r.doubt.failed()
            log.warning("could not take second copies of requests running elsewhere")
            return []
        copies = []
        for job, _raw in taken:
            pending = self.intake.pending(job)
            held(pending).copy = True
            copies.append(pending)
        r.stats.hedged += len(copies)
        return copies

    # -- copies while idle (HEDGE_IDLE) ----------------------------------------------------

    def _may_copy_while_idle(self) -> bool:
        """Idle, nothing buffered, not the replica that listens for the model's arrivals,
        and not looked in the last `hedging.IDLE_LOOK_MS`."""
        r = self.replica
        if not self.copies_while_idle or r.busy or not r.is_taking() or self.policy.running():
            return False
        if r.config.single_listener and r.gate.listens:
            return False
        now = monotonic_ms()
        if now - self._looked_ms < hedging.IDLE_LOOK_MS:
            return False
        with r.cond:
            if len(r.collector):
                return False
        self._looked_ms = now
        return True

    def copy_while_idle(self) -> list[Pending]:
        """A batch of second copies of requests running on other hosts, on this idle
        replica, while enough replicas of the model stay idle for new arrivals
        (`hedging.idle_mode`): at low load no batch runs that a copy could ride, and a
        lost host's batch would end 504 (it is noticed only when its lease lapses); at
        normal load, of paid requests only, gathered into a full batch unless one cannot
        wait. Only requests whose batch runs: one buffered starts soon where it is."""
        r = self.replica
        if r.doubt.skips():
            return []
        now = r.clock.now_ms()
        batch_ms = r.engine.expected_batch_ms()
        finish = now + batch_ms  # the engine is idle: it starts now
        try:
            work = r.broker.copy_work(r.model, now, finish + r.collector.config.margin_ms)
        except BrokerError:
            r.doubt.failed()
            log.warning("could not look for requests to copy while idle")
            return []
        mode, least_idle, gather = hedging.idle_mode(r.config.hedge, work.idle, work.launched)
        if mode == "off":
            return []
        room, margin = r.collector.config.max_batch, r.collector.config.margin_ms
        chosen = hedging.pick(mode, room, r.host(), finish, margin, _candidates(work.running, set(), None))
        if not chosen:
            return []
        # Paid copies at normal load gather: a full batch, or one that cannot wait.
        if gather and not hedging.copies_due(chosen, room, now, batch_ms, margin, hedging.look_ms(r.config.lease_ms)):
            return []
        # Busy before the take: the gate shuts (what a pull already out brings goes back to
        # the queue) and the listener's turn passes on, so no arrival waits behind copies.
        with r.cond:
            if len(r.collector) or r.busy or (r.config.single_listener and r.gate.listens):
                return []
            r.start_batch(now, batch_ms)
        copies = self._take_copies(chosen, least_idle)
        with r.cond:
            if not copies:
                r.busy = False
                return []
            r.batch_started = monotonic_ms()
        r.stats.idle_copy_batches += 1
        return copies

    def _keep_claimed(self, batch: list[Pending], claimed: list[bool]) -> list[Pending]:
        """A request another live replica claimed first (a re-queued copy) runs there."""
        r = self.replica
        if all(claimed):
            return batch
        lost = [pd.id for pd, ok in zip(batch, claimed, strict=True) if not ok]
        log.info("%d requests of the batch run on another replica", len(lost))
        r.broker.forget_held(lost)
        kept = [pd for pd, ok in zip(batch, claimed, strict=True) if ok]
        if not kept and not r.engine.continuous and not self.policy.running():  # continuous: after its turn
            r.busy = False
            r.rejoin_idle()  # `settle` took it out of the idle list for a batch it does not run
        return kept

    # -- deliver -------------------------------------------------------------------------

    def deliver(self, finished: list[Finished], batch_size: int, end: float, ends_batch: bool) -> None:
        """Answer every finished request in one pipeline; at the end of a static batch the
        replica is idle again and times its next batch from its peers' launches."""
        r = self.replica
        jobs = [held(pending).job for pending, _out, _start in finished]
        items = [self.result(held(pd).job, out, batch_size, start, end, held(pd).copy) for pd, out, start in finished]
        copies = [held(pd).copy for pd, _out, _start in finished]
        members = [held(pd).member for pd, _out, _start in finished if held(pd).member]
        for job in jobs:
            r.streams.forget(job.id)
        idle_until = r.idle_until_ms() if ends_batch else None
        # Another cell takes answers without the owner's check: never a copy's failure there.
        kept = [i for i, item in enumerate(items) if not (copies[i] and item.kind == "failed")]
        spare = ([items[i] for i in kept], [jobs[i] for i in kept])
        sent = False
        if r.fallback is not None and r.doubt.failed_within(BROKER_DOUBT_MS):
            sent = r.fallback.send(*spare)  # first: the broker's own answer may be a bound away
        try:
            answered = r.broker.deliver(r.model, items, jobs, end, r.lease_ms(), idle_until, copies, members)
        except BrokerError:
            r.doubt.failed()
            if not sent and (r.fallback is None or not r.fallback.send(*spare)):
                raise
            log.warning("the broker did not take %d answers: sent through another cell", len(items))
            r.stats.ran(len(jobs), batch_size)
            return
        if finished:
            share = sum((end - start) / batch_size for _pd, _out, start in finished) / len(finished)
            r.stats.waste(answered.wasted, share)
        r.stats.hedge_wins += answered.hedge_wins
        r.stats.hedge_wasted += answered.hedge_wasted
        r.stats.ran(len(jobs) - sum(copies), batch_size)
        if answered.launches is not None:
            r.gate.peers(launches=answered.launches)

    def result(
        self, job: p.Job, out: StepOutput, batch_size: int, start: float, end: float, copy: bool = False
    ) -> p.Result | p.Failed:
        r = self.replica
        if out.error:
            return p.Failed(
                id=job.id,
                message=out.error,
                replica=r.name,
                per_request=True,
                code=out.code,
                status=out.http_status,
            )
        return p.Result(
            id=job.id,
            text=out.text,
            finish_reason=out.finish_reason or "length",
            prompt_tokens=out.prompt_tokens,
            completion_tokens=out.completion_tokens,
            replica=r.name,
            backend=r.engine.name,
            batch_size=batch_size,
            batch_start_ms=start,
            batch_end_ms=end,
            hedged=copy,
        )

    # -- the one fail path -------------------------------------------------------------

    def fail(self) -> None:
        """The turn failed: answer what is in hand and what runs (503, retry), empty the
        engine and take the replica out of busy."""
        r = self.replica
        running = [pending for pending, _start in r.joined.values()]
        self.policy.abort(list(r.joined))
        r.joined.clear()
        r.streams.clear()
        batch = [pd for pd in self.in_hand if pd.id not in {rp.id for rp in running}] + running
        self.in_hand = []
        r.busy = self.policy.running()  # a static batch on the engine goes on
        if not batch:
            return
        try:
            self._answer_failed(batch, "replica error")
        except Exception:
            log.exception("could not tell the gateways; their requests end at their deadlines")

    def _answer_failed(self, batch: list[Pending], message: str) -> None:
        r = self.replica
        jobs = [held(pending).job for pending in batch]
        failures = [p.Failed(id=job.id, message=message, replica=r.name) for job in jobs]
        running = self.policy.running()
        copies = [held(pending).copy for pending in batch]  # a copy's failure is not its request's
        r.broker.reply(failures, jobs, idle=None if running else (r.model, r.idle_until_ms()), copies=copies)
        r.busy = running
        r.wake()
        r.events.failed(batch, message)


def _candidates(running: list[tuple[bytes, float]], exclude: set[str], longest: int | None) -> list[hedging.Candidate]:
    """The running set's members a copy may be made of: not in `exclude`, and no longer than
    `longest` tokens where a batch must not run longer for a copy."""
    candidates = []
    for raw, deadline in running:
        try:
            entry = records.parse_running(raw)
        except ValueError:
            continue  # another version's member: it leaves the set at its deadline
        if entry.attempt not in exclude and (longest is None or entry.max_tokens <= longest):
            tier = PAID if entry.tier == PAID else FREE
            candidates.append(hedging.Candidate(raw.decode(), tier, deadline, entry.host))
    return candidates
