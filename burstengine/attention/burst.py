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

K/V (forward, ring backward) travel r -> r+1 and the Q side (burst backward) r -> r-1, so that
step s pairs the same blocks in all three loops.  With a sparse mask the loops run only the
steps schedule.ring_steps lists (those where some rank has work): a skipped step costs neither
compute nor transfer, since the travelling shards jump straight to where the next step that
runs needs them (a send ``gap`` ranks on), and a travelling accumulator goes home in one
message from wherever it stopped.  Every rank derives the same steps from shared arguments.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..comm.ring import Ring
from ..kernels import Kernel, get_kernel
from .checks import check_args, check_sparse
from .schedule import Pattern, block_tasks, ring_source, ring_steps

def _acc(x):
    # float32 accumulation for everything but float64 inputs (which the tests use as an oracle)
    return torch.float64 if x.dtype == torch.float64 else torch.float32


@dataclass
class _Config:
    ring: Ring
    kernel: Kernel
    pattern: Pattern
    layout: str
    scale: float
    backward: str
    steps: tuple[int, ...]  # the ring steps that run (schedule.ring_steps)


def _forward(q, k, v, cfg: _Config):
    ring, G = cfg.ring, cfg.ring.world
    B, n, H, _ = q.shape
    out = torch.zeros(B, n, H, v.shape[-1], dtype=_acc(q), device=q.device)
    lse = torch.full((B, H, n), float("-inf"), dtype=_acc(q), device=q.device)
    kv = (k, v)
    steps = cfg.steps
    for i, step in enumerate(steps):
        # send ahead to the rank that needs this kv at the next step that runs
        pending = ring.shift(kv, "forward", ("k", "v"), steps[i + 1] - step) if i + 1 < len(steps) else None
        src = ring_source(ring.rank, step, G)
        for t in block_tasks(cfg.layout, cfg.pattern, ring.rank, src, G, n):
            cfg.kernel.forward_into(q[:, t.q0:t.q1], kv[0][:, t.k0:t.k1], kv[1][:, t.k0:t.k1], cfg.scale, t.mask,
                                    out[:, t.q0:t.q1], lse[:, :, t.q0:t.q1])
        if pending is not None:
            kv = pending.wait()
    return out, lse


def _travel(ring: Ring, moving, moving_names, acc_names, compute, zeros, steps, direction: int):
    """The backward ring loop shared by both schemes.

    ``moving`` travels r -> r + ``direction`` per ring step, over the ``steps`` that run (a gap
    of g steps is one send g ranks on).  ``compute(src, moving)``
    does this rank's work on the block whose travelling side belongs to rank ``src`` and returns
    fresh float32 contributions to that side's gradients, or None when it has no work there.
    Those contributions are summed along the ring one step behind the data and finally sent
    home; the return value is this rank's own fully summed gradients of its travelling side.
    """
    G = ring.world
    acc = None
    for i, step in enumerate(steps):
        src = ring_source(ring.rank, step, G, direction)
        pend_move = None
        if i + 1 < len(steps):
            pend_move = ring.shift(moving, "backward", moving_names, direction * (steps[i + 1] - step))
        # the partial sum made at the previous step that ran follows its data by the same hop
        pend_acc = None
        if acc is not None:
            pend_acc = ring.shift(acc, "backward", acc_names, direction * (step - steps[i - 1]))
        contrib = compute(src, moving)
        if pend_acc is not None:
            recv = pend_acc.wait()
            if contrib is None:
                contrib = recv
            else:
                for c, r in zip(contrib, recv):
                    c.add_(r)
        elif contrib is None:
            # every rank sends an accumulator at the next step, work or not
            contrib = zeros(moving)
        acc = contrib
        if pend_move is not None:
            moving = pend_move.wait()
    if len(steps) == 1:
        return acc
    # the accumulator now belongs to the rank steps[-1] places back along the travel: one hop home
    return ring.shift(acc, "backward", acc_names, -direction * steps[-1]).wait()


def _backward_burst(dout, q, k, v, lse, delta, cfg: _Config):
    ring, G = cfg.ring, cfg.ring.world
    n = q.shape[1]
    dk = torch.zeros(k.shape, dtype=_acc(k), device=k.device)
    dv = torch.zeros(v.shape, dtype=_acc(v), device=v.device)

    def zeros(moving):
        return (torch.zeros(moving[0].shape, dtype=_acc(moving[0]), device=moving[0].device),)

    def compute(src, moving):
        tasks = block_tasks(cfg.layout, cfg.pattern, src, ring.rank, G, n)
        if not tasks:
            return None
        mq, mdo, mlse, mdelta = moving
        (dq,) = zeros(moving)
        for t in tasks:
            qs, ks = slice(t.q0, t.q1), slice(t.k0, t.k1)
            cfg.kernel.backward_into(mdo[:, qs], mq[:, qs], k[:, ks], v[:, ks], mlse[:, :, qs], mdelta[:, :, qs],
                                     cfg.scale, t.mask, dq[:, qs], dk[:, ks], dv[:, ks])
        return (dq,)

    # the Q side travels r -> r-1, so step s pairs the same blocks as the forward's step s
    (dq,) = _travel(ring, (q, dout, lse, delta), ("q", "dout", "lse", "delta"), ("dq",), compute, zeros,
                    cfg.steps, -1)
    return dq, dk, dv


def _backward_ring(dout, q, k, v, out, lse, delta, cfg: _Config):
    ring, G = cfg.ring, cfg.ring.world
    n = q.shape[1]
    dq = torch.zeros(q.shape, dtype=_acc(q), device=q.device)

    def zeros(moving):
        return tuple(torch.zeros(m.shape, dtype=_acc(m), device=m.device) for m in moving)

    def compute(src, moving):
        tasks = block_tasks(cfg.layout, cfg.pattern, ring.rank, src, G, n)
        if not tasks:
            return None
        mk, mv = moving
        dk, dv = zeros(moving)
        for t in tasks:
            qs, ks = slice(t.q0, t.q1), slice(t.k0, t.k1)
            cfg.kernel.backward_into(dout[:, qs], q[:, qs], mk[:, ks], mv[:, ks], lse[:, :, qs], delta[:, :, qs],
                                     cfg.scale, t.mask, dq[:, qs], dk[:, ks], dv[:, ks],
                                     out=None if out is None else out[:, qs])
        return dk, dv

    dk, dv = _travel(ring, (k, v), ("k", "v"), ("dk", "dv"), compute, zeros, cfg.steps, 1)
    return dq, dk, dv


def backward_bytes(scheme: str, B: int, n: int, H: int, Hkv: int, D: int, elem: int, world: int,
                   hops: int | None = None) -> int:
    """Bytes one rank sends in the backward of one call (what comm_stats will report).

    ``hops``: sends of the travelling shards, len(schedule.ring_steps) - 1 (world - 1 unless a
    sparse mask lets the ring skip steps)."""
    h = world - 1 if hops is None else hops
    if world == 1 or h == 0:
        return 0
    if scheme == "burst":
        # q, dout in the input dtype + lse, delta in fp32, h hops; dq in fp32, h hops + one home
        return B * n * H * (h * (2 * D * elem + 8) + (h + 1) * D * 4)
    # k, v in the input dtype, h hops; dk, dv in fp32, h hops + one home
    return B * n * Hkv * D * (h * 2 * elem + (h + 1) * 2 * 4)


def forward_bytes(B: int, n: int, Hkv: int, D: int, elem: int, world: int, hops: int | None = None) -> int:
    """Bytes one rank sends in the forward: K and V, once per ring step that runs after the first
    (``hops`` of them, see backward_bytes)."""
    h = world - 1 if hops is None else hops
    return B * n * Hkv * D * 2 * elem * h


def choose_backward(B, n, H, Hkv, D, elem, world, hops=None) -> str:
    burst = backward_bytes("burst", B, n, H, Hkv, D, elem, world, hops)
    ring = backward_bytes("ring", B, n, H, Hkv, D, elem, world, hops)
    return "burst" if burst <= ring else "ring"


class _BurstAttn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cfg, precomputed=None):
        # precomputed = (out, lse) already known (sequence-level checkpointing rebuilds them
        # from a stored part and a recomputed part): skip the ring, keep the backward
        if precomputed is None:
            out32, lse = _forward(q, k, v, cfg)
            out = out32.to(q.dtype)
        else:
            out, lse = precomputed
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
            scheme = choose_backward(B, n, H, k.shape[2], D, q.element_size(), cfg.ring.world,
                                    len(cfg.steps) - 1)
        if scheme == "burst":
            dq, dk, dv = _backward_burst(dout, q, k, v, lse, delta, cfg)
        else:
            dq, dk, dv = _backward_ring(dout, q, k, v, out if dlse is None else None, lse, delta, cfg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _make_config(q, group, causal, layout, softmax_scale, backward, kernel, window=None, cu_seqlens=None,
                 block_mask=None, block_size=None) -> _Config:
    ring = Ring(group)
    pattern = check_sparse(causal, layout, ring.world, q.shape[1], window, cu_seqlens, block_mask, block_size)
    return _Config(ring=ring, kernel=get_kernel(kernel, q.device), pattern=pattern, layout=layout,
                   scale=float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1]),
                   backward=backward, steps=ring_steps(layout, pattern, ring.world, q.shape[1]))


def burst_attn_func(q, k, v, *, group=None, causal=False, layout="contiguous", softmax_scale=None,
                    backward="auto", return_lse=False, kernel=None, window=None, cu_seqlens=None,
                    block_mask=None, block_size=None):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    q: (batch, seq_local, heads, head_dim); k, v: (batch, seq_local, kv_heads, head_dim) with
    heads a multiple of kv_heads.  Each rank passes its shard under ``layout`` (see
    :func:`burstengine.shard`).  Returns this rank's output shard (and, with
    ``return_lse``, the float32 log-sum-exp of shape (batch, heads, seq_local)).

    backward: "burst" moves Q, dO, D, lse and dQ; "ring" moves K, V, dK, dV; "auto" picks the
    one that sends fewer bytes for these shapes.  kernel: "auto", "reference", "flash",
    "cudnn" (or env BURST_KERNEL).

    Sparse masks (positions are global; every rank must pass the same values):

    * ``window=W`` (needs ``causal=True``): each query sees the W most recent keys, itself included.
    * ``cu_seqlens``: packed documents, boundaries 0 = c_0 <= c_1 <= ... <= c_m = global length
      (list, tuple or 1-D integer tensor); nothing is visible across documents, attention
      within one is causal when ``causal`` (bidirectional otherwise).  Combines with ``window``.
    * ``block_mask``: boolean (S/bs, S/bs) matrix over the global sequence cut into blocks of
      ``block_size`` = bs tokens (inferred from its shape); block (i, j) on lets block i see
      block j.  Combines with ``causal`` only.  Under "striped" (the balanced layout, BurstEngine
      Fig. 11) bs must be a multiple of the world size; under "contiguous" bs must divide the
      local length, under "zigzag" half of it.

    Block pairs with nothing visible are not computed, and ring steps no rank needs are not run,
    neither compute nor transfer (e.g. "contiguous" with a window of W <= local length runs 2 of
    the G steps; see schedule.ring_steps).  Rows with no
    visible key get a zero output, lse = -inf and zero gradients.
    """
    check_args(q, k, v, group, causal, layout, softmax_scale, backward)
    cfg = _make_config(q, group, causal, layout, softmax_scale, backward, kernel, window, cu_seqlens, block_mask,
                       block_size)
    out, lse = _BurstAttn.apply(q, k.contiguous(), v.contiguous(), cfg)
    return (out, lse) if return_lse else out
