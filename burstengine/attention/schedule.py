"""Which query rows meet which key rows at each ring step: plain Python, no tensors.

At ring step s of a G-rank ring, rank r holds the K/V shard of rank (r - s) mod G in the
forward (and the Q-side shard of rank (r - s) mod G in the burst backward); on a double ring
(``nodes`` > 1, see comm/topology.py) the order of the steps changes, not their set.  Whether the
block pair (q shard of rank qr, kv shard of rank kr) is fully visible, causal, strictly
causal or skipped depends only on the layout, and is described here as a list of
:class:`Task` items so that tests can count the work of every rank at every step without
running attention.
"""
from __future__ import annotations

from dataclasses import dataclass

# mask kinds understood by every kernel (kernels/base.py)
FULL = "full"        # every query sees every key
CAUSAL = "causal"    # square block, query i sees keys j <= i (top-left aligned)
STRICT = "strict"    # square block, query i sees keys j < i (striped: key rank after query rank)
MASKS = (FULL, CAUSAL, STRICT)


@dataclass(frozen=True)
class Task:
    """Query rows [q0, q1) of the local q shard meet key rows [k0, k1) of the kv shard."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: str

    def visible_pairs(self) -> int:
        nq, nk = self.q1 - self.q0, self.k1 - self.k0
        if self.mask == FULL:
            return nq * nk
        if self.mask == CAUSAL:
            return nq * (nq + 1) // 2
        return nq * (nq - 1) // 2


def ring_source(rank: int, step: int, world: int, nodes: int = 1) -> int:
    """Rank whose travelling shard ``rank`` holds at ``step``.

    One ring (``nodes`` = 1): data moves r -> r+1, so the shard of (rank - step) mod world.
    Double ring of ``nodes`` nodes x m = world / nodes ranks, node-major (rank = node * m +
    local): step s = o * m + i is inner step i of round o, and the shard held is that of
    ((node - o) mod nodes, (local - i) mod m): each round goes once around the node, and
    between rounds the shard a rank started the round with moves on to the next node.
    """
    if nodes == 1:
        return (rank - step) % world
    m = world // nodes
    o, i = divmod(step, m)
    node, local = divmod(rank, m)
    return ((node - o) % nodes) * m + (local - i) % m


def block_tasks(layout: str, causal: bool, q_rank: int, kv_rank: int, world: int, n: int) -> list[Task]:
    """Tasks for the q shard of ``q_rank`` against the kv shard of ``kv_rank``; n = local length."""
    if not causal:
        return [Task(0, n, 0, n, FULL)]
    if q_rank == kv_rank:
        return [Task(0, n, 0, n, CAUSAL)]
    if layout == "contiguous":
        return [Task(0, n, 0, n, FULL)] if kv_rank < q_rank else []
    if layout == "zigzag":
        h = n // 2
        if kv_rank < q_rank:
            # both q chunks come after the kv rank's early chunk; its late chunk is after both
            return [Task(0, n, 0, h, FULL)]
        # only the q rank's late chunk comes after the kv rank's two chunks
        return [Task(h, n, 0, n, FULL)]
    if layout == "striped":
        # q index i is global i*G + q_rank, kv index j is j*G + kv_rank
        return [Task(0, n, 0, n, CAUSAL if kv_rank < q_rank else STRICT)]
    raise ValueError(f"unknown layout {layout!r}")


def forward_schedule(layout: str, causal: bool, rank: int, world: int, n: int, nodes: int = 1) -> list[list[Task]]:
    """Per step, the tasks rank ``rank`` computes in the forward (its q vs travelling kv)."""
    return [block_tasks(layout, causal, rank, ring_source(rank, s, world, nodes), world, n) for s in range(world)]


def step_work(layout: str, causal: bool, world: int, n: int, nodes: int = 1) -> list[list[int]]:
    """Visible (query, key) pairs computed by each rank at each step: work[step][rank]."""
    return [
        [sum(t.visible_pairs() for t in block_tasks(layout, causal, r, ring_source(r, s, world, nodes), world, n))
         for r in range(world)]
        for s in range(world)
    ]
