"""Worker functions for tests/bench/test_peers.py (run inside the gloo pool)."""
import torch
import torch.distributed as dist

import burstengine as be
from burstengine.bench.peers import peer_attention as peers
from burstengine.testing import dense_attention, rel_err


def ulysses_vs_dense(group, causal, hkv):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(11 + world)
    B, S, H, D = 2, 8 * world, 4 * world, 16
    q = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, S, hkv * world, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, S, hkv * world, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, _ = dense_attention(qr, kr, vr, causal)
    (ref * do).sum().backward()
    sh = lambda t: be.shard(t, "contiguous", rank, world)
    ql, kl, vl = (sh(t).clone().requires_grad_() for t in (q, k, v))
    out = peers.ulysses(group, "math")(ql, kl, vl, causal)
    (out * sh(do)).sum().backward()
    return [rel_err(out, sh(ref)), rel_err(ql.grad, sh(qr.grad)), rel_err(kl.grad, sh(kr.grad)),
            rel_err(vl.grad, sh(vr.grad))]
