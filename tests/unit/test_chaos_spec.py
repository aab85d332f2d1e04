"""`keybatch chaos` refuses a cell-loss or a host-loss it cannot run, before starting anything."""

from __future__ import annotations

from control.chaos.spec import ChaosSpec


def test_cell_loss_needs_two_cells_and_a_replica_in_each() -> None:
    assert ChaosSpec("cell-loss", replicas=6, cells=3).problem() is None
    assert "2 or more" in (ChaosSpec("cell-loss", replicas=6, cells=1).problem() or "")
    assert "each cell needs a replica" in (ChaosSpec("cell-loss", replicas=2, cells=3).problem() or "")
    assert "cell-loss only" in (ChaosSpec("replica-kill", pause=True).problem() or "")


def test_host_loss_needs_a_host_to_lose_and_another_to_serve() -> None:
    assert ChaosSpec("host-loss", replicas=4, replicas_per_host=2).problem() is None
    assert "below --replicas" in (ChaosSpec("host-loss", replicas=2, replicas_per_host=2).problem() or "")
    assert "below --replicas" in (ChaosSpec("host-loss", replicas=4).problem() or "")  # one host only
