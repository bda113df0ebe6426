"""A small stand-in transformer block (RMS norm, fused GQA projection, BurstAttention, output
projection, SiLU MLP) and the cases the gloo workers run for seq_checkpoint."""
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

import burstengine as be
from burstengine.testing import rel_err


class Block:
    def __init__(self, d=24, H=4, Hkv=2, D=8, dtype=torch.float64, seed=0):
        g = torch.Generator().manual_seed(seed)
        shapes = dict(wqkv=(d, (H + 2 * Hkv) * D), wo=(H * D, d), w1=(d, 2 * d), w2=(2 * d, d))
        self.p = {k: (torch.randn(*s, generator=g) / math.sqrt(s[0])).to(dtype).requires_grad_()
                  for k, s in shapes.items()}
        self.H, self.Hkv, self.D = H, Hkv, D

    @staticmethod
    def _rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def pre_attn(self, x):
        B, n, _ = x.shape
        # one fused projection split into views: q, k, v are not contiguous, as in real models
        q, k, v = (self._rms(x) @ self.p["wqkv"]).split([self.H * self.D, self.Hkv * self.D, self.Hkv * self.D], -1)
        return q.view(B, n, self.H, self.D), k.view(B, n, self.Hkv, self.D), v.view(B, n, self.Hkv, self.D)

    def post_attn(self, x, o):
        h = x + o.flatten(2) @ self.p["wo"]
        return h + F.silu(self._rms(h) @ self.p["w1"]) @ self.p["w2"]

    def grads(self):
        out = [p.grad.clone() for p in self.p.values()]
        for p in self.p.values():
            p.grad = None
        return out


def against_plain(group, seed, layout, splits, causal=True, n=12, B=2):
    """One block with and without sequence-level checkpointing on this rank's shard: worst
    relative difference of y, dx and the parameter gradients, per split."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    blk = Block(seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    x_full = torch.randn(B, n * world, 24, generator=g, dtype=torch.float64)
    dy_full = torch.randn(B, n * world, 24, generator=g, dtype=torch.float64)
    x = be.shard(x_full, layout, rank, world).clone().requires_grad_()
    dy = be.shard(dy_full, layout, rank, world)
    kw = dict(group=group, causal=causal, layout=layout)

    y0 = blk.post_attn(x, be.burst_attn_func(*blk.pre_attn(x), **kw))
    y0.backward(dy)
    ref = [y0.detach(), x.grad.clone()] + blk.grads()
    res = {}
    for split in splits:
        x.grad = None
        y = be.seq_checkpoint(x, blk.pre_attn, blk.post_attn, split=split, **kw)
        y.backward(dy)
        got = [y.detach(), x.grad.clone()] + blk.grads()
        res[split] = max(rel_err(a, b) for a, b in zip(got, ref))
    return res


def recompute_bytes(group, layout, split, n=16):
    """Bytes this rank sends in the backward of a checkpointed block, by tensor name."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    blk = Block(dtype=torch.float32)
    x = torch.randn(1, n, 24, requires_grad=True)
    with be.comm_stats() as st:
        y = be.seq_checkpoint(x, blk.pre_attn, blk.post_attn, split=split, group=group, layout=layout,
                              backward="burst")
        y.sum().backward()
    return dict(st.by_tensor)


def bad_split_or_shape(group, case):
    blk = Block(dtype=torch.float32)
    x = torch.randn(1, 7 if case == "odd_zigzag" else 8, 24)
    try:
        be.seq_checkpoint(x, blk.pre_attn, blk.post_attn, split=1.5 if case == "split" else 0.5, group=group,
                          layout="zigzag")
    except ValueError as e:
        return str(e)
    return None
