"""Local attention in plain torch: runs on any device, accumulates in float32 (float64 for
float64 inputs).  It is both the CPU kernel and the oracle the tests compare against.

Query rows are processed in chunks so that the score matrix never exceeds ~32M elements.
"""
from __future__ import annotations

import torch

from ..masks import visible_mask
from .base import Kernel, acc_dtype

_MAX_SCORES = 1 << 25


def _heads_first(x, acc, groups=1):
    # (B, S, H, D) -> (B, H*groups, S, D) in the accumulation dtype (kv heads repeated for GQA)
    x = x.transpose(1, 2).to(acc)
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _chunk(B, H, sq, sk):
    return max(1, min(sq, _MAX_SCORES // max(1, B * H * sk)))


def _scores(qc, k, scale, vis, r0, r1):
    s = torch.matmul(qc, k.transpose(-1, -2)) * scale
    if vis is not None:
        s = s.masked_fill(~vis[r0:r1], float("-inf"))
    return s


class ReferenceKernel(Kernel):
    name = "reference"

    def available(self, device):
        return True

    def forward(self, q, k, v, scale, mask):
        acc = acc_dtype(q)
        B, Sq, H, _ = q.shape
        g = H // k.shape[2]
        qh, kh, vh = _heads_first(q, acc), _heads_first(k, acc, g), _heads_first(v, acc, g)
        Sk = kh.shape[2]
        vis = visible_mask(mask, Sq, Sk, q.device)
        out = torch.empty(B, H, Sq, vh.shape[-1], dtype=acc, device=q.device)
        lse = torch.empty(B, H, Sq, dtype=acc, device=q.device)
        step = _chunk(B, H, Sq, Sk)
        for r0 in range(0, Sq, step):
            r1 = min(Sq, r0 + step)
            s = _scores(qh[:, :, r0:r1], kh, scale, vis, r0, r1)
            l = torch.logsumexp(s, dim=-1)
            # rows with nothing visible have lse = -inf; subtracting 0 there keeps p = 0, not NaN
            p = torch.exp(s - torch.where(torch.isinf(l), 0.0, l).unsqueeze(-1))
            out[:, :, r0:r1] = torch.matmul(p, vh)
            lse[:, :, r0:r1] = l
        return out.transpose(1, 2), lse.to(torch.float32) if acc == torch.float32 else lse

    def backward(self, dout, q, k, v, lse, delta, scale, mask, out=None):
        acc = acc_dtype(q)
        B, Sq, H, _ = q.shape
        Hkv = k.shape[2]
        g = H // Hkv
        qh, kh, vh = _heads_first(q, acc), _heads_first(k, acc, g), _heads_first(v, acc, g)
        doh = _heads_first(dout, acc)
        Sk = kh.shape[2]
        vis = visible_mask(mask, Sq, Sk, q.device)
        lse = lse.to(acc)
        delta = delta.to(acc)
        dq = torch.empty_like(qh)
        dk = torch.zeros_like(kh)
        dv = torch.zeros_like(vh)
        step = _chunk(B, H, Sq, Sk)
        for r0 in range(0, Sq, step):
            r1 = min(Sq, r0 + step)
            s = _scores(qh[:, :, r0:r1], kh, scale, vis, r0, r1)
            l = lse[:, :, r0:r1]
            p = torch.exp(s - torch.where(torch.isinf(l), 0.0, l).unsqueeze(-1))
            do = doh[:, :, r0:r1]
            dv += torch.matmul(p.transpose(-1, -2), do)
            dp = torch.matmul(do, vh.transpose(-1, -2))
            ds = p * (dp - delta[:, :, r0:r1].unsqueeze(-1))
            dq[:, :, r0:r1] = torch.matmul(ds, kh) * scale
            dk += torch.matmul(ds.transpose(-1, -2), qh[:, :, r0:r1]) * scale
        if g > 1:
            dk = dk.view(B, Hkv, g, Sk, -1).sum(2)
            dv = dv.view(B, Hkv, g, Sk, -1).sum(2)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
