"""A double-buffered ring over a torch.distributed group: send to rank+1, receive from rank-1.

``shift`` posts the sends and receives at once and returns a handle; the caller computes on
what it holds and calls ``wait`` only when it needs the new buffers.  The same code runs on
NCCL (GPU) and gloo (CPU).

``peers=(next, prev)`` (group ranks) replaces the neighbours for hops that are not rank+1
(the double ring's last gradient hop, comm/topology.py); ``link`` labels the bytes this rank
sends for the byte accounting ("intra" or "inter" node).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import stats


class Pending:
    def __init__(self, reqs, bufs):
        self._reqs = reqs
        self._bufs = bufs

    def wait(self) -> list[torch.Tensor]:
        for r in self._reqs:
            r.wait()
        self._reqs = []
        return self._bufs


class Ring:
    def __init__(self, group=None, link: str = "intra", peers: tuple[int, int] | None = None):
        self.group = group
        self.link = link
        if dist.is_available() and dist.is_initialized():
            self.world = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        else:
            self.world, self.rank = 1, 0
        if self.world > 1:
            nxt, prv = peers if peers is not None else ((self.rank + 1) % self.world, (self.rank - 1) % self.world)
            self.next = dist.get_global_rank(group or dist.group.WORLD, nxt)
            self.prev = dist.get_global_rank(group or dist.group.WORLD, prv)

    def shift(self, tensors, phase: str, names) -> Pending:
        """Send ``tensors`` to the next rank, receive same-shaped ones from the previous."""
        ops, bufs = [], []
        for t, name in zip(tensors, names):
            t = t.contiguous()
            buf = torch.empty_like(t)
            ops.append(dist.P2POp(dist.isend, t, self.next, self.group))
            ops.append(dist.P2POp(dist.irecv, buf, self.prev, self.group))
            bufs.append(buf)
            stats.record(phase, name, t.numel() * t.element_size(), self.link)
        return Pending(dist.batch_isend_irecv(ops), bufs)
