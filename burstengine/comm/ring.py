"""A double-buffered ring over a torch.distributed group: send to rank+1, receive from rank-1.

``shift`` posts the sends and receives at once and returns a handle; the caller computes on
what it holds and calls ``wait`` only when it needs the new buffers.  The same code runs on
NCCL (GPU) and gloo (CPU).
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
    def __init__(self, group=None):
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.world = dist.get_world_size(group)
            self.rank = dist.get_rank(group)
        else:
            self.world, self.rank = 1, 0
        if self.world > 1:
            self.next = dist.get_global_rank(group or dist.group.WORLD, (self.rank + 1) % self.world)
            self.prev = dist.get_global_rank(group or dist.group.WORLD, (self.rank - 1) % self.world)

    def peer(self, offset: int) -> int:
        """Global rank of the group member ``offset`` places after this one (mod the world)."""
        return dist.get_global_rank(self.group or dist.group.WORLD, (self.rank + offset) % self.world)

    def shift(self, tensors, phase: str, names, offset: int = 1) -> Pending:
        """Send ``tensors`` to the rank ``offset`` places on (the next one by default), receive
        same-shaped ones from the rank ``offset`` places back.  Every rank must use the same
        offset at the same call."""
        if offset % self.world == 1:
            dst, src = self.next, self.prev
        else:
            dst, src = self.peer(offset), self.peer(-offset)
        ops, bufs = [], []
        for t, name in zip(tensors, names):
            t = t.contiguous()
            buf = torch.empty_like(t)
            ops.append(dist.P2POp(dist.isend, t, dst, self.group))
            ops.append(dist.P2POp(dist.irecv, buf, src, self.group))
            bufs.append(buf)
            stats.record(phase, name, t.numel() * t.element_size())
        return Pending(dist.batch_isend_irecv(ops), bufs)
