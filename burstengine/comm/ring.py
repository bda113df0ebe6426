"""A double-buffered ring over a torch.distributed group: send to rank+1, receive from rank-1.

``shift`` posts the sends and receives at once and returns a handle; the caller computes on
what it holds and calls ``wait`` only when it needs the new buffers.  The same code runs on
NCCL (GPU) and gloo (CPU).  Posting and waiting go through ``fault``: a peer that died or
missed the deadline (``BURST_TIMEOUT``) raises ``RankLost`` naming it instead of hanging.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import fault, stats


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

    def shift(self, tensors, phase: str, names) -> Pending:
        """Send ``tensors`` to the next rank, receive same-shaped ones from the previous."""
        ops, bufs = [], []
        for t, name in zip(tensors, names):
            t = t.contiguous()
            buf = torch.empty_like(t)
            ops.append(dist.P2POp(dist.isend, t, self.next, self.group))
            ops.append(dist.P2POp(dist.irecv, buf, self.prev, self.group))
            bufs.append(buf)
            stats.record(phase, name, t.numel() * t.element_size())
        # CPU transfers (gloo) block the host in wait(), so a deadline can be enforced there; CUDA
        # ones (NCCL) do not, and must not be made to
        op = fault.Op(f"{phase} ring shift of {', '.join(names)}",
                      (("sending to", self.next), ("receiving from", self.prev)) * len(bufs),
                      blocking=bufs[0].device.type == "cpu")
        return Pending(fault.post(lambda: dist.batch_isend_irecv(ops), op), bufs, op)
