"""The ring order: which shard a rank holds at each step, and the double ring's steps.

Ranks are grouped into ``nodes`` nodes of ``gpus_per_node`` ranks, node-major (group rank =
node * gpus_per_node + local), as torchrun numbers them (:class:`Topology`).  The double ring
(:func:`double_ring_steps`) runs a round of m = gpus_per_node steps around the node (intra-node
hops), then takes one inter-node hop, ``nodes`` rounds in all; gradient partials follow one step
behind the data.  Plain Python that tests enumerate and the cost model simulates; the rings
that run it are comm/rings.py's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass


def ring_source(rank: int, step: int, world: int, direction: int = 1, nodes: int = 1) -> int:
    """Rank whose travelling shard ``rank`` holds at ``step`` when data moves r -> r + direction.

    One ring (``nodes`` = 1): the shard of (rank - direction * step) mod world.  Double ring of
    ``nodes`` nodes x m = world / nodes ranks, node-major (rank = node * m + local): step
    s = o * m + i is inner step i of round o, and the shard held is that of
    ((node - direction * o) mod nodes, (local - direction * i) mod m): each round goes once
    around the node, and between rounds the shard a rank started the round with moves on to
    the next node.
    """
    if nodes == 1:
        return (rank - direction * step) % world
    m = world // nodes
    o, i = divmod(step, m)
    node, local = divmod(rank, m)
    return ((node - direction * o) % nodes) * m + (local - direction * i) % m


@dataclass(frozen=True)
class Topology:
    """``nodes`` nodes of ``gpus_per_node`` ranks each, node-major."""

    nodes: int
    gpus_per_node: int

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"Topology.{name} must be a positive int, got {v!r}")

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def link(self, src: int, dst: int) -> str:
        """"intra" when ranks ``src`` and ``dst`` share a node, else "inter"."""
        return "intra" if self.node_of(src) == self.node_of(dst) else "inter"

    def spans(self, ranks) -> bool:
        """Whether ``ranks`` lie on more than one node (a group of them crosses the inter-node fabric)."""
        return len({self.node_of(r) for r in ranks}) > 1

    @classmethod
    def parse(cls, spec: str) -> "Topology":
        """"2x4" -> 2 nodes of 4 ranks."""
        m = re.fullmatch(r"\s*(\d+)\s*[xX*]\s*(\d+)\s*", str(spec))
        if not m:
            raise ValueError(f"topology {spec!r} is not of the form 'NODESxGPUS_PER_NODE', e.g. '2x4'")
        return cls(int(m.group(1)), int(m.group(2)))

    def __str__(self) -> str:
        return f"{self.nodes}x{self.gpus_per_node}"


def single(world: int) -> Topology:
    return Topology(1, world)


# --- the double ring's steps: plain data, the same on every rank -------------------------------

@dataclass(frozen=True)
class DoubleStep:
    """What every rank does around the compute of one step of the double ring.

    data_inter / data_intra: post an inter-node / intra-node hop of the shard held now (the
    inter hop at the start of a round; it is waited for at the end of the round).
    next_from: the link the next step's shard arrives on (None after the last step).
    grad_out: the link on which the partial gradient finished at the previous step leaves,
    posted now so it travels during this step's compute.
    grad_in: the links whose partials are added to this step's contribution, after it.
    """

    step: int
    round: int
    inner: int
    data_inter: bool
    data_intra: bool
    next_from: str | None
    grad_out: str | None
    grad_in: tuple[str, ...]


def double_ring_steps(nodes: int, per_node: int) -> list[DoubleStep]:
    """The double ring's steps; after the last one each rank sends its last partial home on
    the "home" hop (to rank (node+1, local+1), the owner of its last source)."""
    m = per_node
    out = []
    for s in range(nodes * m):
        o, i = divmod(s, m)
        last_inner = i == m - 1
        if s == nodes * m - 1:
            nxt = None
        else:
            nxt = "inter" if last_inner else "intra"
        if s == 0:
            gout = None
        else:
            gout = "inter" if (s - 1) % m == m - 1 else "intra"
        gin = (("intra",) if i >= 1 else ()) + (("inter",) if last_inner and o >= 1 else ())
        out.append(DoubleStep(step=s, round=o, inner=i, data_inter=i == 0 and o < nodes - 1,
                            data_intra=i < m - 1, next_from=nxt, grad_out=gout, grad_in=gin))
    return out


def hop_peers(rank: int, nodes: int, per_node: int, link: str) -> tuple[int, int]:
    """(send to, receive from) of ``rank`` on ``link``: "intra" (local + 1), "inter" (node + 1)
    or "home" (both + 1: where the last partial of the double ring belongs)."""
    m = per_node
    a, b = divmod(rank, m)
    da, db = {"intra": (0, 1), "inter": (1, 0), "home": (1, 1)}[link]
    return ((a + da) % nodes) * m + (b + db) % m, ((a - da) % nodes) * m + (b - db) % m


def node_blocks(topo: Topology) -> tuple[list[list[int]], list[list[int]]]:
    """(intra-node blocks, inter-node blocks) of group ranks."""
    m = topo.gpus_per_node
    intra = [[a * m + b for b in range(m)] for a in range(topo.nodes)]
    inter = [[a * m + b for a in range(topo.nodes)] for b in range(m)]
    return intra, inter


def link_hops(nodes: int, per_node: int) -> dict[str, dict[str, int]]:
    """Hops each rank makes per loop: {"data": {"intra": x, "inter": y}, "grad": {...}, "home":
    {...}}; the byte accounting of the double ring (multiply by the message sizes: data and grad
    by traffic.hop_bytes', home, the finished gradient's last hop, by traffic.home_bytes: it
    travels in the inputs' dtype, the partials before it in the accumulator's)."""
    data = {"intra": 0, "inter": 0}
    grad = {"intra": 0, "inter": 0}
    home = {"intra": 0, "inter": 0}
    for p in double_ring_steps(nodes, per_node):
        data["inter"] += p.data_inter
        data["intra"] += p.data_intra
        if p.grad_out:
            grad[p.grad_out] += 1
    if nodes * per_node > 1:
        home["inter" if nodes > 1 else "intra"] += 1
    return {"data": data, "grad": grad, "home": home}
