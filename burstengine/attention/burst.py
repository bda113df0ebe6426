"""BurstAttention: exact attention over a sequence sharded across a ring of ranks (GAO).

Forward: K/V travel the ring; each step's block result is merged into a float32 (O, lse)
with online softmax.  Backward, two schemes over one loop:

* ``burst`` (BurstAttention): K, V, dK, dV stay home; Q, dO, lse, D travel and the dQ
  accumulator follows them one step behind, then hops home.
* ``ring`` (RingAttention): Q, dO, lse, D, dQ stay home; K, V travel and the dK/dV
  accumulators follow one step behind, then hop home.

Travelling accumulators are sent one step late (BurstEngine Fig. 5): the partial sum a rank
finishes at step s travels during step s+1's compute, so it never waits on the compute that
produced it.  The gradient accumulators travel in float32.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..comm.ring import Ring
from ..kernels import Kernel, get_kernel
from .checks import check_args
from .schedule import block_tasks, ring_source

def _acc(x):
    # float32 accumulation for everything but float64 inputs (which the tests use as an oracle)
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@dataclass
class _Config:
    ring: Ring
    kernel: Kernel
    causal: bool
    layout: str
    scale: float
    backward: str


def _forward(q, k, v, cfg: _Config):
    ring, G = cfg.ring, cfg.ring.world
    B, n, H, _ = q.shape
    out = torch.zeros(B, n, H, v.shape[-1], dtype=_acc(q), device=q.device)
    lse = torch.full((B, H, n), float("-inf"), dtype=_acc(q), device=q.device)
    kv = (k, v)
    for step in range(G):
        pending = ring.shift(kv, "forward", ("k", "v")) if step < G - 1 else None
        src = ring_source(ring.rank, step, G)
        for t in block_tasks(cfg.layout, cfg.causal, ring.rank, src, G, n):
            cfg.kernel.forward_into(q[:, t.q0:t.q1], kv[0][:, t.k0:t.k1], kv[1][:, t.k0:t.k1], cfg.scale, t.mask,
                                    out[:, t.q0:t.q1], lse[:, :, t.q0:t.q1])
        if pending is not None:
            kv = pending.wait()
    return out, lse


def _travel(ring: Ring, moving, moving_names, acc_names, compute):
    """The backward ring loop shared by both schemes.

    ``compute(src, moving)`` does this rank's work on the block whose travelling side belongs
    to rank ``src`` and returns fresh float32 contributions to that side's gradients.  Those
    contributions are summed along the ring one step behind the data and finally sent home;
    the return value is this rank's own fully summed gradients of its travelling side.
    """
    G = ring.world
    acc = None
    for step in range(G):
        src = ring_source(ring.rank, step, G)
        pend_move = ring.shift(moving, "backward", moving_names) if step < G - 1 else None
        pend_acc = ring.shift(acc, "backward", acc_names) if acc is not None else None
        contrib = compute(src, moving)
        if pend_acc is not None:
            for c, r in zip(contrib, pend_acc.wait()):
                c.add_(r)
        acc = contrib
        if pend_move is not None:
            moving = pend_move.wait()
    if G == 1:
        return acc
    return ring.shift(acc, "backward", acc_names).wait()


def _backward_burst(dout, q, k, v, lse, delta, cfg: _Config):
    ring, G = cfg.ring, cfg.ring.world
    n = q.shape[1]
    dk = torch.zeros(k.shape, dtype=_acc(k), device=k.device)
    dv = torch.zeros(v.shape, dtype=_acc(v), device=v.device)

    def compute(src, moving):
        mq, mdo, mlse, mdelta = moving
        dq = torch.zeros(mq.shape, dtype=_acc(mq), device=mq.device)
        for t in block_tasks(cfg.layout, cfg.causal, src, ring.rank, G, n):
            qs, ks = slice(t.q0, t.q1), slice(t.k0, t.k1)
            cfg.kernel.backward_into(mdo[:, qs], mq[:, qs], k[:, ks], v[:, ks], mlse[:, :, qs], mdelta[:, :, qs],
                                     cfg.scale, t.mask, dq[:, qs], dk[:, ks], dv[:, ks])
        return (dq,)

    (dq,) = _travel(ring, (q, dout, lse, delta), ("q", "dout", "lse", "delta"), ("dq",), compute)
    return dq, dk, dv


def _backward_ring(dout, q, k, v, out, lse, delta, cfg: _Config):
    ring, G = cfg.ring, cfg.ring.world
    n = q.shape[1]
    dq = torch.zeros(q.shape, dtype=_acc(q), device=q.device)

    def compute(src, moving):
        mk, mv = moving
        dk = torch.zeros(mk.shape, dtype=_acc(mk), device=mk.device)
        dv = torch.zeros(mv.shape, dtype=_acc(mv), device=mv.device)
        for t in block_tasks(cfg.layout, cfg.causal, ring.rank, src, G, n):
            qs, ks = slice(t.q0, t.q1), slice(t.k0, t.k1)
            cfg.kernel.backward_into(dout[:, qs], q[:, qs], mk[:, ks], mv[:, ks], lse[:, :, qs], delta[:, :, qs],
                                     cfg.scale, t.mask, dq[:, qs], dk[:, ks], dv[:, ks],
                                     out=None if out is None else out[:, qs])
        return dk, dv

    dk, dv = _travel(ring, (k, v), ("k", "v"), ("dk", "dv"), compute)
    return dq, dk, dv


def backward_bytes(scheme: str, B: int, n: int, H: int, Hkv: int, D: int, elem: int, world: int) -> int:
    """Bytes one rank sends in the backward of one call (what comm_stats will report)."""
    if world == 1:
        return 0
    if scheme == "burst":
        # q, dout in the input dtype + lse, delta in fp32, G-1 hops; dq in fp32, G hops
        return B * n * H * ((world - 1) * (2 * D * elem + 8) + world * D * 4)
    # k, v in the input dtype, G-1 hops; dk, dv in fp32, G hops
    return B * n * Hkv * D * ((world - 1) * 2 * elem + world * 2 * 4)


def forward_bytes(B: int, n: int, Hkv: int, D: int, elem: int, world: int) -> int:
    return B * n * Hkv * D * 2 * elem * (world - 1)


def choose_backward(B, n, H, Hkv, D, elem, world) -> str:
    burst = backward_bytes("burst", B, n, H, Hkv, D, elem, world)
    ring = backward_bytes("ring", B, n, H, Hkv, D, elem, world)
    return "burst" if burst <= ring else "ring"


class _BurstAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg):
        out32, lse = _forward(q, k, v, cfg)
        out = out32.to(q.dtype)
        ctx.cfg = cfg
        ctx.save_for_backward(q, k, v, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        cfg = ctx.cfg
        if dout is None:
            dout = torch.zeros_like(out)
        dout = dout.contiguous()
        # D = rowsum(dO * O); a gradient flowing into lse enters as D - dlse, since
        # d lse_i / d s_ij = P_ij makes dS = P * (dP - D + dlse)
        acc = _acc(q)
        delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2).contiguous()
        if dlse is not None:
            delta = delta - dlse.to(acc)
        scheme = cfg.backward
        if scheme == "auto":
            B, n, H, D = q.shape
            scheme = choose_backward(B, n, H, k.shape[2], D, q.element_size(), cfg.ring.world)
        if scheme == "burst":
            dq, dk, dv = _backward_burst(dout, q, k, v, lse, delta, cfg)
        else:
            dq, dk, dv = _backward_ring(dout, q, k, v, out if dlse is None else None, lse, delta, cfg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def burst_attn_func(q, k, v, *, group=None, causal=False, layout="contiguous", softmax_scale=None,
                    backward="auto", return_lse=False, kernel=None):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    q: (batch, seq_local, heads, head_dim); k, v: (batch, seq_local, kv_heads, head_dim) with
    heads a multiple of kv_heads.  Each rank passes its shard under ``layout`` (see
    :func:`burstengine.shard`).  Returns this rank's output shard (and, with
    ``return_lse``, the float32 log-sum-exp of shape (batch, heads, seq_local)).

    backward: "burst" moves Q, dO, D, lse and dQ; "ring" moves K, V, dK, dV; "auto" picks the
    one that sends fewer bytes for these shapes.  kernel: "auto", "reference", "flash",
    "cudnn" (or env BURST_KERNEL).
    """
    check_args(q, k, v, group, causal, layout, softmax_scale, backward, kernel)
    ring = Ring(group)
    D = q.shape[-1]
    cfg = _Config(ring=ring, kernel=get_kernel(kernel, q.device), causal=causal, layout=layout,
                  scale=float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(D),
                  backward=backward)
    out, lse = _BurstAttn.apply(q, k.contiguous(), v.contiguous(), cfg)
    return (out, lse) if return_lse else out
