"""A double-buffered ring over a torch.distributed group: send to rank+1, receive from rank-1.

``shift`` posts the sends and receives at once and returns a handle; the caller computes on
what it holds and calls ``wait`` only when it needs the new buffers.  The same code runs on
NCCL (GPU) and gloo (CPU).  Posting and waiting go through ``fault``: a peer that died or
missed the deadline (``timeout``: BURST_TIMEOUT's seconds) raises ``RankLost`` naming it instead of hanging.

``peers=(next, prev)`` (group ranks) replaces the neighbours for hops that are not rank+1
(the double ring's last gradient hop, comm/rings.py); ``link`` labels the bytes this rank
sends for the byte accounting ("intra" or "inter" node).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import fault, stats
from .dist import rank_of, world_of


class Pending:
    def __init__(self, reqs, bufs, op: fault.Op | None = None):
        self._reqs = reqs
        self._bufs = bufs
        self._op = op

    def wait(self) -> list[torch.Tensor]:
        fault.wait(self._reqs, self._op or fault.Op("ring shift"))
        self._reqs = []
        return self._bufs


class Ring:
    def __init__(self, group=None, link: str = "intra", peers: tuple[int, int] | None = None,
                 timeout: float | None = None, tag: int = 0):
        self.group = group
        # the P2P tag of every message of this ring: the call's (attention/agreement.py), so that
        # on gloo the messages of ranks that run different calls never match (they time out
        # instead: RankLost); NCCL ignores tags
        self.tag = tag
        self.link = link
        self.peers = peers
        self.timeout = timeout  # the deadline of a blocking wait (BURST_TIMEOUT; None: the group's)
        self.world, self.rank = world_of(group), rank_of(group)
        if self.world > 1:
            nxt, prv = peers if peers is not None else ((self.rank + 1) % self.world, (self.rank - 1) % self.world)
            self.next = dist.get_global_rank(group or dist.group.WORLD, nxt)
            self.prev = dist.get_global_rank(group or dist.group.WORLD, prv)

    def peer(self, offset: int) -> int:
        """Global rank of the group member ``offset`` places after this one (mod the world)."""
        return dist.get_global_rank(self.group or dist.group.WORLD, (self.rank + offset) % self.world)

    def shift(self, tensors, phase: str, names, offset: int = 1, link: str | None = None, recv=None) -> Pending:
        """Send ``tensors`` to the rank ``offset`` places on (the next one by default), receive
        tensors from the rank ``offset`` places back: of the shapes ``recv`` (default: those of
        the sent ones).  Every rank must use the same offset at the same call.  A tensor of no
        elements is neither sent nor received: both ends know its shape, so it is made here
        (the trimmed rings of sparse masks send nothing where no later step reads anything).
        A ring built with ``peers`` knows only those two: offset +1 sends to the first and
        receives from the second, -1 the other way.  ``link`` labels the bytes (default: the
        ring's own label)."""
        if self.peers is not None:
            if offset not in (1, -1):
                raise ValueError(f"a ring with fixed peers shifts by +1 or -1, not {offset}")
            dst, src = (self.next, self.prev) if offset == 1 else (self.prev, self.next)
        elif offset % self.world == 1:
            dst, src = self.next, self.prev
        else:
            dst, src = self.peer(offset), self.peer(-offset)
        shapes = [t.shape for t in tensors] if recv is None else list(recv)
        ops, bufs, peers = [], [], []
        for t, shape, name in zip(tensors, shapes, names):
            t = t.contiguous()
            buf = t.new_empty(shape)
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t, dst, self.group, self.tag))
                peers.append(("sending to", dst))
                stats.record(phase, name, t.numel() * t.element_size(), link or self.link)
            if buf.numel():
                ops.append(dist.P2POp(dist.irecv, buf, src, self.group, self.tag))
                peers.append(("receiving from", src))
            bufs.append(buf)
        if not ops:
            return Pending([], bufs)
        # CPU transfers (gloo) block the host in wait(), so a deadline can be enforced there; CUDA
        # ones (NCCL) do not, and must not be made to
        op = fault.Op(f"{phase} ring shift of {', '.join(names)}", tuple(peers), blocking=bufs[0].device.type == "cpu",
                      deadline=self.timeout)
        return Pending(fault.post(lambda: dist.batch_isend_irecv(ops), op), bufs, op)
