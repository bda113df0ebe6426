"""One kernel for a tensor-parallel decode step's gathered heads: unpack, q/k norms, RoPE, and the
new K/V row written into the cache.

A sliced decode step (inference/step.py) all-gathers every rank's q, k and v heads as one buffer
``every`` (W, B, (hq + hk + hv) * D): rank r's row holds its hq query heads, then its hk key heads,
then its hv value heads.  Unpacking them (rank-major heads), norming and roping q and k, and
writing k and v into the cache's slot were five kernels a layer (three compiled unpack kernels and
two ``index_copy_``), each a few microseconds over a few KB: ~5% of an 8B step at 128K over two
ranks (``decode_8b_2gpu_128k_profile2.json``).  Here one program per (sequence, rank, head) reads
its row once and writes it where it goes: q heads to ``q`` (1, B, W hq, D), key heads (roped) and
value heads to the cache's rows at ``slot`` (a device index: the step never reads it on the host).

The arithmetic is :func:`burstengine.model.fused.rms_norm_eager` then ``rope_eager`` on each row,
in float32: the normed row rounded to the input's dtype before the rotation, as the eager path
rounds between them.  Triton is imported with this module: callers import it only on CUDA.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _heads_kernel(EVERY, Q, KC, VC, SLOT, COS, SIN, QW, KW, eps,
                  e_rank, e_seq, q_seq, q_head, k_seq, k_head, k_slot, v_seq, v_head, v_slot, cs_seq,
                  HQ: tl.constexpr, HK: tl.constexpr, HV: tl.constexpr, HEAD_DIM: tl.constexpr,
                  ROPE: tl.constexpr, NORM: tl.constexpr, PLUS_ONE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1)
    j = tl.program_id(2)
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HEAD_DIM)
    src = EVERY + r.to(tl.int64) * e_rank + b * e_seq + j * HEAD_DIM
    raw = tl.load(src + d)
    out_ty = raw.dtype
    if j < HQ + HK:  # a query or key head: its norm, then RoPE
        x = raw.to(tl.float32)
        if ROPE:
            pd = (d + half) % HEAD_DIM  # rotate_half's partner of each element
            xp = tl.load(src + pd).to(tl.float32)
            if NORM:
                inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / HEAD_DIM + eps)
                if j < HQ:
                    w = tl.load(QW + d).to(tl.float32)
                    wp = tl.load(QW + pd).to(tl.float32)
                else:
                    w = tl.load(KW + d).to(tl.float32)
                    wp = tl.load(KW + pd).to(tl.float32)
                if PLUS_ONE:
                    w = 1.0 + w
                    wp = 1.0 + wp
                x = (x * inv * w).to(out_ty).to(tl.float32)
                xp = (xp * inv * wp).to(out_ty).to(tl.float32)
            c = tl.load(COS + b * cs_seq + d).to(tl.float32)
            s = tl.load(SIN + b * cs_seq + d).to(tl.float32)
            x = x * c + tl.where(d < half, -xp, xp) * s
        y = x.to(out_ty)
        if j < HQ:
            tl.store(Q + b * q_seq + (r * HQ + j).to(tl.int64) * q_head + d, y)
        else:
            slot = tl.load(SLOT)
            tl.store(KC + b * k_seq + (r * HK + j - HQ).to(tl.int64) * k_head + slot * k_slot + d, y)
    else:  # a value head, as it came
        slot = tl.load(SLOT)
        tl.store(VC + b * v_seq + (r * HV + j - HQ - HK).to(tl.int64) * v_head + slot * v_slot + d, raw)


def unpack_write(every: torch.Tensor, hq: int, hk: int, hv: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot: torch.Tensor, rope=None, norms=None) -> torch.Tensor:
    """q (1, B, W hq, D) from ``every`` (W, B, (hq + hk + hv) D); its key heads (roped) and value
    heads written to ``k_cache`` / ``v_cache`` (B, W hk, capacity, D) at ``slot`` ((1,) int64,
    on the device).  ``rope`` (cos, sin), each (B, D): q and k arrive raw and are roped here,
    after ``norms`` (q_norm, k_norm: RMSNorm-like, or None); without ``rope`` they came roped."""
    W, B, width = every.shape
    D = width // (hq + hk + hv)
    if width != (hq + hk + hv) * D or hk != hv or every.stride(2) != 1:
        raise ValueError(f"unpack_write: every {tuple(every.shape)} is not W x B x (hq + hk + hv) x D rows "
                         f"for heads {hq}/{hk}/{hv}")
    if k_cache.shape != v_cache.shape or k_cache.shape[:2] != (B, W * hk) or k_cache.shape[3] != D \
            or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError(f"unpack_write: the cache {tuple(k_cache.shape)} does not hold {B} sequences x {W * hk} "
                         f"kv heads of {D} contiguous")
    q = torch.empty(1, B, W * hq, D, dtype=every.dtype, device=every.device)
    qn, kn = norms if norms is not None and norms[0] is not None else (None, None)
    if qn is not None and rope is None:
        raise ValueError("unpack_write: q/k norms apply to raw heads, which come with rope (cos, sin)")
    cos, sin = rope if rope is not None else (q, q)
    if rope is not None and (cos.shape != (B, D) or cos.stride(1) != 1 or sin.stride() != cos.stride()):
        raise ValueError(f"unpack_write: cos/sin must be ({B}, {D}) with contiguous rows, got {tuple(cos.shape)}")
    _heads_kernel[(B, W, hq + hk + hv)](
        every, q, k_cache, v_cache, slot, cos, sin, qn.weight if qn else q, kn.weight if kn else q,
        float(qn.eps) if qn else 0.0,
        every.stride(0), every.stride(1), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), cos.stride(0),
        HQ=hq, HK=hk, HV=hv, HEAD_DIM=D, ROPE=rope is not None, NORM=qn is not None,
        PLUS_ONE=bool(qn and qn.plus_one), num_warps=1)
    return q
