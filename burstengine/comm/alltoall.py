"""All-to-all between sequence shards and head shards (DeepSpeed-Ulysses), differentiable.

``SeqToHeads.apply(x, group)``: (B, S/G, H, D) sequence shard -> (B, S, H/G, D) head shard,
the G ranks' sequence shards concatenated in rank order; ``HeadsToSeq`` is its inverse.  Each
one's backward is the other.  Used by the hybrid (attention/hybrid.py) and the Ulysses peer
of the benchmark (bench/peers/peer_attention.py).

An optional third argument ``(name, links)`` turns on the byte accounting of comm/stats.py:
``links[r]`` is the link ("intra"/"inter") from this rank to group rank r, None for itself.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..autograd import once_differentiable
from . import stats


def _count(x, account, phase):
    if account is not None:
        name, links = account
        chunk = x.numel() * x.element_size() // len(links)
        for link in links:
            if link is not None:
                stats.record(phase, name, chunk, link)


def seq_to_heads(x, group):
    G = dist.get_world_size(group)
    B, n, H, D = x.shape
    send = x.reshape(B, n, G, H // G, D).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[src] = rank src's tokens for my heads
    return recv.permute(1, 0, 2, 3, 4).reshape(B, G * n, H // G, D)


def heads_to_seq(x, group):
    G = dist.get_world_size(group)
    B, S, h, D = x.shape
    n = S // G
    send = x.reshape(B, G, n, h, D).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    # recv[src] = my tokens for rank src's heads
    return recv.permute(1, 2, 0, 3, 4).reshape(B, n, G * h, D)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, account, to_heads):
        ctx.group, ctx.account, ctx.to_heads = group, account, to_heads
        _count(x, account, "forward")
        return (seq_to_heads if to_heads else heads_to_seq)(x, group)

    @staticmethod
    @once_differentiable("hybrid_attn_func (its all-to-all)")
    def backward(ctx, g):
        _count(g, ctx.account, "backward")
        return (heads_to_seq if ctx.to_heads else seq_to_heads)(g.contiguous(), ctx.group), None, None, None


class SeqToHeads:
    """(B, S/G, H, D) sequence shard -> (B, S, H/G, D) head shard, and back in backward."""

    @staticmethod
    def apply(x, group, account=None):
        return _AllToAll.apply(x, group, account, True)


class HeadsToSeq:
    """(B, S, H/G, D) head shard -> (B, S/G, H, D) sequence shard, and back in backward."""

    @staticmethod
    def apply(x, group, account=None):
        return _AllToAll.apply(x, group, account, False)
