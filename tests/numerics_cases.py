"""Numerically hard calls and repeated calls, run inside the gloo workers."""
import torch
import torch.distributed as dist

import burstengine as be
from burstengine.testing import dense_attention, rel_err

# kind -> (dtype, softmax_scale, what the inputs look like)
KINDS = {
    "logits_1e4": (torch.float32, None),      # q, k scaled so the largest |score| is 1e4
    "bf16_large": (torch.bfloat16, None),     # q, k, v of norm ~1e3 in bf16: scores up to ~1e4
    "f16_large": (torch.float16, None),
    "scale_tiny": (torch.float32, 1e-30),     # every score ~0: uniform attention
    "scale_subnormal": (torch.float32, 1e-42),  # the scale itself is subnormal in fp32
    "scale_huge": (torch.float32, 1e6),       # one-hot attention, |scores| ~1e7
}


def _inputs(kind, world, seed, B=1, n=8, H=4, Hkv=2, D=16):
    g = torch.Generator().manual_seed(seed)
    S = n * world
    q, k, v = (torch.randn(B, S, h, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv))
    if kind == "logits_1e4":
        s = dense_scores(q, k)
        a = (1e4 / s.abs().max()).sqrt()
        q, k = q * a, k * a
    elif kind.endswith("_large"):
        q, k, v = q * 256, k * 256, v * 256  # row norms ~1e3; scores q.k/4 up to ~1e4
    dtype, scale = KINDS[kind]
    # the oracle sees exactly the rounded inputs the kernel sees
    return [t.to(dtype).double() for t in (q, k, v)], dtype, scale


def dense_scores(q, k, scale=None):
    H, Hkv = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kh = k.transpose(1, 2).repeat_interleave(H // Hkv, 1)
    return q.transpose(1, 2) @ kh.transpose(-1, -2) * scale


def extreme(group, kind, layout, backward, causal=True, seed=0):
    """Errors of out, lse and the three gradients against float64, and whether all are finite."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    (q, k, v), dtype, scale = _inputs(kind, world, seed)
    g = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(q.shape, generator=g, dtype=torch.float64)
    gq, gk, gv = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = dense_attention(gq, gk, gv, causal, scale)
    (ref * do).sum().backward()

    def loc(t, dim=1):
        return be.shard(t.detach(), layout, rank, world, dim=dim)

    ql, kl, vl = (loc(t).to(dtype).requires_grad_() for t in (q, k, v))
    out, lse = be.burst_attn_func(ql, kl, vl, group=group, causal=causal, layout=layout, softmax_scale=scale,
                                  backward=backward, return_lse=True)
    (out * loc(do).to(dtype)).sum().backward()
    # dq and dk of a saturated softmax are ~0 in exact arithmetic; any kernel computes them as
    # rounding noise of dS = P (dP - D), so they are measured against the size of the terms that
    # make them: softmax_scale * |dO| * |V| * |K| (|Q| for dk), the bound a float backward meets
    sc = q.shape[-1] ** -0.5 if scale is None else scale
    mx = lambda t: t.abs().max().item()  # noqa: E731
    term = sc * mx(do) * mx(v)
    res = dict(out=rel_err(out, loc(ref)), lse=rel_err(lse, loc(ref_lse, 2)), dv=rel_err(vl.grad, loc(gv.grad)),
               dq=(ql.grad.double() - loc(gq.grad)).abs().max().item() / (term * mx(k)),
               dk=(kl.grad.double() - loc(gk.grad)).abs().max().item() / (term * mx(q)),
               dq_rel=rel_err(ql.grad, loc(gq.grad)), dk_rel=rel_err(kl.grad, loc(gk.grad)))
    res["finite"] = all(bool(torch.isfinite(t).all()) for t in (out, lse, ql.grad, kl.grad, vl.grad))
    return res


def repeat(group, layout, backward, runs=3, seed=0):
    """The same call ``runs`` times (another call in between): are out, lse and the gradients
    bit-identical?  Run under torch.use_deterministic_algorithms(True)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        g = torch.Generator().manual_seed(seed)
        q, k, v, do = (torch.randn(2, 12, h, 16, generator=g) for h in (4, 2, 2, 4))
        results = []
        for i in range(runs):
            ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
            out, lse = be.burst_attn_func(ql, kl, vl, group=group, causal=True, layout=layout, backward=backward,
                                          return_lse=True)
            ((out * do).sum() + lse.sum()).backward()
            results.append([out.detach(), lse.detach(), ql.grad, kl.grad, vl.grad])
            # something else in between, so no state can carry over unnoticed
            be.burst_attn_func(torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), group=group)
    finally:
        torch.use_deterministic_algorithms(prev)
    return [all(torch.equal(a, b) for a, b in zip(results[0], r)) for r in results[1:]]


def extreme_all(group, layouts=("zigzag", "striped"), backwards=("burst", "ring")):
    return [dict(kind=kind, layout=layout, backward=bw, **extreme(group, kind, layout, bw))
            for kind in KINDS for layout in layouts for bw in backwards]


def repeat_all(group, layouts=("zigzag", "striped"), backwards=("burst", "ring")):
    return [dict(layout=layout, backward=bw, same=repeat(group, layout, bw)) for layout in layouts for bw in backwards]
