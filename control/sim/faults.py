"""The faults a run can play: a host lost mid-batch and swept, a region lost and its requests sent again."""

from __future__ import annotations

import heapq

from control.sim.events import HOST_UP, SWEEP
from control.sim.gateway import GatewaySide
from control.sim.group import Group, SimReplica, is_copy
from control.sim.states import EXPIRED, NEW, RUNNING, WAITING
from tasks.policy.collector import Collector


class FaultSide(GatewaySide):
    """The faults: host down, sweep, host up, region down."""

    def _host_down(self) -> None:
        """The first host of the first group dies mid-batch: its replicas stop at once; the
        lease lapses and a sweep re-queues what they held (control/broker/scripts.py, SWEEP)."""
        group = self.groups[0]
        dead = [r for r in group.replicas if r.alive][: self.config.host_size]
        if self.config.host_loss_busiest:
            hosts: dict[str, list[SimReplica]] = {}
            for replica in group.replicas:
                if replica.alive:
                    hosts.setdefault(replica.host, []).append(replica)
            dead = max(hosts.values(), key=lambda rs: sum(len(r.held()) for r in rs))
        for replica in dead:
            if replica in group.blocked and self._wants(replica):  # pulling: its BRPOP out may
                self._last_sent(replica)  # still take a message (`_lost_pull`)
            replica.alive = False
            replica.tokens = [t + 1 for t in replica.tokens]
            self.died_at[replica.index] = self.now
        for replica in dead:  # when their leases lapse, nothing they held is copied any more
            group.lapses_at[replica.host] = self.now + self.config.lease_ms
            self.lost_running.update(p.payload for p in replica.batch if not is_copy(p))
            self.lost_buffered.update(p.payload for p in replica.collector.waiting)
        self._push(self.now + self.config.detect_ms, SWEEP, dead, 0)
        self._push(self.now + self.config.restart_s * 1000.0, HOST_UP, dead, 0)

    def _sweep(self, dead: list[SimReplica]) -> None:
        """SWEEP: each held request still wanted goes back to the front of its queue, or is
        answered 504 when its deadline leaves less than one batch (or it came back twice)."""
        group = dead[0].group
        group.num_ready -= len(dead)
        min_ms = group.batch_ms + self.config.margin_ms
        for replica in dead:
            replica.ready = False
            held = replica.held()
            replica.batch, replica.collector.waiting, replica.busy = [], [], False
            replica.engine = group.new_engine()
            for pending in reversed(held):
                j = pending.payload
                if is_copy(pending):  # a copy it ran, lost with it: its request's own run answers it
                    if self.hedges.get(j) is replica:
                        del self.hedges[j]
                    self.stats["hedge_wasted"] += 1
                    continue
                group.stopped(pending, self.paid[j])
                if self.state[j] not in (WAITING, RUNNING):
                    continue
                copy = self.hedges.get(j)
                if copy is not None and copy.alive:
                    continue  # a copy runs on another host: it answers
                was_running = self.state[j] == RUNNING
                if self.deadline[j] - self.now >= min_ms and self.requeues.get(j, 0) < 2:
                    self.requeues[j] = self.requeues.get(j, 0) + 1
                    self.stats["requeued"] += 1
                    if was_running:
                        group.num_waiting[self.paid[j]] += 1
                    self.state[j] = WAITING
                    self._requeue(group, j)
                else:
                    if not was_running:
                        group.num_waiting[self.paid[j]] -= 1
                    self.state[j] = EXPIRED
        for replica in list(group.blocked):  # re-queued requests go to the consumers blocked on the queue
            self._pull(replica)

    def _rescue(self, group: Group, j: int) -> None:
        """RESCUE: a request a lost replica's pull took goes back to the front of its queue,
        if it still waits, and to a consumer blocked on the queue."""
        if self.state[j] != WAITING or not group.alive:
            return
        self.stats["rescued"] += 1
        self._requeue(group, j)
        for replica in list(group.blocked):
            if replica.alive:
                self._pull(replica)

    def _host_up(self, dead: list[SimReplica]) -> None:
        group = dead[0].group
        for replica in dead:
            group.lapses_at.pop(replica.host, None)
        for replica in dead:
            replica.alive = True
            replica.collector = Collector(group.collector_config)
            replica.engine = group.new_engine()
            replica.gate = group.new_gate()
            replica.last_launch = -1e18
            replica.ready = True
            if replica not in group.blocked:
                group.blocked.append(replica)
            replica.asked_at = self.now
        group.num_ready += len(dead)
        for replica in dead:
            self._pull(replica)
            self._next_look(replica, first=True)

    def _close(self, group: Group) -> list[int]:
        """The group takes nothing more: what its queues held, which it no longer does."""
        group.alive = False
        queued = list(group.paid_queue) + list(group.free_queue)
        group.paid_queue.clear()
        group.free_queue.clear()
        group.blocked.clear()
        group.num_ready = 0
        return queued

    def _cell_down(self, cell: int) -> None:
        """A cell's broker is lost (the run's regions stand for one region's cells). What
        waits in its queues, and what its replicas took and have not started, goes to the
        other cells `cell_move_ms` later with what is left of its budget (the gateway moves
        it, api/gateway.py); what its replicas run is answered through another cell
        (tasks/replica/broker.py); its replicas take nothing more; new requests go to the
        other cells."""
        for group in self.groups:
            if group.region != cell:
                continue
            moved = self._close(group)
            for replica in group.replicas:
                moved += [p.payload for p in replica.collector.waiting]
                replica.collector.waiting = []
            for j in moved:
                if self.state[j] != WAITING:
                    continue
                self.state[j] = NEW
                self.stats["moved"] += 1
                self.resent_ids.add(j)
                self._move(j)
                heapq.heappush(self.resent, (self.now + self.config.cell_move_ms, j))

    def _region_down(self, region: int) -> None:
        """Region 0 is lost with everything in it. Its clients send what was in flight again
        to another region (`control/fleet/regionclient.py`, same request id), with what is left of
        the budget; new requests go to the other regions from now on."""
        for group in self.groups:
            if group.region != region:
                continue
            held = self._close(group)
            for replica in group.replicas:
                held += [p.payload for p in replica.held()]
                replica.alive = False
                replica.tokens = [t + 1 for t in replica.tokens]
            elsewhere = any(g.alive and g.model == group.model for g in self.groups)
            for j in held:
                if self.state[j] not in (WAITING, RUNNING):
                    continue
                self.state[j] = NEW
                self.stats["resent"] += 1
                if not elsewhere:  # the other regions run apart: the caller sends it on
                    self.handed_off.append((self.now + self.config.resend_ms, j))
                    continue
                self.resent_ids.add(j)
                if self.config.stranded:
                    self.stranded_ids.add(j)
                self._move(j)
                heapq.heappush(self.resent, (self.now + self.config.resend_ms, j))
