"""Hopper attention backward in Gluon, from the global lse and D = rowsum(dO * O) (no O), for
full, causal and strict blocks at d 64 and 128: one program per (128-row kv tile, batch x kv head)
stores or adds its dK, dV and sends dQ out by TMA reduce-add, 5 matmuls per tile pair (the
Triton kernels use 7, or spill when they send dQ by atomics).

FlashAttention-3's backward shape, written out:

* a loader warp brings K and V of the kv tile once, then Q and dO of each 64-row q tile into a
  two-buffer ring (``ready`` / ``empty`` mbarriers);
* two compute warpgroups each own 64 of the kv rows (so their dK, dV never meet) and see the
  whole q tile: S = Q K_w^T and dP = dO V_w^T are issued together as async wgmmas, rows are q
  rows, so lse and D are two registers a thread;
* P and dS go to shared memory (the dV = P^T dO and dK = dS^T Q wgmmas read them transposed, no
  register shuffle); the two halves of dS make the whole (q tile x kv tile) dS, and each
  warpgroup computes half of dQ = dS K (its 64 columns of the head dim) and reduce-adds it into
  the float32 dQ through TMA: the same bytes once, no per-element atomics.

Two things keep the step's registers under the compute partitions' 240 (the loop held ~50 more
and spilled them, reloading every step: the profiler's top stall).  The wgmma descriptors of the
fixed buffers (K, V, P) are indexed by a zero made each step by inline assembly, so they are
rebuilt in the step rather than hoisted out of the loop; and lse and D of the next q tile are
loaded a step ahead, off the path to the exponentials (that alone, while the loop still
spilled, was slower).

At d=64 the dQ of each step is made one step later, under the next step's exponentials (LAG).
How a block is cut over programs (the q heads of a group, chunks of a long full block's q tiles,
so that the programs running at once share their tiles in L2) is grid.py's.

As in fwd.py, every wgmma is waited for within its step (an accumulator in flight across
the loop's back edge makes ptxas serialise them) and the mask is a runtime bound: visible iff
q index - k index >= mask_lo; only the q tiles that cross the diagonal run the masked step.
"""
from __future__ import annotations

import torch
from triton._C.libtriton import gluon_ir, ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from . import fwd as gluon_fwd
from .fwd import BIG, LOADER_REGS, LOG2E, WS_MAXNREG, _rows, row_desc, writable_rows
from . import grid as plans
from .grid import Q_ROWS

if not (hasattr(ir, "DESCRIPTOR_REDUCE_KIND") and hasattr(gluon_ir.GluonOpBuilder, "create_async_tma_reduce")):
    # _reduce_add below builds the op through Triton internals: a Triton without them gets the
    # Triton kernels instead (the caller treats ImportError as "not here")
    raise ImportError("this Triton's Gluon cannot build a TMA reduce-add")

BLOCK_N = gl.constexpr(plans.BLOCK_N)  # kv rows per program: two compute warpgroups of 64
HALF = gl.constexpr(64)      # the kv rows of one warpgroup = the width of its S and dP tiles
STAGES = gl.constexpr(2)
# LAG per head dim: step j makes the dQ of step j-1, issued at its top so that it runs under the
# softmax (a third dS buffer; the first step's is of zeros, the last made after the loop).  At
# d=64, where the step is short on tensor work, +1-6% over the kernel without it in 11 of 12 rows
# of two H200 launches at 16K-128K, -3% in one (probe_gluon_bwd_lag*_h200.json); at d=128 its
# accumulator does not fit beside the softmax's registers (ptxas spills 1 KB and serialises the
# wgmmas: ptxas_gluon_bwd_d64.json)
LAG = {128: False, 64: True}


@builtin
def _reduce_add(tensor_desc, coord, src, _semantic=None):
    # TMA reduce-add of a shared tile into global memory (Gluon 3.6 builds the op but exports no
    # wrapper for it); completion is tracked like a TMA store (tma.store_wait)
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _wrap(u, n):
    # u mod n for 0 <= u < 2n (a step's t + shift): a compare and a select, where % by a runtime n
    # is a division's worth of registers in the loop
    return gl.where(u >= n, u - n, u)


@gluon.jit
def _loader(descs, bufs, bars, scal, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, KV_ROWS: gl.constexpr):
    # K and V of the program's KV_ROWS kv rows once, then Q and dO of each step (bwd_wide.py's too)
    q_desc, k_desc, v_desc, do_desc, dq_desc = descs
    k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs = bufs
    kv_bar, q_ready, q_empty = bars[0], bars[1], bars[2]
    q_row0, kv_row, kv_col, h0, HEADS, n_q, n_mask, q_t0, k_pos0, mask_lo, scale_log2, scale, shift = scal
    mbarrier.expect(kv_bar, 2 * KV_ROWS * HEAD_DIM * 2)
    tma.async_copy_global_to_shared(k_desc, [kv_row, kv_col], kv_bar, k_smem.index(0))
    tma.async_copy_global_to_shared(v_desc, [kv_row, kv_col], kv_bar, v_smem.index(0))
    j = 0
    for g in range(HEADS):
        for t in range(n_mask):
            _load_q(j, g, t, descs, bufs, bars, scal, HEAD_DIM, BLOCK_M)
            j += 1
    for g in range(HEADS):
        for t in range(n_mask, n_q):
            _load_q(j, g, t, descs, bufs, bars, scal, HEAD_DIM, BLOCK_M)
            j += 1


@gluon.jit
def _load_q(j, g, t, descs, bufs, bars, scal, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr):
    q_desc, k_desc, v_desc, do_desc, dq_desc = descs
    k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs = bufs
    kv_bar, q_ready, q_empty = bars[0], bars[1], bars[2]
    q_row0, kv_row, kv_col, h0, HEADS, n_q, n_mask, q_t0, k_pos0, mask_lo, scale_log2, scale, shift = scal
    st = j % STAGES
    mbarrier.wait(q_empty.index(st), ((j // STAGES) & 1) ^ 1)
    mbarrier.expect(q_ready.index(st), 2 * BLOCK_M * HEAD_DIM * 2)
    row = q_row0 + (q_t0 + _wrap(t + shift, n_q)) * BLOCK_M
    col = (h0 + g) * HEAD_DIM
    tma.async_copy_global_to_shared(q_desc, [row, col], q_ready.index(st), q_bufs.index(st))
    tma.async_copy_global_to_shared(do_desc, [row, col], q_ready.index(st), do_bufs.index(st))


@gluon.jit
def _step(j, g, t, dk, dv, prev, descs, bufs, bars, scal, lse2, delta, HEAD_DIM: gl.constexpr,
          BLOCK_M: gl.constexpr, LAG: gl.constexpr, W: gl.constexpr, MASKED: gl.constexpr):
    # one (q tile, this warpgroup's 64 kv rows) pair: dK, dV added in registers, dQ's d/2 columns
    # of this warpgroup reduce-added into global memory.  LAG: the dQ made here is the
    # previous step's (``prev``: its coordinates), from dS ring index j, and this step's dS goes
    # to ring index j + 1
    q_desc, k_desc, v_desc, do_desc, dq_desc = descs
    k_all, v_all, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs = bufs
    kv_bar, q_ready, q_empty, ds_ready = bars
    q_row0, kv_row, kv_col, h0, HEADS, n_q, n_mask, q_t0, k_pos0, mask_lo, scale_log2, scale, shift = scal
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    DQ_W: gl.constexpr = HEAD_DIM // 2  # the dQ columns of one warpgroup
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_W, 16])

    st = j % STAGES
    q_s = q_bufs.index(st)
    do_s = do_bufs.index(st)
    # a zero the compiler cannot see through, new each step: the wgmma descriptors of K, V and P
    # (fixed buffers) are then built in the step.  Hoisted out of the loop they took ~50 registers
    # and ptxas spilled 416 bytes, reloaded every step (gluon_bwd_variants_h200.json: 1.09-1.15x)
    z = gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [j], dtype=gl.int32, is_pure=False, pack=1)
    k_smem = k_all.index(z)
    v_smem = v_all.index(z)
    p_s = p_bufs.index(W + z)
    k_w = k_smem.slice(W * HALF, HALF, dim=0)
    v_w = v_smem.slice(W * HALF, HALF, dim=0)
    zero = gl.zeros([BLOCK_M, HALF], gl.float32, s_layout)
    zero_dq = gl.zeros([BLOCK_M, DQ_W], gl.float32, dq_layout)
    if LAG:
        ds_in = ds_bufs.index(j % 3)
        ds_out = (j + 1) % 3
    else:
        ds_in = ds_bufs.index(j % 2)
        ds_out = j % 2
    ds_w = ds_bufs.index(ds_out).slice(W * HALF, HALF, dim=1)

    q_t = q_t0 + _wrap(t + shift, n_q)
    offs_m = q_t * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)  # q rows in the block
    mbarrier.wait(q_ready.index(st), (j // STAGES) & 1)
    s_tok = warpgroup_mma(q_s, k_w.permute((1, 0)), zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(do_s, v_w.permute((1, 0)), zero, use_acc=False, is_async=True)
    if LAG:
        # both halves of the previous step's dS landed long ago (mid-step): its dQ runs under
        # this step's exponentials
        mbarrier.wait(ds_ready.index(j % 3), (j // 3) & 1)
        dq_tok = warpgroup_mma(ds_in, k_smem.slice(W * DQ_W, DQ_W, dim=1), zero_dq, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(2, deps=(s_tok, ))
    else:
        s = warpgroup_mma_wait(1, deps=(s_tok, ))
    p = gl.exp2(s * scale_log2 - lse2[:, None])
    if MASKED:
        offs_n = k_pos0 + W * HALF + gl.arange(0, HALF, layout=col_s)
        p = gl.where((offs_m[:, None] - offs_n[None, :]) >= mask_lo, p, 0.0)
    p_s.store(p.to(dtype))
    fence_async_shared()
    dv_tok = warpgroup_mma(p_s.permute((1, 0)), do_s, dv, is_async=True)
    if LAG:
        dp = warpgroup_mma_wait(2, deps=(dp_tok, ))
    else:
        dp = warpgroup_mma_wait(1, deps=(dp_tok, ))
    ds = p * (dp - delta[:, None])
    ds_w.store(ds.to(dtype))
    fence_async_shared()
    # one thread arrives; the compiler puts a warpgroup barrier before it (Triton 3.6 treats an
    # arrive as touching all shared memory), so the whole half of dS is written when it lands
    mbarrier.arrive(ds_ready.index(ds_out), count=1)
    dq_s = dq_bufs.index(W)
    dk_tok = warpgroup_mma(ds_w.permute((1, 0)), q_s, dk, is_async=True)
    if LAG:
        dq_row, dq_col = prev
    else:
        # dQ = dS K needs the other warpgroup's half of dS too (dK runs meanwhile)
        mbarrier.wait(ds_ready.index(ds_out), (j // 2) & 1)
        dq_tok = warpgroup_mma(ds_in, k_smem.slice(W * DQ_W, DQ_W, dim=1), zero_dq, use_acc=False, is_async=True)
        dq_row = q_row0 + q_t * BLOCK_M
        dq_col = (h0 + g) * HEAD_DIM + W * DQ_W
    dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok))
    mbarrier.arrive(q_empty.index(st), count=1)
    tma.store_wait(0)  # the previous reduce has read this buffer
    dq_s.store(dq * scale)
    fence_async_shared()
    _reduce_add(dq_desc, [dq_row, dq_col], dq_s)
    return dk, dv, (q_row0 + q_t * BLOCK_M, (h0 + g) * HEAD_DIM + W * DQ_W)


@gluon.jit
def _lse_rows(g, t, n_t, q_t0, n_q, shift, lse_h, dl_h, BLOCK_M: gl.constexpr, NCOL: gl.constexpr = HALF):
    # lse (base 2) and D of the q tile of step t of head g, zeros past step n_t - 1, in the row
    # layout of an S tile of NCOL columns
    LSE2, slh = lse_h
    DL, sdlh = dl_h
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, NCOL, 16])
    offs_m = (q_t0 + _wrap(t + shift, n_q)) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    ok = (gl.zeros_like(offs_m) + t) < n_t
    return (gl.load(LSE2 + g * slh + offs_m, mask=ok, other=0.0), gl.load(DL + g * sdlh + offs_m, mask=ok, other=0.0))


@gluon.jit
def _compute(descs, bufs, bars, scal, lse_h, dl_h, out, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
             LAG: gl.constexpr, W: gl.constexpr, DKV: gl.constexpr):
    k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs = bufs
    kv_bar, q_ready, q_empty, ds_ready = bars
    q_row0, kv_row, kv_col, h0, HEADS, n_q, n_mask, q_t0, k_pos0, mask_lo, scale_log2, scale, shift = scal
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HEAD_DIM, 16])
    dk = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    DQ_W: gl.constexpr = HEAD_DIM // 2
    # LAG: the first step's "previous dQ" comes from ring index 0, zeros, added to its own tile
    prev = (q_row0 + q_t0 * BLOCK_M, h0 * HEAD_DIM + W * DQ_W)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    if LAG:
        ds_bufs.index(0).slice(W * HALF, HALF, dim=1).store(gl.zeros([BLOCK_M, HALF], descs[0].dtype, s_layout))
        fence_async_shared()
        mbarrier.arrive(ds_ready.index(0), count=1)
    mbarrier.wait(kv_bar, 0)
    # the q tiles that cross the diagonal first (masked), then the rest; j counts steps for the
    # ring's buffers and phases.  lse and D of the next q tile are loaded a step ahead, off the
    # path to the exponentials (1.06-1.13x on top of the above)
    j = 0
    for g in range(HEADS):
        lse2, delta = _lse_rows(g, 0, n_mask, q_t0, n_q, shift, lse_h, dl_h, BLOCK_M)
        for t in range(n_mask):
            nxt = _lse_rows(g, t + 1, n_mask, q_t0, n_q, shift, lse_h, dl_h, BLOCK_M)
            dk, dv, prev = _step(j, g, t, dk, dv, prev, descs, bufs, bars, scal, lse2, delta, HEAD_DIM, BLOCK_M,
                                 LAG, W, True)
            lse2, delta = nxt
            j += 1
    for g in range(HEADS):
        lse2, delta = _lse_rows(g, n_mask, n_q, q_t0, n_q, shift, lse_h, dl_h, BLOCK_M)
        for t in range(n_mask, n_q):
            nxt = _lse_rows(g, t + 1, n_q, q_t0, n_q, shift, lse_h, dl_h, BLOCK_M)
            dk, dv, prev = _step(j, g, t, dk, dv, prev, descs, bufs, bars, scal, lse2, delta, HEAD_DIM, BLOCK_M,
                                 LAG, W, False)
            lse2, delta = nxt
            j += 1
    if LAG:
        # the last step's dQ, from ring index j
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                            instr_shape=[16, DQ_W, 16])
        mbarrier.wait(ds_ready.index(j % 3), (j // 3) & 1)
        dq = warpgroup_mma(ds_bufs.index(j % 3), k_smem.index(0).slice(W * DQ_W, DQ_W, dim=1),
                           gl.zeros([BLOCK_M, DQ_W], gl.float32, dq_layout), use_acc=False)
        dq_s = bufs[6].index(W)
        tma.store_wait(0)
        dq_s.store(dq * scale)
        fence_async_shared()
        _reduce_add(descs[4], [prev[0], prev[1]], dq_s)
    tma.store_wait(0)
    rows = kv_row + W * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
    cols = kv_col + gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    _store_dkv(dk, dv, rows, cols, out, scale, DKV)


@gluon.jit
def _store_dkv(dk, dv, rows, cols, out, scale, DKV: gl.constexpr):
    # once per program, a warpgroup's sums (rows x cols of dK, dV): plain stores from the
    # accumulator layout (fresh), read-add-store, or atomic adds where the kv head's q heads are
    # split over programs (DKV 0, 1, 2); dK still wants its scale
    DK, DV, sdk, sdv = out
    dk_ptrs = DK + rows.to(gl.int64)[:, None] * sdk + cols[None, :]
    dv_ptrs = DV + rows.to(gl.int64)[:, None] * sdv + cols[None, :]
    dk = dk * scale
    if DKV == 2:
        gl.atomic_add(dk_ptrs, dk, sem="relaxed")
        gl.atomic_add(dv_ptrs, dv, sem="relaxed")
    else:
        if DKV == 1:
            dk += gl.load(dk_ptrs).to(gl.float32)
            dv += gl.load(dv_ptrs).to(gl.float32)
        gl.store(dk_ptrs, dk.to(DK.dtype.element_ty))
        gl.store(dv_ptrs, dv.to(DV.dtype.element_ty))


@gluon.jit
def _compute0(descs, bufs, bars, scal, lse_h, dl_h, out, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
              LAG: gl.constexpr, DKV: gl.constexpr):
    _compute(descs, bufs, bars, scal, lse_h, dl_h, out, HEAD_DIM, BLOCK_M, LAG, 0, DKV)


@gluon.jit
def _compute1(descs, bufs, bars, scal, lse_h, dl_h, out, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
              LAG: gl.constexpr, DKV: gl.constexpr):
    _compute(descs, bufs, bars, scal, lse_h, dl_h, out, HEAD_DIM, BLOCK_M, LAG, 1, DKV)


@gluon.jit
def _loader_part(descs, bufs, bars, scal, lse_h, dl_h, out, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                 LAG: gl.constexpr, DKV: gl.constexpr):
    _loader(descs, bufs, bars, scal, HEAD_DIM, BLOCK_M, BLOCK_N)


@gluon.jit
def _program(Sq, Sk, H, GROUP, HEADS, chunk, stagger, mask_lo, scale_log2, scale, LSE2, DL, DK, DV, slb, slh, sdlb,
             sdlh, sdk, sdv, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    # this program's step arguments (scal, lse_h, dl_h, out: what the partitions unpack), from the
    # kernel's (bwd_kernel's and bwd_wide_kernel's alike).  Grid (kv tiles, batch x q heads / HEADS,
    # chunks: grid.py's Plan): the chunk and kv tile straight from the program's ids, which ptxas
    # can remake values from rather than keep them (a chunk from a division raised the step loops'
    # local loads)
    pid_n = gl.program_id(0)
    n_hp = H // HEADS
    b = gl.program_id(1) // n_hp
    h0 = (gl.program_id(1) - b * n_hp) * HEADS  # this program's q heads: HEADS of its kv head's GROUP
    hk = h0 // GROUP
    k_pos0 = pid_n * BLOCK_N
    diag = chunk == 0
    q_t0 = gl.where(diag, k_pos0 // BLOCK_M, gl.program_id(2) * chunk)
    n_q = gl.where(diag, Sq // BLOCK_M - q_t0, gl.minimum(Sq // BLOCK_M - q_t0, chunk))
    n_mask = gl.where(diag, BLOCK_N // BLOCK_M, 0)
    b64 = b.to(gl.int64)
    # a full block's programs start their q tiles ``stagger`` tiles apart (a diagonal block's
    # start at their own: 0): the reduce-adds of programs running at once land on different dQ tiles
    shift = (pid_n * stagger) % n_q
    scal = (b * Sq, b * Sk + k_pos0, hk * HEAD_DIM, h0, HEADS, n_q, n_mask, q_t0, k_pos0, mask_lo, scale_log2,
            scale, shift)
    lse_h = (LSE2 + b64 * slb + h0 * slh, slh)
    dl_h = (DL + b64 * sdlb + h0 * sdlh, sdlh)
    return scal, lse_h, dl_h, (DK, DV, sdk, sdv)


@gluon.jit(do_not_specialize=["Sq", "Sk", "H", "GROUP", "HEADS", "mask_lo", "chunk", "stagger", "slb", "slh", "sdlb",
                              "sdlh", "sdk", "sdv"])
def bwd_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE2, DL, DK, DV, Sq, Sk, H, GROUP, HEADS, scale_log2, scale,
               mask_lo, chunk, stagger, slb, slh, sdlb, sdlh, sdk, sdv,
               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, LAG: gl.constexpr, DKV: gl.constexpr,
               LOAD_REGS: gl.constexpr, num_warps: gl.constexpr):
    """One program per (128-row kv tile, batch x kv head, HEADS of its GROUP q heads x a chunk of
    ``chunk`` q tiles), over those heads' q tiles.  ``chunk`` 0, a diagonal block: Sq = Sk and the q
    tiles start at the kv tile's (the two that cross its diagonal masked by ``mask_lo``: 0 causal, 1
    strict); else the chunk's q tiles, unmasked, starting ``stagger`` tiles a kv tile apart.  dQ (float32,
    through ``dq_desc``) is added to; dK, dV (``DKV``) stored (0), read, added to and stored (1), in
    their dtype, or added atomically (2: float32, the group or the q tiles split over programs)."""
    dtype: gl.constexpr = q_desc.dtype
    scal, lse_h, dl_h, out = _program(Sq, Sk, H, GROUP, HEADS, chunk, stagger, mask_lo, scale_log2, scale, LSE2, DL,
                                      DK, DV, slb, slh, sdlb, sdlh, sdk, sdv, HEAD_DIM, BLOCK_M, BLOCK_N)

    # K and V with a leading dimension of 1, so _step can index them by its opaque zero
    k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    ps_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], dtype)
    p_bufs = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HALF], ps_layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    DS_BUFS: gl.constexpr = 3 if LAG else 2
    ds_bufs = gl.allocate_shared_memory(dtype, [DS_BUFS, BLOCK_M, BLOCK_N], ds_layout)
    dq_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, HEAD_DIM // 2], dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [DS_BUFS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # both compute warpgroups release a buffer
    for i in gl.static_range(DS_BUFS):
        mbarrier.init(ds_ready.index(i), count=2)  # both halves of dS written

    descs = (q_desc, k_desc, v_desc, do_desc, dq_desc)
    bufs = (k_smem, v_smem, q_bufs, do_bufs, p_bufs, ds_bufs, dq_bufs)
    bars = (kv_bar, q_ready, q_empty, ds_ready)
    gl.warp_specialize([
        (_compute0, (descs, bufs, bars, scal, lse_h, dl_h, out, HEAD_DIM, BLOCK_M, LAG, DKV)),
        (_compute1, (descs, bufs, bars, scal, lse_h, dl_h, out, HEAD_DIM, BLOCK_M, LAG, DKV)),
        (_loader_part, (descs, bufs, bars, scal, lse_h, dl_h, out, HEAD_DIM, BLOCK_M, LAG, DKV)),
    ], [4, 1], [240, LOAD_REGS])


def supported(q, k, v, diag: bool, dout, dq=None, dk=None, dv=None) -> bool:
    """Whether this backward runs here or in bwd_wide.py (else the Triton kernels): what
    gluon/fwd.py takes (d 64 or 128 here, 256 there), dO like q, dQ float32, and dQ, dK, dV
    written through (rows, heads * D) views of themselves (dq None: a zeroed float32 buffer the
    caller makes)."""
    if q.shape[-1] not in Q_ROWS or not gluon_fwd.supported(q, k, v, diag):
        return False
    if (dout.shape != q.shape or dout.dtype != q.dtype or dout.stride(-1) != 1 or dout.stride(-2) != q.shape[-1]
            or dout.data_ptr() % 16):
        return False
    if dq is not None and (dq.dtype != torch.float32 or dq.shape != q.shape or not writable_rows(dq)):
        return False
    return all(t is None or (t.shape == k.shape and writable_rows(t)) for t in (dk, dv))


def backward_into(dout, q, k, v, lse2, delta, scale: float, mask_lo: int | None, dq, dk, dv, fresh: bool) -> None:
    """Add this block's dQ into float32 ``dq`` and its dK, dV into ``dk``, ``dv`` (or store them:
    ``fresh``).  ``lse2``: lse in base 2, +inf for rows that saw nothing; ``delta``: D; both
    (B, H, Sq) with unit stride along rows.  ``mask_lo``: None full, 0 causal, 1 strict."""
    D = q.shape[-1]
    launch(bwd_kernel, dict(BLOCK_M=Q_ROWS[D], LAG=LAG[D]), D // 2, dout, q, k, v, lse2, delta, scale, mask_lo, dq,
           dk, dv, fresh)


def launch(kernel, consts: dict, dq_cols: int, dout, q, k, v, lse2, delta, scale, mask_lo, dq, dk, dv, fresh) -> None:
    """Launch ``kernel`` (bwd_kernel, or bwd_wide.py's: the same arguments) on grid.py's plan, with
    its ``consts``; dQ is reduce-added in tiles of ``dq_cols`` columns."""
    B, Sq, H, D = q.shape
    block_m, diag = Q_ROWS[D], mask_lo is not None
    p = plans.plan(q, k, dk, dv, fresh, diag)
    gk, gv = dk, dv
    if p.temporaries:
        # the programs of a kv tile add theirs atomically: into float32, then stored or added
        gk, gv = (torch.zeros(k.shape, device=k.device, dtype=torch.float32) for _ in range(2))
    q_desc, do_desc = (row_desc(x, (block_m, D)) for x in (q, dout))
    k_desc, v_desc = (row_desc(x, (plans.KV_ROWS[D], D)) for x in (k, v))
    dq_desc = row_desc(dq, (block_m, dq_cols))
    dk_rows, dv_rows = _rows(gk), _rows(gv)
    kernel[p.grid](q_desc, k_desc, v_desc, do_desc, dq_desc, lse2, delta, dk_rows, dv_rows, Sq, k.shape[1], H,
                   H // k.shape[2], p.heads, scale * LOG2E.value, scale, mask_lo if diag else -BIG, p.chunk,
                   p.stagger, lse2.stride(0), lse2.stride(1), delta.stride(0), delta.stride(1), dk_rows.stride(0),
                   dv_rows.stride(0), HEAD_DIM=D, DKV=p.dkv, LOAD_REGS=LOADER_REGS, num_warps=4, maxnreg=WS_MAXNREG,
                   **consts)
    if gk is not dk:
        for mine, g in ((dk, gk), (dv, gv)):
            if fresh:
                mine.copy_(g)
            else:
                mine.add_(g)
