"""A continuous replica's simulated engine: the live scheduler plans each step, a cost model prices it."""

from __future__ import annotations

from control.sim.cost import CONTEXT_TOKENS, CostModel
from tasks.policy.collector import Pending
from tasks.policy.scheduler import ContinuousScheduler, RunningRequest, SchedulerOutput, WaitingRequest


class SimEngine:
    """A continuous replica's engine, counted in tokens: `tasks.scheduler` plans every step
    (admit into free slots paid first, decode one token each, prefill with the rest of the
    budget), the cost model prices it: one decode step for the decoding rows plus each
    prompt chunk's own forward."""

    def __init__(self, scheduler: ContinuousScheduler, cost: CostModel) -> None:
        self.scheduler = scheduler
        self.cost = cost
        self.waiting: dict[str, WaitingRequest] = {}
        self.rows: dict[str, list[int]] = {}  # id -> [prompt tokens left to prefill, tokens left to decode]
        self.pendings: dict[str, Pending] = {}  # every request in the engine, waiting or running
        self.outputs: dict[str, int] = {}
        self.plan: SchedulerOutput | None = None
        self._arrivals = 0

    def free_slots(self) -> int:
        return max(0, self.scheduler.config.max_slots - len(self.rows) - len(self.waiting))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.rows)

    def add(self, pending: Pending, prompt_tokens: int, output_tokens: int) -> None:
        self._arrivals += 1
        self.waiting[pending.id] = WaitingRequest(pending.id, pending.tier, prompt_tokens, self._arrivals)
        self.pendings[pending.id] = pending
        self.outputs[pending.id] = output_tokens

    def abort(self, request_id: str) -> None:
        self.waiting.pop(request_id, None)
        self.rows.pop(request_id, None)
        self.pendings.pop(request_id, None)

    def schedule(self) -> float:
        """Plan the next step; its cost in ms (0: nothing to compute)."""
        running = [
            RunningRequest(i, row[0], self.pendings[i].tier, 0, is_finished=row[1] <= 0) for i, row in self.rows.items()
        ]
        plan = self.scheduler.schedule(list(self.waiting.values()), running)
        for i in plan.released:
            del self.rows[i]
            self.pendings.pop(i, None)
        for i in plan.joined:
            request = self.waiting.pop(i)
            self.rows[i] = [request.num_prompt_tokens, self.outputs.pop(i)]
        self.plan = plan
        decode = self.cost.step_ms(len(plan.decodes), CONTEXT_TOKENS) if plan.decodes else 0.0
        prefill = sum(self.cost.prefill_ms_for(n) for n in plan.prefills.values())
        return decode + prefill + (self.cost.step_overhead_ms if decode or prefill else 0.0)

    def finish_step(self) -> list[Pending]:
        """Apply the planned step; the requests that finished with it."""
        done: list[Pending] = []
        if self.plan is None:
            return done
        for i in self.plan.decodes:
            row = self.rows.get(i)
            if row is not None and row[1] > 0:
                row[1] -= 1
                if row[1] == 0:
                    done.append(self.pendings[i])
        for i, n in self.plan.prefills.items():
            if i in self.rows:
                self.rows[i][0] -= n
        self.plan = None
        return done
