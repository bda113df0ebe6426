"""Attention of the first ``m`` local query rows of every rank (the "front" of each shard),
forward only.  Sequence-level selective checkpointing (attention/sequence_recompute.py) stores the attention
output of the back of each shard and rebuilds the front with this in the backward.

Within a rank, tokens are in increasing global position in every layout, so the first m rows
are the rank's earliest tokens: under a causal mask they see the fewest keys.  The tasks are
the ordinary schedule's tasks with their query rows cut at m (a causal or strict square block
cut to its top-left a x a corner keeps its mask kind), and only the key rows some rank's cut
tasks read travel the ring: under striped that is the first m rows of every shard, so the
recompute is the causal attention of the global prefix of m*G tokens.
"""
from __future__ import annotations

import torch

from ..kernels import acc_dtype
from ..masks import FULL
from ..schedule import Task, block_tasks
from .loops import RingRun, key_frame


def prefix_tasks(layout: str, causal: bool, q_rank: int, kv_rank: int, world: int, n: int, m: int) -> list[Task]:
    """:func:`block_tasks` with query rows restricted to [0, m)."""
    out = []
    for t in block_tasks(layout, causal, q_rank, kv_rank, world, n):
        q1 = min(t.q1, m)
        if q1 <= t.q0:
            continue
        if t.mask == FULL:
            out.append(Task(t.q0, q1, t.k0, t.k1, FULL))
        else:
            # square causal/strict block: rows [0, a) see only keys [0, a) of it
            a = q1 - t.q0
            out.append(Task(t.q0, q1, t.k0, t.k0 + a, t.mask))
    return out


def prefix_kv_rows(layout: str, causal: bool, world: int, n: int, m: int) -> int:
    """Leading key rows of a shard that some rank's front queries see (the same on all ranks,
    so the ring's buffers match)."""
    return max((t.k1 for r in range(world) for s in range(world)
                for t in prefix_tasks(layout, causal, r, s, world, n, m)), default=0)


def prefix_forward(q, k, v, cfg: RingRun, m: int):
    """(out, lse) of query rows [0, m) of this rank's shard: out (B, m, H, D) in q's dtype,
    lse float32 (B, H, m) (float64 for float64 inputs).  Collective over cfg.ring: every rank
    calls it with the same m."""
    ring, G = cfg.ring, cfg.ring.world
    B, n, H, _ = q.shape
    out = torch.zeros(B, m, H, v.shape[-1], dtype=acc_dtype(q), device=q.device)
    lse = torch.full((B, H, m), float("-inf"), dtype=acc_dtype(q), device=q.device)
    if m == 0:
        return out.to(q.dtype), lse
    # the frame of the call's own passes (loops.key_frame), so the rebuilt rows match them
    k, _, shift = key_frame(q[:, :m], k, cfg, "backward")
    kk = prefix_kv_rows(cfg.layout, cfg.pattern, G, n, m)
    # the recompute runs inside the backward pass: its bytes count there
    kv = ring.mover((k[:, :kk].contiguous(), v[:, :kk].contiguous()), "backward", ("k_recompute", "v_recompute"))
    for i in range(len(ring.steps)):
        kv.post(i)
        kh, vh = kv.held
        for t in prefix_tasks(cfg.layout, cfg.pattern, ring.rank, ring.source(i), G, n, m):
            cfg.kernel.forward_into(q[:, t.q0:t.q1], kh[:, t.k0:t.k1], vh[:, t.k0:t.k1], cfg.scale, t.mask,
                                    out[:, t.q0:t.q1], lse[:, :, t.q0:t.q1])
        kv.advance(i)
    if shift is not None:
        lse += shift
    return out.to(q.dtype), lse
