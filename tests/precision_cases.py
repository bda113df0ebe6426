"""Precision through the ring: inputs whose scores share a large offset, run in the gloo workers.

Every key shares a component (k = k0 + offset * u, u a unit vector per kv head) and the
queries lean along it (q = q0 + lean * u): each score is scale * offset * (lean + q0.u) plus an
O(1) part.  The softmax sees only the O(1) part, but every lse is large, and the dq of a row
is a sum of dS times keys of size ``offset`` that cancels to O(1): float32 gets it right only
if the P the backward rebuilds sums exactly to the weights the forward's output was made with.
"""
import random

import torch
import torch.distributed as dist

import burstengine as be
from burstengine.testing import dense_attention, rel_err

NAMES = ("out", "lse", "dq", "dk", "dv")
LAYOUTS = ("contiguous", "zigzag", "striped")
BACKWARDS = ("ring", "burst")


def random_case(rng: random.Random) -> dict:
    """A fuzzed input: offset log-uniform in [10, 3000], lean in [-2, 2], causal or not, any seed."""
    return dict(offset=10 ** rng.uniform(1, 3.5), lean=rng.uniform(-2, 2), causal=rng.random() < 0.7,
                seed=rng.randrange(1 << 30))


def inputs(offset, seed, lean=1.0, S=192, B=1, H=4, Hkv=2, D=64):
    """Global float64 (q, k, v, dout, dlse), each exactly representable in float32."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, S, h, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv, H))
    u = torch.randn(1, 1, Hkv, D, generator=g, dtype=torch.float64)
    u = u / u.norm(dim=-1, keepdim=True)
    k = k + offset * u
    q = q + lean * u.repeat_interleave(H // Hkv, dim=2)
    dlse = torch.randn(B, H, S, generator=g, dtype=torch.float64)
    return [t.float().double() for t in (q, k, v, do, dlse)]


def reference(q, k, v, do, dlse, causal, with_lse, dtype=torch.float64):
    """(out, lse, dq, dk, dv) of dense attention in ``dtype`` (float64: the oracle; float32:
    what plain torch gets), in float64."""
    qr, kr, vr = (t.to(dtype).detach().requires_grad_() for t in (q, k, v))
    out, lse = dense_attention(qr, kr, vr, causal)
    loss = (out * do.to(dtype)).sum()
    if with_lse:
        loss = loss + (lse * dlse.to(dtype)).sum()
    loss.backward()
    return [t.detach().double() for t in (out, lse, qr.grad, kr.grad, vr.grad)]


def ring(group, q, k, v, do, dlse, causal, layout, backward, with_lse, split=None):
    """This rank's (out, lse or None, dq, dk, dv) of float32 burst_attn_func on the global
    inputs; with ``split``, of seq_checkpoint around the attention alone (no lse)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)

    def loc(t, dim=1):
        return be.shard(t, layout, rank, world, dim=dim).float()

    kw = dict(group=group, causal=causal, layout=layout, backward=backward)
    if split is not None:
        # the block is the attention alone: x holds this rank's q, k, v side by side
        parts = [loc(t) for t in (q, k, v)]
        x = torch.cat([t.flatten(2) for t in parts], -1).requires_grad_()

        def pre_attn(x):
            return [c.view(t.shape) for c, t in zip(x.split([t[0, 0].numel() for t in parts], -1), parts)]

        out = be.seq_checkpoint(x, pre_attn, lambda x, o: o, split=split, **kw)
        (out * loc(do)).sum().backward()
        return [out.detach(), None] + pre_attn(x.grad)
    ql, kl, vl = (loc(t).requires_grad_() for t in (q, k, v))
    res = be.burst_attn_func(ql, kl, vl, return_lse=with_lse, **kw)
    out, lse = res if with_lse else (res, None)
    loss = (out * loc(do)).sum()
    if with_lse:
        loss = loss + (lse * loc(dlse, dim=2)).sum()
    loss.backward()
    return [None if t is None else t.detach() for t in (out, lse, ql.grad, kl.grad, vl.grad)]


def errors(parts, layout, ref) -> dict:
    """{name: normwise error vs ``ref``} of the gathered ranks' ``parts`` (ring's results)."""
    res = {}
    for i, name in enumerate(NAMES):
        if parts[0][i] is not None:
            whole = be.unshard([p[i] for p in parts], layout, dim=2 if name == "lse" else 1)
            res[name] = rel_err(whole, ref[i])
    return res


def ring_errors(group, case: dict, layouts=LAYOUTS, backwards=BACKWARDS, with_lse=(False, True), split=None):
    """Errors against float64 of every (layout, backward, return_lse) on ``case``'s input (the
    same global input whatever the world size): [dict(layout, backward, with_lse, **errors)].
    ``split``: through seq_checkpoint with that split instead (with_lse must be (False,))."""
    q, k, v, do, dlse = inputs(case["offset"], case["seed"], case["lean"])
    world = dist.get_world_size(group)
    rows = []
    for wl in with_lse:
        ref = reference(q, k, v, do, dlse, case["causal"], wl)
        for layout in layouts:
            for bw in backwards:
                mine = ring(group, q, k, v, do, dlse, case["causal"], layout, bw, wl, split)
                parts = [None] * world
                dist.all_gather_object(parts, mine, group=group)
                rows.append(dict(layout=layout, backward=bw, with_lse=wl, **errors(parts, layout, ref)))
    return rows
