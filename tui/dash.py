"""`keybatch dash`: the operators' terminal control plane (Textual).

One screen, polled every second in a worker thread so the screen never waits on the
broker: queue depth and oldest age, arrival and completion rates and end-to-end
p50/p99 per model and tier (against the SLO), p99 sparklines per tier, the replica
table, and the rebalancer's last decisions with their reasons. Keys act on the
selected replica through the same `Operator` API as the CLI (`control/fleet/operator.py`), each
after a confirmation. A broker that cannot be read shows as a banner; the last figures
stay on screen.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.screen import ModalScreen
from textual.widgets import Button, DataTable, Footer, Label, RichLog, Sparkline, Static

from control.core.vocab import TIERS
from control.fleet.operator import ActionResult, FleetSnapshot, Operator
from control.policy.rebalance import Decision, RebalanceConfig, RebalancePolicy

HISTORY = 60  # polls of p99 kept for the sparklines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


class Confirm(ModalScreen[bool]):
    """Yes or no to one operator action."""

    BINDINGS: ClassVar = [Binding("y", "answer(True)", "yes"), Binding("n,escape", "answer(False)", "no")]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm"):
            yield Label(Text(self.question))
            with Horizontal():
                yield Button("Yes (y)", id="yes", variant="warning")
                yield Button("No (n)", id="no")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class Dashboard(App[None]):
    TITLE = "keybatch"
    CSS = """
    #banner { background: $error; color: $text; height: auto; display: none; padding: 0 1; }
    #banner.shown { display: block; }
    #queues { height: auto; max-height: 8; }
    #spark-row { height: 3; }
    .spark-box { width: 1fr; height: 3; }
    .spark-box Label { height: 1; }
    Sparkline { height: 2; }
    #replicas { height: 1fr; min-height: 4; }
    #decisions { height: 4; border-top: solid $primary; }
    #status { height: 1; color: $text-muted; }
    #confirm { width: 60; height: auto; padding: 1 2; border: thick $warning; background: $surface; }
    Confirm { align: center middle; }
    """
    BINDINGS: ClassVar = [
        Binding("d", "drain", "drain"),
        Binding("r", "resume", "resume"),
        Binding("m", "move", "move"),
        Binding("b", "rebalance", "rebalance"),
        Binding("a", "auto", "auto-rebalance"),
        Binding("q", "quit", "quit"),
    ]

    def __init__(
        self,
        operator: Operator,
        poll_s: float = 1.0,
        slo_ms: float = 600.0,
        screenshot: str | None = None,
        exit_after_s: float | None = None,
    ) -> None:
        super().__init__()
        self.screenshot = screenshot  # an SVG of the screen written when the app ends
        self.exit_after_s = exit_after_s
        self.operator = operator
        self.poll_s = poll_s
        self.slo_ms = slo_ms
        self.snapshot: FleetSnapshot | None = None
        self.history: dict[str, deque[float]] = {tier: deque(maxlen=HISTORY) for tier in TIERS}
        self.auto = False
        self.policy = RebalancePolicy(RebalanceConfig(), operator_clock())
        self.polls = 0
        self.failures = 0

    # -- layout -----------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield Static("", id="banner")
        yield DataTable(id="queues", cursor_type="none", zebra_stripes=True)
        with Horizontal(id="spark-row"):
            for tier in TIERS:
                with Vertical(classes="spark-box"):
                    yield Label(f"{tier} p99", id=f"spark-label-{tier}")
                    yield Sparkline([], id=f"spark-{tier}")
        yield DataTable(id="replicas", cursor_type="row", zebra_stripes=True)
        yield RichLog(id="decisions", max_lines=50, wrap=True, markup=False)
        yield Static("connecting...", id="status")
        yield Footer()

    def on_mount(self) -> None:
        queues = self.query_one("#queues", DataTable)
        queues.add_columns("model", "tier", "queued", "oldest ms", "in/s", "out/s", "p50 ms", "p99 ms")
        replicas = self.query_one("#replicas", DataTable)
        replicas.add_columns("replica", "model", "state", "fill", "duty", "held", "hb ms", "p99 ms", "hedges/won")
        self.poll()
        self.set_interval(self.poll_s, self.poll)
        if self.exit_after_s is not None:
            self.set_timer(self.exit_after_s, self.action_quit)

    async def action_quit(self) -> None:
        if self.screenshot:
            path = Path(self.screenshot)
            self.save_screenshot(filename=path.name, path=str(path.parent.resolve()))
        self.exit()

    # -- polling ------------------------------------------------------------------------

    @work(thread=True, exclusive=True, group="poll")
    def poll(self) -> None:
        """Read the fleet off the broker (in a thread: the screen never waits on it)."""
        try:
            snap = self.operator.snapshot()
            decided = self._auto_step() if self.auto else None
        except Exception as exc:  # a lost broker is a banner, never a crash
            self._to_screen(self.show_error, f"broker unreachable: {type(exc).__name__}: {exc}")
            return
        self._to_screen(self.show, snap, decided)

    def _to_screen(self, show: Callable[..., object], *args: object) -> None:
        """Hand a read to the screen's thread; a read that ends after the app closed is dropped."""
        try:
            self.call_from_thread(self._on_screen, show, *args)
        except RuntimeError:  # the app is no longer running
            pass

    def _on_screen(self, show: Callable[..., object], *args: object) -> None:
        try:
            show(*args)
        except NoMatches:  # the dashboard's screen is gone: the app is closing
            pass

    def _auto_step(self) -> tuple[list[Decision], list[ActionResult]]:
        return self.operator.rebalance_once(self.policy)

    def show_error(self, message: str) -> None:
        self.failures += 1
        banner = self.query_one("#banner", Static)
        banner.update(Text(f"{message} (showing the last figures read)"))  # not markup: "[Errno 111]"
        banner.add_class("shown")

    def show(self, snap: FleetSnapshot, decided: tuple[list[Decision], list[ActionResult]] | None = None) -> None:
        self.snapshot = snap
        self.polls += 1
        self.query_one("#banner", Static).remove_class("shown")
        self._show_queues(snap)
        self._show_replicas(snap)
        if decided is not None:
            self._log_decisions(*decided)
        serving = sum(r.state_label == "serving" for r in snap.replicas)
        auto = "on" if self.auto else "off"
        status = f"{len(snap.replicas)} replicas, {serving} serving | SLO {self.slo_ms:.0f} ms | auto-rebalance {auto}"
        self.query_one("#status", Static).update(Text(status))

    def _show_queues(self, snap: FleetSnapshot) -> None:
        table = self.query_one("#queues", DataTable)
        table.clear()
        worst: dict[str, float] = {}
        for t in snap.traffic:
            p99 = Text(_ms(t.p99_ms), style="bold red" if t.p99_ms and t.p99_ms > self.slo_ms else "green")
            table.add_row(
                t.model,
                t.tier,
                str(t.num_queued),
                _ms(t.oldest_ms),
                f"{t.arrival_rate:.1f}",
                f"{t.completion_rate:.1f}",
                _ms(t.p50_ms),
                p99,
            )
            if t.p99_ms is not None:
                worst[t.tier] = max(worst.get(t.tier, 0.0), t.p99_ms)
        for tier, points in self.history.items():
            points.append(worst.get(tier, 0.0))
            self.query_one(f"#spark-{tier}", Sparkline).data = list(points)
            now = worst.get(tier)
            over = now is not None and now > self.slo_ms
            label = f"{tier} p99 {_ms(now)} ms (SLO {self.slo_ms:.0f}){'  OVER' if over else ''}"
            self.query_one(f"#spark-label-{tier}", Label).update(label)

    def _show_replicas(self, snap: FleetSnapshot) -> None:
        table = self.query_one("#replicas", DataTable)
        selected = self.selected()
        table.clear()
        celled = any(r.cell for r in snap.replicas)  # with cells, each replica's is named
        for r in sorted(snap.replicas, key=lambda r: r.name):
            state = Text(r.state_label, style="green" if r.state_label == "serving" else "yellow")
            table.add_row(
                f"{r.name} c{r.cell}" if celled else r.name,
                r.model,
                state,
                f"{r.batch_fill:.0%}",
                f"{r.utilization:.0%}",
                str(r.num_held),
                f"{r.heartbeat_age_ms:.0f}",
                _ms(r.batch_p99_ms or None),
                f"{r.hedged}/{r.hedge_wins}",
                key=r.name,
            )
        if selected is not None and selected in table.rows:
            table.move_cursor(row=table.get_row_index(selected))

    def _log_decisions(self, decisions: list[Decision], results: list[ActionResult]) -> None:
        log = self.query_one("#decisions", RichLog)
        for decision in decisions:
            what = (
                f"move {decision.replica}: {decision.from_model} -> {decision.to_model}" if decision.is_move else "hold"
            )
            log.write(f"{what}: {decision.reason}")
        for result in results:
            log.write(f"  {result.action} {result.replica}: {'ok' if result.ok else 'failed'} {result.message}")

    # -- actions ------------------------------------------------------------------------

    def selected(self) -> str | None:
        table = self.query_one("#replicas", DataTable)
        if not table.row_count:
            return None
        try:
            key, _ = table.coordinate_to_cell_key(table.cursor_coordinate)
        except Exception:
            return None
        return str(key.value) if key.value is not None else None

    def _confirm_then(self, question: str, act: Callable[[], ActionResult | list[ActionResult]]) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                self._act(act)

        self.push_screen(Confirm(question), answered)

    @work(thread=True, group="act")
    def _act(self, act: Callable[[], Any]) -> None:
        try:
            done = act()
        except Exception as exc:
            self.call_from_thread(self.notify, str(exc), severity="error", markup=False)
            return
        results = done if isinstance(done, list) else [done]
        for result in results:
            message = f"{result.action} {result.replica}: {result.state or ''} {result.message}".strip()
            severity = "information" if result.ok else "error"
            self.call_from_thread(self.notify, message, severity=severity, markup=False)

    def action_drain(self) -> None:
        name = self.selected()
        if name:
            self._confirm_then(
                f"Drain {name}? It finishes what it holds and takes no new work.", lambda: self.operator.drain(name)
            )

    def action_resume(self) -> None:
        name = self.selected()
        if name:
            self._confirm_then(f"Resume {name}?", lambda: self.operator.resume(name))

    def action_move(self) -> None:
        name = self.selected()
        if not name or self.snapshot is None:
            return
        current = next((r.model for r in self.snapshot.replicas if r.name == name), None)
        others = [m for m in sorted(self.operator.settings.models) if m != current]
        if not others:
            self.notify("only one model is configured", severity="warning")
            return
        target = others[0]
        self._confirm_then(
            f"Move {name} from {current} to {target}? It drains first.", lambda: self.operator.move(name, target)
        )

    def action_rebalance(self) -> None:
        def once() -> list[ActionResult]:
            decisions, results = next(iter(self.operator.rebalance()))
            self.call_from_thread(self._log_decisions, decisions, results)
            return results

        self._confirm_then("Rebalance now (one pass of the policy, acting at once)?", once)

    def action_auto(self) -> None:
        self.auto = not self.auto
        self.notify(f"auto-rebalance {'on' if self.auto else 'off'}")


def operator_clock() -> Any:
    from control.core.clock import SystemClock

    return SystemClock()


def run_dash(
    operator: Operator,
    poll_s: float = 1.0,
    slo_ms: float = 600.0,
    screenshot: str | None = None,
    exit_after_s: float | None = None,
) -> None:
    Dashboard(operator, poll_s, slo_ms, screenshot, exit_after_s).run()
