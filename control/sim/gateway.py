"""The simulated gateway's side of a run: supersede, admit, enqueue."""

from __future__ import annotations

from control.policy import admission
from control.policy.admission import Verdict
from control.sim.group import Group
from control.sim.replica import ReplicaSide
from control.sim.states import CANCELLED, EXPIRED, REFUSED, RUNNING, TIERS, WAITING

_ADMIT = Verdict.ADMIT  # looked up once: an enum member's lookup is on the hot path


class GatewaySide(ReplicaSide):
    """The gateway: supersede, admit, enqueue."""

    def _arrive(self, i: int, resent: bool = False) -> None:
        """The gateway's ADMIT, then the LPUSH. The hot path: one call per request."""
        group = self.groups[self.group_of[i]]
        if not group.alive:  # its region is gone: the client's next region
            group = self._move(i)
        state, now, paid = self.state, self.now, self.paid[i]
        prev = self.prev[i]
        if prev >= 0 and not resent and WAITING <= state[prev] <= RUNNING:
            self._cancel(prev)
        if resent:
            verdict, deepest = self._admit_resent(group, i)
        else:
            if now - group.deepest_at >= self.config.admission_refresh_ms:
                group.refresh_deepest(now, self.config.budget_ms)
            verdict, deepest = group.verdict, group.deepest[paid]
        if group.admit_phased:
            group.demand_meter.add(now)
        waiting = group.num_waiting
        position = admission.position(TIERS[paid], waiting[1], waiting[0])
        if paid and group.bump and verdict is _ADMIT:
            position = waiting[1] + 1  # behind paid ones only; the free ones it delays too long leave
            if position <= deepest:
                self._bump(group)
        asked = group.asked
        if asked is not None and not resent:
            asked.add(now)
            gate = group.open_gate
            if now - gate.updated_ms >= admission.OPEN_REFRESH_MS:
                gate.update(*asked.window(now), group.capacity().requests_per_s, now)
            limit = deepest
            if verdict is _ADMIT and gate.admits_deep(TIERS[paid], now):
                deepest = max(deepest, group.open_deepest[paid])
            if not paid and verdict is _ADMIT and position <= deepest:
                gate.admitted(now, position > limit)
        if verdict is not _ADMIT or position > deepest:
            state[i] = EXPIRED if verdict == Verdict.TOO_SHORT else REFUSED
            return
        if paid:
            group.paid_meter.add(now)
        state[i] = WAITING
        waiting[paid] += 1
        # LPUSH: a consumer blocked in BRPOP takes it at once (the one that asked first), if
        # its gate still lets it or its BRPOP was sent before the gate shut; it asks again at
        # the back of the line if its gate lets it then. A replica whose gate had shut hands
        # the message back to the front of the queue (`Replica._hands_back`).
        blocked = group.blocked
        if self.config.concentrate_idle and not group.continuous:
            self._gatherer_first(group)
        handed_back = False
        while blocked:
            replica = blocked[0]
            if not replica.alive:
                if self._lost_pull(replica, i):
                    return
                continue
            if not (
                self._wants(replica)
                if group.continuous
                else replica.gate.wants(now, len(replica.collector.waiting), group.batch_ms)
            ):
                if not self._in_flight(replica):
                    self._shut(replica)
                    continue
                self.stats["taken_shut"] += 1
                if self.config.pull_in_flight == "hand_back":
                    self._shut(replica)
                    handed_back = True
                    continue
            blocked.rotate(-1)
            replica.asked_at = now
            self._take(replica, i)
            if not (
                self._wants(replica)
                if group.continuous
                else replica.gate.wants(now, len(replica.collector.waiting), group.batch_ms)
            ):
                self._shut(replica)
            return
        queue = group.paid_queue if paid else group.free_queue
        if handed_back:  # RPUSH: the next pull takes it
            queue.appendleft(i)
        else:
            queue.append(i)

    def _bump(self, group: Group) -> None:
        """`SimConfig.admit_bump`: a paid request about to be admitted goes ahead of every
        free one waiting. The first free request in the queue it would push past the last
        start its budget allows (`admission.max_depth` of what is left) leaves, refused 429.
        One at most: those behind it move up by as much as the paid request moves them back,
        and those before it still fit. Free requests a replica has taken count as ahead;
        they are not bumped. O(queue) per paid arrival."""
        state, now, queue = self.state, self.now, group.free_queue
        live = [j for j in queue if state[j] == WAITING]
        position = group.num_waiting[1] + group.num_waiting[0] - len(live) + 1
        capacity = group.capacity(now, self.config.budget_ms)
        for j in live:
            position += 1
            if position > admission.max_depth(self.deadline[j] - now, capacity, group.limits):
                queue.remove(j)
                state[j] = REFUSED
                group.num_waiting[0] -= 1
                self.stats["bumped"] += 1
                return

    @staticmethod
    def _gatherer_first(group: Group) -> None:
        """`SimConfig.concentrate_idle`: an idle replica already gathering a batch goes to the
        front of the BRPOP line. The one to look at is the idle replica that took a first
        request last (`Group.gatherer`): a scan of the line on every arrival cost a fleet's
        run half its time again."""
        replica, blocked = group.gatherer, group.blocked
        if replica is None or not blocked or blocked[0] is replica:
            return
        if not (replica.alive and not replica.busy and replica.collector.waiting):
            group.gatherer = None
            return
        try:
            blocked.remove(replica)
        except ValueError:  # its pull is not out
            return
        blocked.appendleft(replica)

    def _admit_resent(self, group: Group, i: int) -> tuple[Verdict, int]:
        """A request sent again after a region loss: admitted on what is left of its budget."""
        budget = self.deadline[i] - self.now
        capacity = group.capacity(self.now, self.config.budget_ms)
        verdict = admission.check(budget, capacity, group.limits)
        if verdict != Verdict.ADMIT:
            return verdict, 0
        demand = group.demand_meter.rate(self.now) if group.admit_phased else None
        deepest = admission.max_position(TIERS[self.paid[i]], budget, capacity, group.limits, 0.0, self.now, demand)
        return verdict, deepest

    def _move(self, i: int) -> Group:
        alive = [g for g in self.groups if g.alive and g.model == self.groups[self.group_of[i]].model]
        group = alive[int(self._random() * len(alive))]
        self.group_of[i] = group.index
        return group

    def _cancel(self, j: int) -> None:
        """A newer request of the session supersedes it: out of the waiting set at once; a
        replica drops it before its batch; a static batch already running runs it for nothing."""
        if self.state[j] == WAITING:
            self.groups[self.group_of[j]].num_waiting[self.paid[j]] -= 1
        else:
            self.stats["wasted"] += 1
        self.state[j] = CANCELLED

    def _requeue(self, group: Group, i: int) -> None:
        """SWEEP's RPUSH: back at the front of its queue (the end consumers pop from)."""
        (group.paid_queue if self.paid[i] else group.free_queue).appendleft(i)
