"""Head-context hybrid parallelism (USP): Ulysses all-to-all over heads on one mesh dimension,
the Burst ring over the sequence on the other.

The group's G ranks form a U x R mesh (U = ``ulysses``, the head-parallel degree; R = G / U
ring ranks).  Each rank passes its shard of the sequence in ``layout`` over all G ranks, as for
burst_attn_func.  An all-to-all inside each Ulysses group of U ranks trades sequence for heads:
afterwards a rank holds U sequence shards (S / R tokens) of H / U heads, which, re-ordered by
position, are its shard of the same layout over the R-rank ring; BurstAttention runs on that
ring, and a second all-to-all brings the output back to sequence shards.

Placement: contiguous and zigzag put the U ranks of a Ulysses group next to each other ("head
first", as LoongTrain and USP do: the all-to-all, the heavier exchange, stays inside a node;
rank = r * U + u).  Striped needs the ring index to vary fastest (rank = u * R + r), since a
striped shard over R ranks is made of the striped shards of ranks r, r + R, r + 2R, ...

GQA: K/V heads are split U ways when U divides them; when there are fewer K/V heads than U
(and U is a multiple of them) each K/V head is repeated U / kv_heads times first, so every
rank gets one (the usual Ulysses rule, costmodel.head_split: the cost model predicts by the same
one); otherwise the call is refused.
"""
from __future__ import annotations

import torch

from ..comm import topology as topo
from ..comm.alltoall import HeadsToSeq, SeqToHeads
from ..comm.dist import LOCAL, rank_of
from ..comm.rings import RingComm
from ..costmodel import head_split
from ..layout import position_ids
from . import planning
from .call import AttnCall, MaskArgs
from .loops import RingRun, run_attention
from .prepare import check_call


def hybrid_mesh(layout: str, world: int, ulysses: int) -> tuple[list[list[int]], list[list[int]]]:
    """(Ulysses groups, ring groups) as lists of group ranks; both in mesh order."""
    U, R = ulysses, world // ulysses
    if layout == "striped":
        rank = lambda u, r: u * R + r
    else:
        rank = lambda u, r: r * U + u
    return ([[rank(u, r) for u in range(U)] for r in range(R)], [[rank(u, r) for r in range(R)] for u in range(U)])


def token_order(S: int, layout: str, members: list[int], world: int) -> torch.Tensor:
    """Permutation that sorts the concatenated shards of ``members`` by global position (what
    the all-to-all delivers -> this ring rank's shard of ``layout`` over the ring)."""
    pos = torch.cat([position_ids(S, layout, m, world) for m in members])
    return torch.argsort(pos)


def check_hybrid(q, k, world: int, ulysses) -> int:
    """-> kv heads after head sharding (costmodel.head_split); ValueError (the same on every
    rank) when impossible."""
    if not isinstance(ulysses, int) or isinstance(ulysses, bool) or ulysses < 1:
        raise ValueError(f"ulysses must be a positive int (the head-parallel degree), got {ulysses!r}")
    if world % ulysses:
        raise ValueError(f"ulysses={ulysses} does not divide the group's {world} ranks")
    return head_split(q.shape[2], k.shape[2], ulysses)


def hybrid_attn_func(q, k, v, *, ulysses: int, group=None, causal=False, layout="contiguous", softmax_scale=None,
                     backward="auto", return_lse=False, kernel=None):
    """Exact attention with ``ulysses``-way head parallelism and a Burst ring over the rest.

    Same arguments and result as :func:`burstengine.burst_attn_func` (this rank's output shard,
    and with ``return_lse`` its (batch, heads, seq_local) lse), plus ``ulysses``: the
    head-parallel degree U (1: the plain Burst ring; the group size: pure Ulysses).  U must
    divide the group size and the heads.
    """
    call = AttnCall(group=group, layout=layout, softmax_scale=softmax_scale, backward=backward, kernel=kernel,
                    mask=MaskArgs(causal=causal))

    def planner(world):  # the local stage of the checks: the head split, then the ring's plan
        hkv = check_hybrid(q, k, world, ulysses)
        return planning.plan_hybrid(q, k, call, world, ulysses, hkv), {"ulysses": ulysses,
                                                                        "BURST_CLUSTER": planning.cluster_name()}

    checked = check_call(q, k, v, call, planner)
    plan, world = checked.plan, checked.world
    hkv = head_split(q.shape[2], k.shape[2], ulysses)  # passed the planner: the same on every rank
    U, R = ulysses, world // ulysses
    rank = rank_of(group) if world > 1 else 0
    n = q.shape[1]
    S = n * world
    u_blocks, r_blocks = hybrid_mesh(layout, world, U)
    members = next(b for b in u_blocks if rank in b)
    ring_members = next(b for b in r_blocks if rank in b)
    # sub-groups: every rank makes them in the same order (see topology.block_group)
    ug = topo.block_group(group, u_blocks, plan.timeout) if world > 1 else None
    rg = topo.block_group(group, r_blocks, plan.timeout) if world > 1 else None
    nodes = planning.detect_topology(group) if world > 1 else topo.single(1)
    me = ring_members.index(rank)
    ring = RingComm(LOCAL) if R == 1 else RingComm(
        rg, link=nodes.link(rank, ring_members[(me + 1) % R]), timeout=plan.timeout, tag=checked.tag)
    run = RingRun.of(ring, plan)
    if U == 1:
        out, lse = run_attention(q, k.contiguous(), v.contiguous(), run)
        return (out, lse) if return_lse else out
    if hkv != k.shape[2]:
        k, v = (t.repeat_interleave(hkv // t.shape[2], dim=2) for t in (k, v))
    acct = ("a2a", [None if m == rank else nodes.link(rank, m) for m in members])
    order = token_order(S, layout, members, world).to(q.device)
    back = torch.argsort(order)
    qh, kh, vh = (SeqToHeads.apply(t, ug, acct).index_select(1, order) for t in (q, k, v))
    out, lse = run_attention(qh, kh.contiguous(), vh.contiguous(), run)
    out = HeadsToSeq.apply(out.index_select(1, back), ug, acct)
    if not return_lse:
        return out
    # (B, H/U, S/R) -> (B, S/R, H/U, 1): the same all-to-all brings lse home
    lse = HeadsToSeq.apply(lse.transpose(1, 2).index_select(1, back).unsqueeze(-1).contiguous(), ug, acct)
    return out, lse.squeeze(-1).transpose(1, 2)
