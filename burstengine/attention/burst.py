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
message from wherever it stopped.  The hops of a sparse mask's single ring carry only the rows
later steps read (schedule.travel_rows): the receiver holds that part of the shard and the
tasks subtract its offset; the travelling gradient partial covers only the rows remote steps
touched, and the step on a rank's own shard stays home.  Every rank derives the same steps and
message sizes from shared arguments.

The loops run on a :class:`~burstengine.comm.topology.RingComm`: one ring, or the
topology-aware double ring (intra-node rounds, inter-node hops overlapping a whole round; it runs
every step, so calls that skip steps use the single ring); which shard is held at each step
comes from ``ring.source(i, direction)``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..comm.topology import RingComm
from ..kernels import Kernel, get_kernel
from .checks import check_args, check_sparse
from .schedule import Pattern, as_pattern, block_tasks, partial_rows, sent_rows, travel_rows


def _acc(x):
    # float32 accumulation for everything but float64 inputs (which the tests use as an oracle)
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _zeros(x, rows=None):
    """Float32 (float64 for float64 x) zeros shaped like x with rows [lo, hi) of dim 1 (None: all)."""
    n = x.shape[1] if rows is None else rows[1] - rows[0]
    return torch.zeros((x.shape[0], n) + tuple(x.shape[2:]), dtype=_acc(x), device=x.device)


def _rel(start: int, lo: int, hi: int) -> slice:
    """Shard rows [lo, hi) of a buffer that holds the shard's rows from ``start`` on."""
    return slice(lo - start, hi - start)


@dataclass
class _Config:
    ring: RingComm  # knows the steps that run (ring.steps)
    kernel: Kernel
    pattern: Pattern
    layout: str
    scale: float
    backward: str

    def trim(self, side: str, n: int):
        """(travel rows, partial rows) of this call's messages (schedule.travel_rows /
        partial_rows) for the side that travels; (None, None) where whole shards travel: dense
        masks, and the double ring."""
        if self.ring.double or self.ring.world == 1 or not self.pattern.sparse:
            return None, None
        args = (self.layout, self.pattern, self.ring.world, n, side)
        return travel_rows(*args), partial_rows(*args)


def _forward(q, k, v, cfg: _Config):
    ring, G = cfg.ring, cfg.ring.world
    B, n, H, _ = q.shape
    out = torch.zeros(B, n, H, v.shape[-1], dtype=_acc(q), device=q.device)
    lse = torch.full((B, H, n), float("-inf"), dtype=_acc(q), device=q.device)
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
    return out, lse


def _travel(ring: RingComm, moving, moving_names, acc_names, compute, zeros, direction: int, trim=(None, None),
            dims=None):
    """The backward ring loop shared by both schemes.

    ``moving`` travels r -> r + ``direction``.  ``compute(src, moving, offset, span)`` does this
    rank's work on the block whose travelling side belongs to rank ``src`` (``moving`` holds
    that side's rows from ``offset`` on) and returns fresh float32 contributions to that side's
    gradients covering shard rows ``span`` (None: all), or None when it has no work there.
    Those contributions are summed along the ring one step behind the data and finally sent
    home; the return value is this rank's own fully summed gradients of its travelling side.
    ``trim``: (travel rows, partial rows) of a sparse mask's single ring (cfg.trim), ``dims``
    the row dimension of each moving tensor; ``zeros(rows)`` makes zero partials.
    """
    data = ring.mover(moving, "backward", moving_names, direction, rows=trim[0], dims=dims)
    acc = ring.reducer("backward", acc_names, zeros, direction, rows=trim[1])
    for i in range(len(ring.steps)):
        data.post(i)
        acc.post(i)  # the partial finished at the previous step, one step behind the data
        acc.add(i, compute(ring.source(i, direction), data.held, data.offset, acc.span(i)))
        data.advance(i)
    return acc.home()


def _backward_burst(dout, q, k, v, lse, delta, cfg: _Config):
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
    (dq,) = _travel(ring, (q, dout, lse, delta), ("q", "dout", "lse", "delta"), ("dq",), compute, zeros, -1,
                    cfg.trim("q", n), dims=(1, 1, 2, 2))
    return dq, dk, dv


def _backward_ring(dout, q, k, v, out, lse, delta, cfg: _Config):
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

    dk, dv = _travel(ring, (k, v), ("k", "v"), ("dk", "dv"), compute, zeros, 1, cfg.trim("kv", n))
    return dq, dk, dv


def hop_bytes(scheme: str, B: int, n: int, H: int, Hkv: int, D: int, elem: int) -> tuple[int, int]:
    """(travelling data, travelling gradient partial) bytes one rank sends per hop of one loop.

    scheme "forward": k, v; "burst": q, dout in the input dtype + lse, delta in fp32, and dq in
    fp32; "ring": k, v, and dk, dv in fp32."""
    if scheme == "forward":
        return B * n * Hkv * D * 2 * elem, 0
    if scheme == "burst":
        return B * n * H * (2 * D * elem + 8), B * n * H * D * 4
    if scheme == "ring":
        return B * n * Hkv * D * 2 * elem, B * n * Hkv * D * 2 * 4
    raise ValueError(f"unknown scheme {scheme!r}")


def _trimmed_bytes(scheme: str, B, n, H, Hkv, D, elem, world, layout, mask) -> list[int] | None:
    """Per rank, the bytes of one loop on a sparse mask's single ring (schedule.sent_rows times
    the bytes of one row); None for dense masks."""
    if mask is None or not as_pattern(mask).sparse:
        return None
    if layout is None:
        raise ValueError("the bytes of a sparse mask depend on the layout: pass layout=")
    data, grad = hop_bytes(scheme, B, 1, H, Hkv, D, elem)
    return [d * data + g * grad for d, g in sent_rows(layout, mask, world, n, "q" if scheme == "burst" else "kv")]


def backward_bytes(scheme: str, B: int, n: int, H: int, Hkv: int, D: int, elem: int, world: int,
                   hops: int | None = None, *, layout: str | None = None, mask=None, rank: int = 0) -> int:
    """Bytes one rank sends in the backward of one call (what comm_stats will report).

    Whole shards (dense masks, any ring topology): the data makes ``hops`` hops, the gradient
    partials one more (the last one home); ``hops``: len(schedule.ring_steps) - 1, i.e. world - 1
    unless a sparse mask lets the ring skip steps.  With ``layout`` and a sparse ``mask``
    (Pattern): the trimmed messages of the single ring, which differ from rank to rank, for
    rank ``rank`` (``hops`` is then ignored)."""
    trimmed = _trimmed_bytes(scheme, B, n, H, Hkv, D, elem, world, layout, mask)
    if trimmed is not None:
        return trimmed[rank]
    h = world - 1 if hops is None else hops
    if world == 1 or h == 0:
        return 0
    data, grad = hop_bytes(scheme, B, n, H, Hkv, D, elem)
    return h * data + (h + 1) * grad


def forward_bytes(B: int, n: int, Hkv: int, D: int, elem: int, world: int, hops: int | None = None, *,
                  layout: str | None = None, mask=None, rank: int = 0) -> int:
    """Bytes one rank sends in the forward: K and V, once per ring step that runs after the
    first; with ``layout`` and a sparse ``mask``, just the rows later steps read (see
    :func:`backward_bytes`)."""
    trimmed = _trimmed_bytes("forward", B, n, 0, Hkv, D, elem, world, layout, mask)
    if trimmed is not None:
        return trimmed[rank]
    h = world - 1 if hops is None else hops
    return hop_bytes("forward", B, n, 0, Hkv, D, elem)[0] * h


def choose_backward(B, n, H, Hkv, D, elem, world, hops=None, *, layout=None, mask=None) -> str:
    """The scheme that sends fewer bytes (the cost model's choice when no link figures are known);
    with ``layout`` and a sparse ``mask``, by the busiest rank's trimmed bytes."""
    def most(scheme):
        trimmed = _trimmed_bytes(scheme, B, n, H, Hkv, D, elem, world, layout, mask)
        return max(trimmed) if trimmed is not None else backward_bytes(scheme, B, n, H, Hkv, D, elem, world, hops)

    return "burst" if most("burst") <= most("ring") else "ring"


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
        delta = cfg.kernel.delta(out, dout, acc)
        if dlse is not None:
            delta = delta - dlse.to(acc)
        if cfg.backward == "burst":
            dq, dk, dv = _backward_burst(dout, q, k, v, lse, delta, cfg)
        else:
            dq, dk, dv = _backward_ring(dout, q, k, v, out if dlse is None else None, lse, delta, cfg)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _make_config(q, k, group, causal, layout, softmax_scale, backward, kernel, window=None, cu_seqlens=None,
                 block_mask=None, block_size=None, topology="auto", pattern=None) -> _Config:
    """Plan the call: the ring (single or double, the steps that run) and the concrete backward
    scheme.  ``pattern``: the mask's schedule.Pattern when the caller has checked it already."""
    from .auto import plan_call

    if pattern is None:
        pattern = check_sparse(causal, layout, _world(group), q.shape[1], window, cu_seqlens, block_mask, block_size)
    ring, backward = plan_call(q, k, group, pattern, layout, backward, topology)
    return _config(q, ring, pattern, layout, softmax_scale, backward, kernel)


def _config(q, ring, pattern, layout, softmax_scale, backward, kernel) -> _Config:
    return _Config(ring=ring, kernel=get_kernel(kernel, q.device), pattern=pattern, layout=layout,
                   scale=float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1]),
                   backward=backward)


def _world(group) -> int:
    import torch.distributed as dist

    from ..comm.topology import LOCAL

    if group is LOCAL:
        return 1
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def burst_attn_func(q, k, v, *, group=None, causal=False, layout="contiguous", softmax_scale=None,
                    backward="auto", return_lse=False, kernel=None, window=None, cu_seqlens=None,
                    block_mask=None, block_size=None, topology="auto"):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    q: (batch, seq_local, heads, head_dim); k, v: (batch, seq_local, kv_heads, head_dim) with
    heads a multiple of kv_heads.  Each rank passes its shard under ``layout`` (see
    :func:`burstengine.shard`).  Returns this rank's output shard (and, with
    ``return_lse``, the float32 log-sum-exp of shape (batch, heads, seq_local)).

    group: the ring's ranks (None: the default group); ``burstengine.comm.topology.LOCAL``: this
    rank alone inside any job (attention of its own tokens, nothing communicated).

    backward: "burst" moves Q, dO, D, lse and dQ; "ring" moves K, V, dK, dV; "auto" lets the
    cost model pick (the one that sends fewer bytes unless BURST_CLUSTER gives link figures).
    kernel: "auto", "reference", "flash", "cudnn" (or env BURST_KERNEL).

    topology: the ring to run on.  "auto" (default): one node -> the single ring; several
    nodes (LOCAL_WORLD_SIZE, or BURST_TOPOLOGY="NxM") -> the topology-aware double ring, unless
    the cost model with BURST_CLUSTER's figures predicts the single ring faster.  None or
    "single": always the single ring.  A :class:`~burstengine.Topology`, "NxM" or a 2-D
    DeviceMesh (inter-node, intra-node): the double ring of that shape.

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
    the G steps; see schedule.ring_steps); a call that skips steps runs on the single ring.  On
    the single ring each hop carries only the rows later steps read (W <= local length: the
    last W - 1 rows of K/V; see schedule.travel_rows).
    Rows with no visible key get a zero output, lse = -inf and zero gradients.
    """
    pattern = check_args(q, k, v, group, causal, layout, softmax_scale, backward, kernel,
                         extra=lambda world: _check_extra(world, q, group, causal, layout, window, cu_seqlens,
                                                          block_mask, block_size, topology))["sparse mask"]
    cfg = _make_config(q, k, group, causal, layout, softmax_scale, backward, kernel, topology=topology,
                       pattern=pattern)
    out, lse = _BurstAttn.apply(q, k.contiguous(), v.contiguous(), cfg)
    return (out, lse) if return_lse else out


def _check_extra(world, q, group, causal, layout, window, cu_seqlens, block_mask, block_size, topology):
    """The arguments attention/checks.py does not know, checked on this rank and handed to its
    agreement stage: every rank must pass the same mask and topology."""
    from ..comm import topology as topo

    pattern = check_sparse(causal, layout, world, q.shape[1], window, cu_seqlens, block_mask, block_size)
    if topology is not None and not (isinstance(topology, str) and topology in ("auto", "single")):
        topo.resolve(topology, group)  # raises ValueError on a malformed one
    shape = tuple(topology.shape) if topo.is_mesh(topology) else topology
    return {"sparse mask": pattern, "topology": shape}


def attend(q, k, v, ring: RingComm, *, causal, layout, softmax_scale, backward, return_lse, kernel):
    """burst_attn_func on an already-built ring and a concrete backward scheme (no checks)."""
    cfg = _config(q, ring, Pattern(causal=bool(causal)), layout, softmax_scale, backward, kernel)
    out, lse = _BurstAttn.apply(q, k.contiguous(), v.contiguous(), cfg)
    return (out, lse) if return_lse else out
