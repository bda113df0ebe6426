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
steps schedule.run_steps lists (those where some rank has work): a skipped step costs neither
compute nor transfer, since the travelling shards jump straight to where the next step that
runs needs them (a send ``gap`` ranks on), and a travelling accumulator goes home in one
message from wherever it stopped.  The hops of a sparse mask's single ring carry only the rows
later steps read (schedule.travel_rows): the receiver holds that part of the shard and the
tasks subtract its offset; the travelling gradient partial covers only the rows remote steps
touched, and the step on a rank's own shard stays home.  Every rank derives the same steps and
message sizes from shared arguments.

The loops run on a :class:`~burstengine.comm.rings.RingComm`: one ring, or the
topology-aware double ring (intra-node rounds, inter-node hops overlapping a whole round; it runs
every step, so calls that skip steps use the single ring); which shard is held at each step
comes from ``ring.source(i, direction)``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..autograd import once_differentiable
from ..comm.rings import RingComm
from ..kernels import Kernel, acc_dtype
from ..masks import Pattern
from ..schedule import block_tasks, partial_rows, travel_rows
from .planning import CallPlan


def _zeros(x, rows=None):
    """Float32 (float64 for float64 x) zeros shaped like x with rows [lo, hi) of dim 1 (None: all)."""
    n = x.shape[1] if rows is None else rows[1] - rows[0]
    return torch.zeros((x.shape[0], n) + tuple(x.shape[2:]), dtype=acc_dtype(x), device=x.device)


def _rel(start: int, lo: int, hi: int) -> slice:
    """Shard rows [lo, hi) of a buffer that holds the shard's rows from ``start`` on."""
    return slice(lo - start, hi - start)


@dataclass(frozen=True)
class RingRun:
    """What the loops run: one call's ring (it knows the steps that run, ring.steps) and what
    its plan (attention/planning.py) decided: kernel, mask pattern, layout, scale, backward."""

    ring: RingComm
    kernel: Kernel
    pattern: Pattern
    layout: str
    scale: float
    backward: str

    @classmethod
    def of(cls, ring: RingComm, plan: CallPlan) -> "RingRun":
        return cls(ring, plan.kernel, plan.pattern, plan.layout, plan.scale, plan.backward)

    def trim(self, side: str, n: int):
        """(travel rows, partial rows) of this call's messages (schedule.travel_rows /
        partial_rows) for the side that travels; (None, None) where whole shards travel: dense
        masks, and the double ring."""
        if self.ring.double or self.ring.world == 1 or not self.pattern.sparse:
            return None, None
        args = (self.layout, self.pattern, self.ring.world, n, side)
        return travel_rows(*args), partial_rows(*args)


def key_frame(q, k, cfg: RingRun, phase: str):
    """(the keys the kernels see, kappa per query head or None, lse shift or None) of one call.

    Why: a kernel hands back each block's lse rounded to float32 (float64 for float64 inputs),
    an error of half an ulp of |lse|.  One kernel does not suffer from it: it normalises the
    block's output with the unrounded sum, and the backward's P = exp(S - lse) is then off by
    one factor per row that D = rowsum(dO * O) shares.  The ring does: it weighs block b by
    exp(lse_b - lse) from the rounded lse_b, the backward by exp(S - lse) from the scores, so
    the P of a row stops matching the weights its D was made with, by ~ulp(|lse_b|) and
    differently per block (so more with more ranks), and dQ = scale * sum_j dS_ij K_j
    multiplies that misfit by |K|.  A component every key shares (a bias, a massive
    activation) makes both large at once: lse ~ scale * q.k_shared, |K| ~ |k_shared|.

    Softmax is blind to a shift every key shares (row i's scores all move by scale * q_i.kappa),
    so the kernels run on K - kappa: every block of a row is computed in one per-row frame, the
    lses they return are small numbers that round finely, and dQ sums dS times K - kappa (the
    dS of a row sum to 0).  The lse goes back to the caller's frame by adding scale * q.kappa;
    kappa is a constant of the call (the lse's derivative through it is zero: its terms in q
    and in P cancel), so dK is the kernels' dK, and dQ gains scale * dlse * kappa.

    kappa: per (batch, kv head, dim), the mean of every key of the ring where all of them lie
    within a factor 2 of it (then K - kappa is exact, Sterbenz's lemma: the kernels see exactly
    the shifted keys, nothing is rounded anew), else 0.  Keys with no shared component get
    kappa = 0: the kernels' inputs, and every result, are bit for bit the unshifted ones.  It
    must be the same vector on every rank (all blocks of a row in one frame): each rank's key
    sum, min and max, (3, B, Hkv, D), go to every rank once per pass (RingComm.gather), nothing
    for a one-rank ring.  Half-precision keys are left as they are:
    the kernels' own P and dS in half precision err more than the lse's float32 rounding."""
    B, n, Hkv, D = k.shape
    if k.dtype != acc_dtype(k) or n == 0:
        return k, None, None
    ring = cfg.ring
    every = ring.gather(torch.stack([k.sum(1), k.amin(1), k.amax(1)]), f"the {phase} ring's shared key component")
    mean = every[:, 0].sum(0) / (n * ring.world)
    lo, hi = every[:, 1].amin(0), every[:, 2].amax(0)
    exact = torch.where(mean > 0, (lo >= mean / 2) & (hi <= 2 * mean), (hi <= mean / 2) & (lo >= 2 * mean))
    kappa = torch.where(exact & torch.isfinite(mean), mean, 0.0)
    per_head = kappa.repeat_interleave(q.shape[2] // Hkv, dim=1)  # query head h reads kv head h // g
    shift = torch.einsum("bnhd,bhd->bhn", q, per_head) * cfg.scale
    return k - kappa.unsqueeze(1), per_head, shift


def _forward(q, k, v, cfg: RingRun):
    ring, G = cfg.ring, cfg.ring.world
    k, _, shift = key_frame(q, k, cfg, "forward")
    B, n, H, _ = q.shape
    out = torch.zeros(B, n, H, v.shape[-1], dtype=acc_dtype(q), device=q.device)
    lse = torch.full((B, H, n), float("-inf"), dtype=acc_dtype(q), device=q.device)
    # a sparse mask's hops carry only the K/V rows later steps read; kv.offset places them
    kv = ring.mover((k, v), "forward", ("k", "v"), rows=cfg.trim("kv", n)[0])
    for i in range(len(ring.steps)):
        kv.post(i)  # the next step's (and at a round start the next round's) shards travel now
        kh, vh = kv.held
        for t in block_tasks(cfg.layout, cfg.pattern, ring.rank, ring.source(i), G, n):
            ks = _rel(kv.offset, t.k0, t.k1)
            cfg.kernel.forward_into(q[:, t.q0:t.q1], kh[:, ks], vh[:, ks], cfg.scale, t.mask,
                                    out[:, t.q0:t.q1], lse[:, :, t.q0:t.q1])
        kv.advance(i)
    if shift is not None:
        lse += shift  # rows that see nothing stay -inf
    return out, lse


def _travel(ring: RingComm, moving, moving_names, acc_names, compute, zeros, direction: int, trim=(None, None),
            dims=None, home_dtype=None):
    """The backward ring loop shared by both schemes.

    ``moving`` travels r -> r + ``direction``.  ``compute(src, moving, offset, span)`` does this
    rank's work on the block whose travelling side belongs to rank ``src`` (``moving`` holds
    that side's rows from ``offset`` on) and returns fresh float32 contributions to that side's
    gradients covering shard rows ``span`` (None: all), or None when it has no work there.
    Those contributions are summed along the ring one step behind the data and finally sent
    home; the return value is this rank's own fully summed gradients of its travelling side.
    ``trim``: (travel rows, partial rows) of a sparse mask's single ring (cfg.trim), ``dims``
    the row dimension of each moving tensor; ``zeros(rows)`` makes zero partials;
    ``home_dtype``: the dtypes whole shards' finished gradients travel home in (Reducer.home).
    """
    data = ring.mover(moving, "backward", moving_names, direction, rows=trim[0], dims=dims)
    acc = ring.reducer("backward", acc_names, zeros, direction, rows=trim[1])
    for i in range(len(ring.steps)):
        data.post(i)
        acc.post(i)  # the partial finished at the previous step, one step behind the data
        acc.add(i, compute(ring.source(i, direction), data.held, data.offset, acc.span(i)))
        data.advance(i)
    return acc.home(home_dtype)


def _backward_burst(dout, q, k, v, lse, delta, cfg: RingRun):
    ring, G = cfg.ring, cfg.ring.world
    n = q.shape[1]
    dk, dv = _zeros(k), _zeros(v)

    def zeros(rows):
        return (_zeros(q, rows),)

    def compute(src, moving, off, span):
        tasks = block_tasks(cfg.layout, cfg.pattern, src, ring.rank, G, n)
        if not tasks:
            return None
        mq, mdo, mlse, mdelta = moving
        (dq,) = zeros(span)
        g0 = 0 if span is None else span[0]
        for t in tasks:
            qs, gs, ks = _rel(off, t.q0, t.q1), _rel(g0, t.q0, t.q1), slice(t.k0, t.k1)
            cfg.kernel.backward_into(mdo[:, qs], mq[:, qs], k[:, ks], v[:, ks], mlse[:, :, qs], mdelta[:, :, qs],
                                     cfg.scale, t.mask, dq[:, gs], dk[:, ks], dv[:, ks])
        return (dq,)

    # the Q side travels r -> r-1, so step s pairs the same blocks as the forward's step s
    # the finished dQ goes home in q's dtype: attention_backward casts it so (its kappa term is
    # added only where q's dtype is the accumulator's, key_frame), so no value changes
    (dq,) = _travel(ring, (q, dout, lse, delta), ("q", "dout", "lse", "delta"), ("dq",), compute, zeros, -1,
                    cfg.trim("q", n), dims=(1, 1, 2, 2), home_dtype=(q.dtype,))
    return dq, dk, dv


def _backward_ring(dout, q, k, v, out, lse, delta, cfg: RingRun):
    ring, G = cfg.ring, cfg.ring.world
    n = q.shape[1]
    dq = _zeros(q)

    def zeros(rows):
        return _zeros(k, rows), _zeros(v, rows)

    def compute(src, moving, off, span):
        tasks = block_tasks(cfg.layout, cfg.pattern, ring.rank, src, G, n)
        if not tasks:
            return None
        mk, mv = moving
        dk, dv = zeros(span)
        g0 = 0 if span is None else span[0]
        for t in tasks:
            qs, ks, gs = slice(t.q0, t.q1), _rel(off, t.k0, t.k1), _rel(g0, t.k0, t.k1)
            cfg.kernel.backward_into(dout[:, qs], q[:, qs], mk[:, ks], mv[:, ks], lse[:, :, qs], delta[:, :, qs],
                                     cfg.scale, t.mask, dq[:, qs], dk[:, gs], dv[:, gs],
                                     out=None if out is None else out[:, qs])
        return dk, dv

    dk, dv = _travel(ring, (k, v), ("k", "v"), ("dk", "dv"), compute, zeros, 1, cfg.trim("kv", n),
                     home_dtype=(k.dtype, v.dtype))
    return dq, dk, dv


def attention_forward(q, k, v, cfg: RingRun):
    """(out in q's dtype, lse) of the forward ring: what _BurstAttn.forward computes, as a plain
    function for the custom op (attention/compiled.py)."""
    out32, lse = _forward(q, k, v, cfg)
    return out32.to(q.dtype), lse


def attention_backward(dout, dlse, q, k, v, out, lse, cfg: RingRun):
    """(dq, dk, dv) in the inputs' dtypes given the output's gradient ``dout`` and the lse's
    ``dlse`` (either may be None): the backward of _BurstAttn and of the custom op
    (attention/compiled.py)."""
    if dout is None:
        dout = torch.zeros_like(out)
    dout = dout.contiguous()
    # D = rowsum(dO * O); a gradient flowing into lse enters as D - dlse, since
    # d lse_i / d s_ij = P_ij makes dS = P * (dP - D + dlse)
    acc = acc_dtype(q)
    delta = cfg.kernel.delta(out, dout, acc)
    if dlse is not None:
        delta = delta - dlse.to(acc)
    # the forward's frame (key_frame): an lse error shared by a row's blocks is harmless
    kc, kappa, shift = key_frame(q, k, cfg, "backward")
    if shift is not None:
        lse = lse - shift
    if cfg.backward == "burst":
        dq, dk, dv = _backward_burst(dout, q, kc, v, lse, delta, cfg)
    else:
        dq, dk, dv = _backward_ring(dout, q, kc, v, out if dlse is None else None, lse, delta, cfg)
    if dlse is not None and kappa is not None:
        # the returned lse is the frame's plus scale * q.kappa
        dq += cfg.scale * dlse.to(acc).transpose(1, 2).unsqueeze(-1) * kappa.unsqueeze(1)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


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
    @once_differentiable("burst_attn_func (the ring attention, also under hybrid_attn_func)")
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        return (*attention_backward(dout, dlse, q, k, v, out, lse, ctx.cfg), None, None)


def run_attention(q, k, v, run: RingRun, precomputed=None):
    """(out, lse) of the ring attention ``run`` plans (no checks: attention/api.py checks and
    plans first), differentiable in q, k, v.  ``precomputed`` = (out, lse) already known
    (sequence-level checkpointing rebuilds them): the forward ring is skipped, the backward runs."""
    return _BurstAttn.apply(q, k, v, run, precomputed)
