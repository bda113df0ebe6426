"""The rings one attention call runs on: the single ring and the topology-aware double ring
(BurstEngine §3.1, Fig. 4-5), and the travelling data and gradient partials of a loop over them.

The double ring (schedule/order.py's ``double_ring_steps``) runs a round of m = gpus_per_node steps around the node
(intra-node hops), then takes one inter-node hop, ``nodes`` rounds in all.  Three buffers: the
shard being computed on, the intra-node transfer of the next step's shard, and the inter-node
transfer of the next round's shard, which is posted at the start of a round and so overlaps
the whole round.  Gradient partial sums that travel (dQ in the burst backward, dK/dV in the
ring one) go one step behind the data (Fig. 5): around the node during the round, then across
to the next node where the next round's partial of the same shard is finished a round later,
and from the last round straight home.  A one-node ring and a ring of one-rank nodes are the
plain single ring, with exactly its messages in exactly its order.

The plain step data lives in schedule/order.py, the node grouping and the process groups in
comm/topology.py, one ring's hops in comm/ring.py; here are the rings that run the steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from ..schedule.order import Topology, double_ring_steps, hop_peers, node_blocks, ring_source, single
from . import fault
from .dist import rank_of, world_of
from .ring import Ring
from .topology import block_group



class RingComm:
    """The ring(s) of one attention call: a double ring of ``shape`` over ``group`` (a single
    ring when ``shape`` has one node, or one rank per node).  ``labels`` says which node each
    rank is on, for the byte accounting of a single ring that crosses nodes; ``link`` gives
    the single ring's label directly (a ring whose ranks are not node-major, as the hybrid's).
    ``group=LOCAL``: a one-rank ring.  ``timeout``: the deadline of every blocking wait (BURST_TIMEOUT).

    ``steps``: the ring steps the loops run (schedule.run_steps; all of them unless a sparse
    mask leaves some with no work anywhere).  A skipped step costs neither compute nor
    transfer: the travelling shards jump straight to the rank that needs them next (a send
    ``gap`` ranks on).  Only the single ring skips steps, and only it trims messages to the
    rows later steps read (Mover / Reducer ``rows``).

    Loops index the steps that run, i = 0 .. len(steps) - 1; ``direction`` (+1 or -1) is the
    way a loop's data travels, r -> r + direction (the burst backward's Q side travels -1 so
    that its step s pairs the same blocks as the forward's)."""

    def __init__(self, group=None, shape: Topology | None = None, labels: Topology | None = None, mesh=None,
                 link: str | None = None, steps=None, timeout: float | None = None, tag: int = 0):
        self.group = group
        self.world = world_of(group)
        self.rank = rank_of(group)
        self.shape = shape or single(self.world)
        self.labels = labels or self.shape
        self.link = link
        self.timeout, self.tag = timeout, tag
        nodes, m = self.shape.nodes, self.shape.gpus_per_node
        self.double = nodes > 1 and m > 1
        self.steps = tuple(range(self.world)) if steps is None else tuple(steps)
        if self.double and self.steps != tuple(range(self.world)):
            raise ValueError(f"the double ring runs every step; a ring that skips steps {self.steps} must be single")
        self.hops = _double_hops(nodes, m) if self.double else _single_hops(self.steps)
        self.rings: dict[str, Ring] = {}
        if self.world == 1:
            pass
        elif not self.double:
            # one ring: the plain r -> r+1 ring over the group (its hops labelled per send)
            self.rings["ring"] = Ring(group, timeout=timeout, tag=tag)
        else:
            if mesh is not None:
                inter_g, intra_g = mesh.get_group(0), mesh.get_group(1)
            else:
                intra_b, inter_b = node_blocks(self.shape)
                # every rank makes the groups in the same order: intra blocks, then inter ones
                intra_g = block_group(group, intra_b, timeout)
                inter_g = block_group(group, inter_b, timeout)
            self.rings["intra"] = Ring(intra_g, link="intra", timeout=timeout, tag=tag)
            self.rings["inter"] = Ring(inter_g, link="inter", timeout=timeout, tag=tag)
            self.rings["home"] = Ring(group, link="inter", peers=hop_peers(self.rank, nodes, m, "home"),
                                      timeout=timeout, tag=tag)

    def source(self, i: int, direction: int = 1) -> int:
        """Rank whose travelling shard this rank holds at loop index ``i``."""
        return ring_source(self.rank, self.steps[i], self.world, direction, self.shape.nodes)

    def shift(self, key: str, tensors, phase: str, names, gap: int, direction: int, recv=None):
        """Post one hop on ring ``key``, ``gap`` steps along the travel (``recv``: the shapes to
        receive, when they differ from the sent ones; see Ring.shift)."""
        ring = self.rings[key]
        offset = direction * gap
        if key == "ring":
            label = self.link or self.labels.link(self.rank, (self.rank + offset) % self.world)
            return ring.shift(tensors, phase, names, offset, link=label, recv=recv)
        return ring.shift(tensors, phase, names, offset, recv=recv)

    def home(self, tensors, phase: str, names, direction: int, recv=None):
        """Send the last partial of a loop to its owner; return this rank's own."""
        if self.world == 1 or self.steps == (0,):
            return tensors  # nothing travelled: the partial is this rank's own
        if self.double:
            return self.shift("home", tensors, phase, names, 1, direction, recv).wait()
        # from steps[-1] places along the travel, one hop back
        return self.shift("ring", tensors, phase, names, -self.steps[-1], direction, recv).wait()

    def gather(self, t, what: str):
        """Every rank's ``t`` stacked in group rank order, (world, *t.shape), the same on every
        rank.  Point-to-point messages with every other rank in one round, carrying the call's
        tag and bounded by the ring's deadline like the hops: a collective here could pair with
        another call's collective on a rank that went on to it (one that skipped a backward),
        where these time out and name the rank that did not answer.  Not ring traffic: not in
        comm_stats."""
        if self.world == 1:
            return t.unsqueeze(0)
        t = t.contiguous()
        out = t.new_empty((self.world,) + tuple(t.shape))
        out[self.rank] = t
        ops, peers = [], []
        for r in range(self.world):
            if r != self.rank:
                peer = dist.get_global_rank(self.group or dist.group.WORLD, r)
                ops += [dist.P2POp(dist.isend, t, peer, self.group, self.tag),
                        dist.P2POp(dist.irecv, out[r], peer, self.group, self.tag)]
                peers += [("sending to", peer), ("receiving from", peer)]
        op = fault.Op(f"{what} (a message to and from every rank)", tuple(peers), blocking=t.device.type == "cpu",
                      deadline=self.timeout)
        fault.wait(fault.post(lambda: dist.batch_isend_irecv(ops), op), op)
        return out

    def mover(self, tensors, phase: str, names, direction: int = 1, rows=None, dims=None) -> "Mover":
        return Mover(self, tensors, phase, names, direction, rows, dims)

    def reducer(self, phase: str, names, zeros=None, direction: int = 1, rows=None) -> "Reducer":
        return Reducer(self, phase, names, zeros, direction, rows)


@dataclass(frozen=True)
class _Hops:
    """What a loop does around the compute of loop index i (the double ring's step in ring terms):
    ``data``: (ring, gap) hops of the shard held now; ``next_from``: the ring the next held
    shard arrives on; ``grad_out``: the (ring, gap) hop of the partial finished at the last
    index; ``grad_in``: the rings whose partials are added to this index's contribution."""

    data: tuple[tuple[str, int], ...]
    next_from: str | None
    grad_out: tuple[str, int] | None
    grad_in: tuple[str, ...]


def _single_hops(steps) -> list[_Hops]:
    out = []
    for i, s in enumerate(steps):
        last = i + 1 == len(steps)
        out.append(_Hops(data=() if last else (("ring", steps[i + 1] - s),), next_from=None if last else "ring",
                         grad_out=("ring", s - steps[i - 1]) if i else None, grad_in=("ring",) if i else ()))
    return out


def _double_hops(nodes: int, per_node: int) -> list[_Hops]:
    out = []
    for p in double_ring_steps(nodes, per_node):
        data = ((("inter", 1),) if p.data_inter else ()) + ((("intra", 1),) if p.data_intra else ())
        out.append(_Hops(data=data, next_from=p.next_from, grad_out=(p.grad_out, 1) if p.grad_out else None,
                         grad_in=p.grad_in))
    return out


def _trimmed(comm: RingComm, rows) -> None:
    if rows is not None and comm.double:
        raise ValueError("the double ring moves whole shards; trimmed messages need the single ring")


def _with_rows(shape, dim: int, rows: tuple[int, int]):
    return tuple(shape[:dim]) + (rows[1] - rows[0],) + tuple(shape[dim + 1:])


def _rows_of(comm: RingComm, rows, direction: int, owner_index: int, i: int) -> tuple[int, int]:
    """rows[j][i] for j the owner of the shard this rank holds at loop index ``owner_index``."""
    return rows[comm.source(owner_index, direction)][i]


def _add_rows(dst, src, at: int) -> None:
    """Rows [at, at + len) of each ``dst`` tensor (dim 1) += the matching ``src`` tensor."""
    for d, x in zip(dst, src):
        if x.shape[1]:
            d.narrow(1, at, x.shape[1]).add_(x)


class Mover:
    """The travelling shard of one loop: ``held`` is what this index computes on; the hops in
    flight bring the next index's shard (and on the double ring, the next round's).

    ``rows`` (single ring only; schedule.travel_rows): rows[j][i] = [lo, hi) of owner j's
    shard that index i holds; each hop then carries just that part (a rank sends a part of
    what it holds, and nothing when no later step reads the shard), ``held`` is rows
    [offset, offset + len) of the shard and the caller subtracts ``offset`` from its row
    indices.  ``dims``: the row dimension of each tensor (default 1).  None: whole shards."""

    def __init__(self, comm: RingComm, tensors, phase, names, direction, rows=None, dims=None):
        _trimmed(comm, rows)
        self.comm, self.phase, self.names, self.direction = comm, phase, names, direction
        self.rows, self.dims = rows, tuple(dims) if dims is not None else (1,) * len(tensors)
        self.held = tuple(tensors)
        self.offset = 0
        self._pending: dict[str, object] = {}
        self._next_offset = 0

    def _span(self, owner_index: int, i: int) -> tuple[int, int]:
        return _rows_of(self.comm, self.rows, self.direction, owner_index, i)

    def post(self, i: int) -> None:
        for key, gap in self.comm.hops[i].data:
            send, recv = self.held, None
            if self.rows is not None:
                # the part of what this rank holds that index i + 1 (and later) reads, and the
                # part of the next shard it will hold
                lo, hi = self._span(i, i + 1)
                at = lo - self.offset if hi > lo else 0
                send = tuple(t.narrow(d, at, hi - lo) for t, d in zip(self.held, self.dims))
                nxt = self._span(i + 1, i + 1)
                recv = [_with_rows(t.shape, d, nxt) for t, d in zip(self.held, self.dims)]
                self._next_offset = nxt[0]
            self._pending[key] = self.comm.shift(key, send, self.phase, self.names, gap, self.direction, recv)

    def advance(self, i: int) -> None:
        key = self.comm.hops[i].next_from
        if key is not None:
            self.held = tuple(self._pending.pop(key).wait())
            self.offset = self._next_offset


class Reducer:
    """Partial sums of the travelling side's gradients, one step behind the data (Fig. 5).

    ``zeros(rows)``: fresh zero partials covering shard rows ``rows`` = (lo, hi), None for the
    whole shard; partials have their rows on dim 1.  ``rows`` (single ring only;
    schedule.partial_rows): rows[j][i] = [lo, hi) of owner j's partial after index i; the
    contribution at index 0 (this rank's own shard) then stays home, a partial covers just the
    rows the remote steps touched so far (nothing is sent while it is empty), and ``span(i)``
    tells the caller which rows its contribution at index i must cover.  None: every partial
    covers the whole shard and index 0's travels too."""

    def __init__(self, comm: RingComm, phase, names, zeros, direction, rows=None):
        _trimmed(comm, rows)
        self.comm, self.phase, self.names, self.direction = comm, phase, names, direction
        self.zeros, self.rows = zeros, rows
        self._done = None
        self._own = None
        self._pending: dict[str, object] = {}

    def _rows(self, owner_index: int, i: int) -> tuple[int, int]:
        return _rows_of(self.comm, self.rows, self.direction, owner_index, i)

    def span(self, i: int) -> tuple[int, int] | None:
        """The shard rows a contribution at index ``i`` covers (None: all of them)."""
        return None if self.rows is None or i == 0 else self._rows(i, i)

    def post(self, i: int) -> None:
        out = self.comm.hops[i].grad_out
        if out is not None:
            key, gap = out
            recv = None
            if self.rows is not None:
                # the partial of the shard held now, as its last holder finished it
                recv = [_with_rows(t.shape, 1, self._rows(i, i - 1)) for t in self._done]
            self._pending[key] = self.comm.shift(key, self._done, self.phase, self.names, gap, self.direction, recv)
            self._done = None

    def add(self, i: int, contrib) -> None:
        """``contrib``: this index's fresh contributions covering ``span(i)`` (summed into in
        place), or None when this rank had no work there (the partials that arrived pass on as
        they are)."""
        for key in self.comm.hops[i].grad_in:
            recv = self._pending.pop(key).wait()
            if contrib is None:
                contrib = recv
            else:
                # whole shards: row 0 of both; trimmed: where the arrived rows sit in this span
                at = 0 if self.rows is None else self._rows(i, i - 1)[0] - self.span(i)[0]
                _add_rows(contrib, recv, at)
        if self.rows is not None and i == 0:
            # this rank's own step: its contribution waits at home for the partial to return
            self._own, self._done = contrib, self.zeros((0, 0))
            return
        # every rank sends a partial at the next index, work or not (an empty one is not sent)
        self._done = contrib if contrib is not None else self.zeros(self.span(i))

    def home(self, dtype=None):
        """Send the last partial (now the full gradient of the last source) home; return this
        rank's own full gradient.  ``dtype``: one per partial; whole shards' last partials travel
        home in them (the gradients' own dtypes: they are finished, and the caller would round
        them so anyway; half the bytes of float32 on the one hop no compute hides).  A trimmed
        ring's stay float32: they are added to the owner's own contribution at home."""
        last = len(self.comm.steps) - 1
        if self.rows is None:
            done = self._done if dtype is None else [t.to(d) for t, d in zip(self._done, dtype)]
            return self.comm.home(done, self.phase, self.names, self.direction)
        own = self._own if self._own is not None else self.zeros(None)
        if self.comm.world == 1 or last == 0:
            return own
        # the partial of this rank's shard, from the rank that held it last
        rows = self.rows[self.comm.rank][last]
        back = self.comm.home(self._done, self.phase, self.names, self.direction,
                              [_with_rows(t.shape, 1, rows) for t in self._done])
        _add_rows(own, back, rows[0])
        return own
