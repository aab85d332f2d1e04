"""Which cell carries a request: a pure rule, shared by the gateway and the simulator.

A cell is one broker and the replicas that serve from it. A request belongs to the cell its
tenant and session name (its tenant and id without a session), so a retry, a join and a
supersede meet their earlier request in one keyspace and admission stays one round trip.
While that cell's broker does not answer, the request goes to the next cell of its own
order, the same from every gateway, so a session's requests keep meeting one another there.

The order is rendezvous hashing (each cell scored by a hash of the route key and the cell):
a lost cell's routes spread evenly over the others instead of all falling on its neighbour,
and a cell added or removed moves only the routes that rank it first.
"""

from __future__ import annotations

import hashlib


def cell_order(route: str, num_cells: int) -> list[int]:
    """The cells to try for a route key (a request's tenant-scoped session, else its
    tenant-scoped id): its own first, then the others. BLAKE2b scores, the same in every
    process (unlike `hash`)."""
    if num_cells <= 1:
        return [0]
    key = route.encode()
    scores = [(_score(key, cell), cell) for cell in range(num_cells)]
    return [cell for _score_, cell in sorted(scores, reverse=True)]


def _score(key: bytes, cell: int) -> int:
    return int.from_bytes(hashlib.blake2b(key, digest_size=8, salt=cell.to_bytes(16, "little")).digest(), "little")


def home_cell(route: str, num_cells: int) -> int:
    """The cell a route key belongs to while every cell answers."""
    return cell_order(route, num_cells)[0]
