"""The simulated replica's side of a run: its gate, its buffer, launching and ending batches, continuous steps."""

from __future__ import annotations

from bisect import bisect_left
from collections import deque

from control.core import protocol as p
from control.core.vocab import FREE, PAID, Tier
from control.sim.events import END, GATE, LAUNCH, LOOK, RESCUE, SimState
from control.sim.group import COPY, Group, SimReplica, is_copy
from control.sim.states import EXPIRED, LATE, OK, RUNNING, TIERS, WAITING
from tasks.policy import hedging
from tasks.policy.collector import Pending

# A replica's BRPOP returns empty after this long (`protocol.PULL_WAIT_S`), and is sent
# again at once while its gate lets it.
BRPOP_TIMEOUT_MS = p.PULL_WAIT_S * 1000.0
RESCUE_AFTER_MS = 30.0  # a RESCUE round's two looks are this far apart (api/gateway.py)
# A busy replica that yields its lead reads again this often whether a peer listens
# (tasks/replica/listener.py, `WAIT_S`).
LEAD_READ_MS = 40.0


class ReplicaSide(SimState):
    """The replica: gate, buffer, launch, end."""

    def _wants(self, replica: SimReplica) -> bool:
        """`Replica.wants_messages`."""
        if not replica.alive:
            return False
        if replica.engine is not None:
            return replica.gate.wants_continuous(len(replica.collector.waiting), replica.engine.free_slots())
        return replica.gate.wants(self.now, len(replica.collector.waiting), replica.group.batch_ms)

    def _in_flight(self, replica: SimReplica) -> bool:
        """Has the consumer a BRPOP out that its gate did not stop? kombu lets a BRPOP sent
        before the gate shut take one more message (`tasks.kombu_internals.gate_pulls`),
        unless the BRPOP's own timeout came first."""
        return (
            self.config.pull_in_flight != "none"
            and replica.alive
            and self.now - replica.asked_at < BRPOP_TIMEOUT_MS
            and replica in replica.group.blocked
        )

    def _last_sent(self, replica: SimReplica) -> None:
        """A consumer blocked in BRPOP since `asked_at` sent it again each time it timed
        out: the one out now was sent at the last of those."""
        replica.asked_at = self.now - (self.now - replica.asked_at) % BRPOP_TIMEOUT_MS

    def _lost_pull(self, replica: SimReplica, j: int) -> bool:
        """The BRPOP a lost replica had out when it stopped takes the message `j` if it
        has not timed out yet: the broker hands it over, and nothing records it. A
        gateway's RESCUE round pushes it back to the front of the queue once the
        replica's pulse has lapsed (`rescue_ms` after the loss), or 30 ms after it was
        taken, the second of two looks (api/gateway.py). False: the pull had timed out,
        and the replica leaves the line."""
        blocked = replica.group.blocked
        blocked.remove(replica)
        if self.config.pull_in_flight == "none" or self.now - replica.asked_at >= BRPOP_TIMEOUT_MS:
            return False
        at = max(self.died_at.get(replica.index, self.now) + self.config.rescue_ms, self.now + RESCUE_AFTER_MS)
        self._push(at, RESCUE, replica.group, j)
        self.stats["taken_lost"] += 1
        return True

    def _shut(self, replica: SimReplica, in_flight: bool = False) -> None:
        """The gate said no: the consumer stops asking, with a timer if it reopens by itself.
        `in_flight`: the gate shut on the replica's side (a batch started) while its BRPOP
        was out: that BRPOP still takes one message."""
        blocked = replica.group.blocked
        if in_flight and replica.alive and replica in blocked:
            self._last_sent(replica)
        if in_flight and self._in_flight(replica):
            pass
        elif blocked and blocked[0] is replica:
            blocked.popleft()
        elif replica in blocked:
            blocked.remove(replica)
        if replica.engine is not None:  # reopens when work leaves (`Replica.reopens_at_ms`)
            return
        at = replica.gate.reopens_at(self.now, len(replica.collector), replica.group.batch_ms)
        # As the worker's consumer loop does (tasks/replica/worker.py): one timer per reopening time,
        # so a time already past (a batch longer than expected) wakes it once, not forever.
        if at is not None and at != replica.gate_at and replica.alive:
            replica.gate_at = at
            self._timer(replica, GATE, max(at, self.now))

    def _pending(self, j: int, tier: Tier) -> Pending:
        """Request `j` as it enters a replica's buffer now; sent on after its region was
        lost, it is marked stranded (and forwarded) for the gather."""
        stranded = j in self.stranded_ids
        return Pending(str(j), tier, self.t[j], self.deadline[j], j, self.now, forwarded=stranded, stranded=stranded)

    def _take(self, replica: SimReplica, i: int) -> None:
        collector = replica.collector
        pending = self._pending(i, TIERS[self.paid[i]])
        collector.add(pending)
        if replica.engine is not None:
            if not replica.busy:  # an idle continuous replica admits at once
                self._cycle(replica)
            return
        if replica.group.list_taken:
            replica.group.held(pending, self.paid[i], replica.host)
        if not replica.busy:
            if len(collector) == 1:
                replica.group.gatherer = replica
            if len(collector) >= collector.config.max_batch:
                self._try_launch(replica)
            elif len(collector) == 1 or i in self.resent_ids:
                wait = collector.wait_ms(self.now)
                if wait is not None:
                    self._timer(replica, LAUNCH, self.now + wait)

    def _pull(self, replica: SimReplica) -> None:
        """The consumer's loop: BRPOP (paid list first) while the gate lets it."""
        group = replica.group
        while self._wants(replica):
            if group.paid_queue:
                self._take(replica, group.paid_queue.popleft())
            elif group.free_queue:
                self._take(replica, group.free_queue.popleft())
            else:
                if replica not in group.blocked:
                    group.blocked.append(replica)
                    replica.asked_at = self.now
                elif self.now - replica.asked_at >= BRPOP_TIMEOUT_MS:  # timed out, sent again
                    replica.asked_at = self.now
                return
        self._shut(replica, in_flight=True)

    def _try_launch(self, replica: SimReplica) -> None:
        """`Loop.take`: drop what was cancelled or expired; once a batch is due (the stagger
        applied), let paid requests still in the queue in ahead of buffered free ones and
        fill the seats the buffer leaves empty, then start it."""
        if replica.busy or not replica.alive:
            return
        collector, group, now = replica.collector, replica.group, self.now
        gone = {p.id for p in collector.waiting if self.state[p.payload] != WAITING}
        if gone:
            collector.remove(gone)
        config = self.config
        horizon = group.batch_ms
        if config.hand_back_rest:
            peers = self._peer_launches(replica)
            horizon = collector.urgent_horizon_ms(now, peers, group.batch_ms, config.rest_horizon)
        collector.urgent_before_ms = now + horizon
        self._drop_expired(replica)
        wait = collector.wait_ms(now)
        if wait is None:
            return
        if wait == 0 and config.stagger_saturated:  # `StaticPolicy._start_at`
            wait = collector.staggered_start_ms(now, self._peer_launches(replica), group.batch_ms) - now
            replica.gate.holding = wait > 0
        if wait > 0:
            self._timer(replica, LAUNCH, now + wait)
            return
        # The take (`ReplicaBroker.take`), once a batch is due: paid requests still in the
        # queue that would ride behind buffered free ones, and any, paid first, for the seats
        # the buffer leaves empty.
        room = collector.num_free()
        fill = max(0, collector.config.max_batch - len(collector))
        popped = self._take_queued(replica, group.paid_queue, PAID, room + fill)
        self._take_queued(replica, group.free_queue, FREE, min(fill, room + fill - popped))
        self._drop_expired(replica)
        batch = collector.pop_batch()
        if horizon < group.batch_ms and collector.waiting:
            self._hand_back(replica, collector.pop_rest({p.id for p in batch}))
        for pending in batch:
            j = pending.payload
            group.num_waiting[self.paid[j]] -= 1
            self.state[j] = RUNNING
            self.start_ms[j] = now
        copies = self._hedges(replica, len(batch))
        if group.list_started:
            for pending in batch:
                group.held(pending, self.paid[pending.payload], replica.host)
        batch += copies
        duration = self._batch_ms(group, batch)
        replica.batch, replica.busy = batch, True
        replica.last_launch, replica.ends_at = now, now + duration
        replica.gate.start(now, group.batch_ms)
        if replica.gate.early:  # what the gate knows of its peers matters only to an early pull
            replica.gate.peers(idle=self._peer_idle(replica), launches=self._peer_launches(replica))
        self.stats["batches"] += 1
        self.stats["batch_rows"] += len(batch) - len(copies)
        self._timer(replica, END, now + duration)
        self._pull(replica)

    def _take_queued(self, replica: SimReplica, queue: deque[int], tier: Tier, most: int) -> int:
        """Pop up to `most` entries from the front of `queue` (the take's RPOP with a count)
        into the replica's buffer; what left the waiting set meanwhile (cancelled, answered
        504) counts against `most` and is dropped. Returns the entries popped."""
        popped = 0
        while popped < most and queue:
            j = queue.popleft()
            popped += 1
            if self.state[j] == WAITING:
                pending = self._pending(j, tier)
                replica.collector.add(pending)
                if replica.group.list_taken:
                    replica.group.held(pending, self.paid[j], replica.host)
        return popped

    def _drop_expired(self, replica: SimReplica) -> None:
        """What can no longer finish in time leaves the buffer: answered 504, unless a copy of
        it runs on a live replica, which may still answer it (`TO_COPY`)."""
        group = replica.group
        for pending in replica.collector.pop_expired(self.now):
            j = pending.payload
            copy = self.hedges.get(j)
            if copy is not None and copy.alive:
                group.stopped(pending, self.paid[j])
                continue
            if self.state[j] == WAITING:
                self.state[j] = EXPIRED
                group.num_waiting[self.paid[j]] -= 1

    def _hand_back(self, replica: SimReplica, rest: list[Pending]) -> None:
        """`Loop.settle`'s hand-back: what the batch left goes back to the front of the
        queue (RPUSH, the first to be taken again last), and a consumer blocked in BRPOP
        whose gate lets it takes it at once."""
        group = replica.group
        for pending in reversed(rest):
            j = pending.payload
            group.stopped(pending, self.paid[j])
            (group.paid_queue if self.paid[j] else group.free_queue).appendleft(j)
        self.stats["rest_handed_back"] += len(rest)
        for peer in list(group.blocked):
            if peer is not replica and (group.paid_queue or group.free_queue):
                self._pull(peer)

    def _cycle(self, replica: SimReplica, stepped: bool = False) -> None:
        """`Replica._run_continuous`, one turn: answer what the step finished; drop what was
        cancelled or expired (buffered or running); admit into free slots; plan and price
        the next step."""
        engine, collector, group, now, state = replica.engine, replica.collector, replica.group, self.now, self.state
        assert engine is not None
        if stepped:
            for pending in engine.finish_step():
                j = pending.payload
                if state[j] == RUNNING:
                    state[j] = OK if now <= pending.deadline_ms else LATE
                    self.end_ms[j] = now
        for request_id, pending in list(engine.pendings.items()):
            j = pending.payload
            if state[j] != RUNNING or now > pending.deadline_ms:
                engine.abort(request_id)
                if state[j] == RUNNING:
                    state[j] = LATE
        gone = {p.id for p in collector.waiting if state[p.payload] != WAITING}
        if gone:
            collector.remove(gone)
        collector.urgent_before_ms = now + group.batch_ms
        room = min(collector.num_free(), engine.free_slots())
        while room and group.paid_queue:
            j = group.paid_queue.popleft()
            collector.add(Pending(str(j), PAID, self.t[j], self.deadline[j], j, now))
            room -= 1
        for pending in collector.pop_expired(now):
            j = pending.payload
            if state[j] == WAITING:
                state[j] = EXPIRED
                group.num_waiting[self.paid[j]] -= 1
        batch = collector.pop_batch(limit=engine.free_slots())
        w = self.workload
        for pending in batch:
            j = pending.payload
            group.num_waiting[self.paid[j]] -= 1
            state[j] = RUNNING
            self.start_ms[j] = now
            engine.add(pending, int(w.prompt_tokens[j]), int(w.output_tokens[j]))
        self.stats["batch_rows"] += len(batch)
        replica.busy = False
        for _ in range(3):  # a plan that only releases finished rows costs nothing: plan again
            if not engine.has_unfinished():
                break
            cost = engine.schedule()
            if cost > 0:
                replica.busy = True
                self.stats["batches"] += 1
                self._timer(replica, END, now + cost)
                break
        self._pull(replica)

    def _hedges(self, replica: SimReplica, num: int) -> list[Pending]:
        """Copies, for the batch's empty slots, of requests another host's replicas run or
        hold buffered for their next batch."""
        group, config = replica.group, self.config
        room = group.collector_config.max_batch - num
        if config.hedge == "off" or room <= 0 or replica.engine is not None:
            return []
        finish = self.now + group.batch_ms
        found = self._copy_candidates(replica, finish, (RUNNING, WAITING), 4 * room)
        return self._copies(replica, hedging.pick(config.hedge, room, replica.host, finish, config.margin_ms, found))

    def _copy_candidates(
        self, replica: SimReplica, finish_ms: float, states: tuple[int, ...], most: int | None = None
    ) -> list[hedging.Candidate]:
        """What `replica` may copy for a batch that ends at `finish_ms`: requests another
        host's replicas hold (in one of `states`: running, or buffered too), their lease
        alive (HEDGE), no copy made yet; paid ones first, each tier by deadline, and no more
        than `most` found."""
        group, margin = replica.group, self.config.margin_ms
        lapsed = {host for host, at in group.lapses_at.items() if at <= self.now}
        found: list[hedging.Candidate] = []
        for paid in (1, 0):
            held = group.held_by[paid]
            del held[: bisect_left(held, (finish_ms + margin, -1, ""))]  # none can be copied again
            for deadline, j, host in held:
                if most is not None and len(found) >= most:
                    break
                if host != replica.host and host not in lapsed and j not in self.hedges and self.state[j] in states:
                    found.append(hedging.Candidate(j, TIERS[paid], deadline, host))
        return found

    def _copies(self, replica: SimReplica, chosen: list[hedging.Candidate]) -> list[Pending]:
        """The `chosen` requests' second copies, to run on `replica`."""
        copies = []
        for c in chosen:
            j = int(c.key)
            self.hedges[j] = replica
            copies.append(Pending(f"{COPY}{j}", c.tier, self.t[j], c.deadline_ms, j, self.now))
        self.stats["hedged"] += len(copies)
        return copies

    def _batch_ms(self, group: Group, batch: list[Pending]) -> float:
        if group.cost is None:
            return self.config.batch_ms + self.config.batch_jitter_ms * self._random()
        w = self.workload
        idx = [p.payload for p in batch]
        return group.cost.batch_ms(w.prompt_tokens[idx].tolist(), w.output_tokens[idx].tolist())

    def _gate_timer(self, replica: SimReplica) -> None:
        """Its gate's timer: a busy replica that yields its lead (LEAD_YIELDS) reads
        whether a peer is idle, and again `LEAD_READ_MS` on while one is; then it asks
        the gate (`_pull`)."""
        gate = replica.gate
        if replica.busy and gate.lead_yields:
            gate.listener_elsewhere = self._peer_idle(replica)
            if gate.listener_elsewhere and self.now + LEAD_READ_MS < gate.ends_at_ms:
                self._timer(replica, GATE, self.now + LEAD_READ_MS)
        self._pull(replica)

    def _peer_idle(self, replica: SimReplica) -> bool:
        return any(not r.busy for r in replica.group.replicas if r is not replica and r.alive)

    def _peer_launches(self, replica: SimReplica) -> list[float]:
        """The other replicas' last starts (`kb:launch:<model>`), those still able to matter:
        a start whose batch ended already can neither end before this one nor be recent."""
        horizon = self.now - 2 * replica.group.batch_ms
        return [
            r.last_launch for r in replica.group.replicas if r is not replica and r.alive and r.last_launch > horizon
        ]

    def _end(self, replica: SimReplica) -> None:
        now, state, group = self.now, self.state, replica.group
        num = 0  # the batch's own requests: copies do not count as its load
        for pending in replica.batch:
            j = pending.payload
            if is_copy(pending):  # it answers if its request is still unanswered
                self.hedges.pop(j, None)
                if state[j] in (RUNNING, WAITING):
                    if state[j] == WAITING:  # its own run was lost and it waits to run again
                        group.num_waiting[self.paid[j]] -= 1
                    state[j] = OK if now <= pending.deadline_ms else LATE
                    self.end_ms[j] = now
                    self.stats["hedge_wins"] += 1
                else:
                    self.stats["hedge_wasted"] += 1
                continue
            num += 1
            group.stopped(pending, self.paid[j])
            if state[j] == RUNNING:
                state[j] = OK if now <= pending.deadline_ms else LATE
                self.end_ms[j] = now
        if num:  # not a batch of copies only (HEDGE_IDLE)
            self.batch_sizes.append(num)
        replica.batch, replica.busy = [], False
        replica.gate.finish()
        launches = self._peer_launches(replica)
        replica.collector.stagger_from(launches, num, now)
        if replica.gate.early:
            replica.gate.peers(launches=launches)
        # Overlapped, as live (tasks/replica/loop.py): the next batch is taken as this one
        # ends, the seats its buffer leaves filled from the queue, before the consumer pulls.
        self._try_launch(replica)
        self._pull(replica)
        self._next_look(replica, first=True)

    # -- copies while idle (HEDGE_IDLE, `Loop.copy_while_idle`) --

    def _next_look(self, replica: SimReplica, first: bool = False) -> None:
        """HEDGE_IDLE: the replica's next look for copies, a look's interval on
        (`hedging.look_ms`: live, its lease's renewals), or, `first`, at a random point of
        one (after its batch ends, or as it starts)."""
        config = self.config
        if not config.hedge_idle or config.hedge == "off" or replica.engine is not None:
            return
        if replica.index in self.looking or self.now > self.looks_until:
            return
        every = hedging.look_ms(config.lease_ms)
        self.looking.add(replica.index)
        self._push(self.now + every * (self._random() if first else 1.0), LOOK, replica, 0)

    def _look(self, replica: SimReplica) -> None:
        """An idle replica's look (`Loop.copy_while_idle`), one every `hedging.look_ms`
        while it is idle with nothing buffered: not while it listens for arrivals (one
        listener at a time); busy or gathering, its batch's end brings the next look."""
        self.looking.discard(replica.index)
        if not (replica.alive and replica.ready) or replica.busy or replica.collector.waiting:
            return
        group = replica.group
        listens = self.config.concentrate_idle and group.blocked and group.blocked[0] is replica
        if listens or not self._copy_batch(replica):
            self._next_look(replica)

    def _copy_batch(self, replica: SimReplica) -> bool:
        """The look itself: while `hedging.idle_mode` allows, a batch of copies of requests
        whose batch runs on another host, as many as can still answer in time, paid first
        (`hedging.pick`), gathered where the mode says so. True: it started one."""
        group, config, now = replica.group, self.config, self.now
        ready = [r for r in group.replicas if r.alive and r.ready]
        mode, _least, gather = hedging.idle_mode(config.hedge, sum(1 for r in ready if not r.busy), len(ready))
        if mode == "off":
            return False
        finish = now + group.batch_ms
        found = self._copy_candidates(replica, finish, (RUNNING,))
        room = group.collector_config.max_batch
        chosen = hedging.pick(mode, room, replica.host, finish, config.margin_ms, found)
        every = hedging.look_ms(config.lease_ms)
        if not chosen or (
            gather and not hedging.copies_due(chosen, room, now, group.batch_ms, config.margin_ms, every)
        ):
            return False  # more may come by its next look
        copies = self._copies(replica, chosen)
        self.stats["idle_copy_batches"] += 1
        self.stats["idle_copies"] += len(copies)
        duration = self._batch_ms(group, copies)
        replica.batch, replica.busy = copies, True
        replica.ends_at = now + duration
        replica.gate.start(now, group.batch_ms)
        if replica in group.blocked:  # busy: its turn at arrivals passes on
            group.blocked.remove(replica)
        self._timer(replica, END, now + duration)
        self._shut(replica)  # its gate reopens in its lead, as a primary batch's does
        return True
