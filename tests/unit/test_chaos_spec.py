"""`keybatch chaos` refuses a run it cannot set up before starting anything, and starts a peer
region where the run has one."""

from __future__ import annotations

import json

from control.chaos.spec import ChaosSpec, deployments_for


def test_cell_loss_needs_two_cells_and_a_replica_in_each() -> None:
    assert ChaosSpec("cell-loss", replicas=6, cells=3).problem() is None
    assert "2 or more" in (ChaosSpec("cell-loss", replicas=6, cells=1).problem() or "")
    assert "each cell needs a replica" in (ChaosSpec("cell-loss", replicas=2, cells=3).problem() or "")
    assert "cell-loss only" in (ChaosSpec("replica-kill", pause=True).problem() or "")


def test_host_loss_needs_a_host_to_lose_and_another_to_serve() -> None:
    assert ChaosSpec("host-loss", replicas=4, replicas_per_host=2).problem() is None
    assert "below --replicas" in (ChaosSpec("host-loss", replicas=2, replicas_per_host=2).problem() or "")
    assert "below --replicas" in (ChaosSpec("host-loss", replicas=4).problem() or "")  # one host only


def test_a_peer_region_is_started_for_region_loss_and_on_request() -> None:
    alone = deployments_for(ChaosSpec("host-loss", replicas=4, replicas_per_host=2))
    assert [d.name for d in alone] == ["main"]
    a, b = deployments_for(ChaosSpec("host-loss", replicas=4, replicas_per_host=2, peer_load=0.0))
    assert (a.name, b.name) == ("a", "b")
    assert json.loads(a.env["KEYBATCH_PEERS"]) == [b.url]
    assert "KEYBATCH_PEERS" not in b.env
    assert (a.replicas_per_host, b.replicas_per_host) == (2, 0)  # only the region under fault loses a host
    assert [d.name for d in deployments_for(ChaosSpec("region-loss", replicas=2))] == ["a", "b"]
    assert "--peer-load" in (ChaosSpec("host-loss", replicas=4, replicas_per_host=2, peer_load=-1).problem() or "")
