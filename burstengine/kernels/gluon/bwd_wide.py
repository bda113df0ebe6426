"""Hopper attention backward in Gluon at d=256, where bwd.py's layout cannot hold its sums: there a
warpgroup owns 64 kv rows and keeps their dK and dV in registers, 64 x 256 float32 each, 256
registers a thread, more than a compute partition has (240).

Here a program takes 64 kv rows (grid.py's KV_ROWS) and its two compute warpgroups split the work
of each (64-row q tile, 64 kv rows) step:

* SDP (the default): warpgroup 0 makes S = Q K^T and P, warpgroup 1 dP = dO V^T and, from P read
  back from shared memory, dS (64-column wgmmas); with SDP off, each makes 32 kv columns of all
  four (the first build: 32-column wgmmas reread their A operand twice as often);
* P and dS go to shared memory and each warpgroup reads them whole (mbarriers "ready" and "free"
  per tile: the buffers are single, as shared memory is full);
* dV = P^T dO and dK = dS^T Q by head-dim halves: a warpgroup's dK and dV are 64 x 128, 64
  registers each, summed over the program's steps;
* dQ = dS K by head-dim halves too, in pieces of 32 columns, each reduce-added through TMA from a
  buffer of its own.

Shared memory: K and V 64 KB, two buffers each of Q and dO 128 KB, P and dS 16 KB, the dQ pieces
16 KB (of 227).  The loader, the order of steps (the diagonal's q tile first, masked), chunks and
head splits are bwd.py's and grid.py's; every wgmma is waited for within its step, as there.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait

from .bwd import STAGES, _loader, _lse_rows, _program, _reduce_add, _store_dkv, _wrap, launch
from . import grid as plans

HEAD_DIMS = (256, )
BLOCK_M = gl.constexpr(64)   # q rows a step
BLOCK_N = gl.constexpr(plans.KV_ROWS[256])  # kv rows a program
COLS = gl.constexpr(32)      # the kv columns of S and dP a warpgroup makes
DQ_COLS = gl.constexpr(32)   # dQ columns a piece
# P and dS tiles (64 q rows x 64 kv columns) where each warpgroup writes 32 columns (SDP off):
# 64-byte swizzle, so that 32 columns are one swizzle atom
# how the warpgroups share a step's S and dP (a probe flag): True, S and P in warpgroup 0, dP and dS
# in 1 (64-column wgmmas; 1 makes its dQ from dS in registers); False, 32 kv columns of each in each
SDP = True
_PS_LAYOUT = gl.constexpr(gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2))


@gluon.jit
def _zero(j):
    # a zero the compiler cannot see through (bwd.py's reason: the wgmma descriptors of the fixed
    # buffers are then built in the step, not hoisted into registers held across the loop)
    return gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [j], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _dq_pieces(dq, dq_tok, ds_a, k_smem, dq_s, dq_desc, dq_row, dq_col, scale, col0: gl.constexpr, PIECES: gl.constexpr):
    # dQ's columns [col0, col0 + PIECES * DQ_COLS) = dS K in pieces (``dq``: the first, in flight as
    # ``dq_tok`` unless None), each reduce-added through ``dq_s``; the next piece's wgmma runs while
    # this one is stored
    if dq_tok is not None:
        dq = warpgroup_mma_wait(0, deps=(dq_tok, ))
    for c in gl.static_range(PIECES):
        if c + 1 < PIECES:
            tok = warpgroup_mma(ds_a, k_smem.slice(col0 + (c + 1) * DQ_COLS, DQ_COLS, dim=1), gl.zeros_like(dq),
                                use_acc=False, is_async=True)
        tma.store_wait(0)  # the previous piece's reduce has read the buffer
        dq_s.store(dq * scale)
        fence_async_shared()
        _reduce_add(dq_desc, [dq_row, dq_col + c * DQ_COLS], dq_s)
        if c + 1 < PIECES:
            dq = warpgroup_mma_wait(0, deps=(tok, ))


@gluon.jit
def _step(j, g, t, dk, dv, descs, bufs, bars, scal, lse2, delta, HEAD_DIM: gl.constexpr, W: gl.constexpr,
          MASKED: gl.constexpr, SDP: gl.constexpr):
    # one (q tile, the program's 64 kv rows) step of warpgroup W: S, dP, P, dS (SDP: S and P in
    # warpgroup 0, dP and dS in 1; else 32 kv columns of each in each); its head-dim half of dK, dV
    # (added in registers) and of dQ (reduce-added)
    q_desc, k_desc, v_desc, do_desc, dq_desc = descs
    k_all, v_all, q_bufs, do_bufs, p_all, ds_all, dq_bufs = bufs
    kv_bar, q_ready, q_empty, x = bars  # x: P ready, P free, dS ready, dS free
    q_row0, kv_row, kv_col, h0, HEADS, n_q, n_mask, q_t0, k_pos0, mask_lo, scale_log2, scale, shift = scal
    dtype: gl.constexpr = q_desc.dtype
    HALF_D: gl.constexpr = HEAD_DIM // 2
    if SDP:
        NCOL: gl.constexpr = BLOCK_N
        C0: gl.constexpr = 0
    else:
        NCOL: gl.constexpr = COLS
        C0: gl.constexpr = W * COLS
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, NCOL, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, DQ_COLS, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)

    st = j % STAGES
    ph = j & 1
    q_s = q_bufs.index(st)
    do_s = do_bufs.index(st)
    z = _zero(j)
    k_smem = k_all.index(z)
    v_smem = v_all.index(z)
    p_s = p_all.index(z)
    ds_s = ds_all.index(z)
    zero = gl.zeros([BLOCK_M, NCOL], gl.float32, s_layout)
    zero_dq = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, dq_layout)
    col0: gl.constexpr = W * HALF_D

    q_t = q_t0 + _wrap(t + shift, n_q)
    mbarrier.wait(q_ready.index(st), (j // STAGES) & 1)
    if SDP and W == 1:
        dp_tok = warpgroup_mma(do_s, v_smem.permute((1, 0)), zero, use_acc=False, is_async=True)
    else:
        s_tok = warpgroup_mma(q_s, k_smem.slice(C0, NCOL, dim=0).permute((1, 0)), zero, use_acc=False,
                              is_async=True)
    if not SDP:
        dp_tok = warpgroup_mma(do_s, v_smem.slice(C0, NCOL, dim=0).permute((1, 0)), zero, use_acc=False,
                               is_async=True)
    if not SDP or W == 0:
        if SDP:
            s = warpgroup_mma_wait(0, deps=(s_tok, ))
        else:
            s = warpgroup_mma_wait(1, deps=(s_tok, ))
        p = gl.exp2(s * scale_log2 - lse2[:, None])
        if MASKED:
            offs_m = q_t * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
            offs_n = k_pos0 + C0 + gl.arange(0, NCOL, layout=col_s)
            p = gl.where((offs_m[:, None] - offs_n[None, :]) >= mask_lo, p, 0.0)
        mbarrier.wait(x.index(1), ph ^ 1)  # the last step's reads of P are done
        p_s.slice(C0, NCOL, dim=1).store(p.to(dtype))
        fence_async_shared()
        mbarrier.arrive(x.index(0), count=1)
    if not SDP or W == 1:
        dp = warpgroup_mma_wait(0, deps=(dp_tok, ))
        if SDP:
            mbarrier.wait(x.index(0), ph)  # warpgroup 0's P (bfloat16, as dV reads it)
            p = p_s.load(s_layout).to(gl.float32)
        ds = p * (dp - delta[:, None])
        mbarrier.wait(x.index(3), ph ^ 1)  # the last step's reads of dS are done
        ds_s.slice(C0, NCOL, dim=1).store(ds.to(dtype))
        fence_async_shared()
        mbarrier.arrive(x.index(2), count=1)

    mbarrier.wait(x.index(0), ph)  # all of P
    dv_tok = warpgroup_mma(p_s.permute((1, 0)), do_s.slice(col0, HALF_D, dim=1), dv, is_async=True)
    mbarrier.wait(x.index(2), ph)  # all of dS
    dk_tok = warpgroup_mma(ds_s.permute((1, 0)), q_s.slice(col0, HALF_D, dim=1), dk, is_async=True)
    if SDP and W == 1:
        # dS from registers (this warpgroup made all of it): no shared-memory reads of the A operand
        ds_a = gl.convert_layout(ds.to(dtype), gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2))
    else:
        ds_a = ds_s
    dq_tok = warpgroup_mma(ds_a, k_smem.slice(col0, DQ_COLS, dim=1), zero_dq, use_acc=False, is_async=True)
    dv, dk, dq = warpgroup_mma_wait(0, deps=(dv_tok, dk_tok, dq_tok))
    mbarrier.arrive(x.index(1), count=1)
    mbarrier.arrive(q_empty.index(st), count=1)
    _dq_pieces(dq, None, ds_a, k_smem, dq_bufs.index(W), dq_desc, q_row0 + q_t * BLOCK_M, (h0 + g) * HEAD_DIM + col0,
               scale, col0, HALF_D // DQ_COLS)
    mbarrier.arrive(x.index(3), count=1)
    return dk, dv


@gluon.jit
def _compute(descs, bufs, bars, scal, lse_h, dl_h, out, HEAD_DIM: gl.constexpr, W: gl.constexpr, DKV: gl.constexpr,
             SDP: gl.constexpr):
    kv_bar = bars[0]
    q_row0, kv_row, kv_col, h0, HEADS, n_q, n_mask, q_t0, k_pos0, mask_lo, scale_log2, scale, shift = scal
    HALF_D: gl.constexpr = HEAD_DIM // 2
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, HALF_D, 16])
    dk = gl.zeros([BLOCK_N, HALF_D], gl.float32, acc_layout)
    dv = gl.zeros([BLOCK_N, HALF_D], gl.float32, acc_layout)
    if SDP:
        NCOL: gl.constexpr = BLOCK_N
    else:
        NCOL: gl.constexpr = COLS
    mbarrier.wait(kv_bar, 0)
    # the diagonal's q tile first (masked), then the rest, as bwd.py; lse and D a step ahead
    j = 0
    for g in range(HEADS):
        lse2, delta = _lse_rows(g, 0, n_mask, q_t0, n_q, shift, lse_h, dl_h, BLOCK_M, NCOL)
        for t in range(n_mask):
            nxt = _lse_rows(g, t + 1, n_mask, q_t0, n_q, shift, lse_h, dl_h, BLOCK_M, NCOL)
            dk, dv = _step(j, g, t, dk, dv, descs, bufs, bars, scal, lse2, delta, HEAD_DIM, W, True, SDP)
            lse2, delta = nxt
            j += 1
    for g in range(HEADS):
        lse2, delta = _lse_rows(g, n_mask, n_q, q_t0, n_q, shift, lse_h, dl_h, BLOCK_M, NCOL)
        for t in range(n_mask, n_q):
            nxt = _lse_rows(g, t + 1, n_q, q_t0, n_q, shift, lse_h, dl_h, BLOCK_M, NCOL)
            dk, dv = _step(j, g, t, dk, dv, descs, bufs, bars, scal, lse2, delta, HEAD_DIM, W, False, SDP)
            lse2, delta = nxt
            j += 1
    tma.store_wait(0)
    # this warpgroup's head-dim half of the program's dK, dV rows
    rows = kv_row + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    cols = kv_col + W * HALF_D + gl.arange(0, HALF_D, layout=gl.SliceLayout(0, acc_layout))
    _store_dkv(dk, dv, rows, cols, out, scale, DKV)


@gluon.jit
def _compute0(descs, bufs, bars, scal, lse_h, dl_h, out, HEAD_DIM: gl.constexpr, DKV: gl.constexpr,
              SDP: gl.constexpr):
    _compute(descs, bufs, bars, scal, lse_h, dl_h, out, HEAD_DIM, 0, DKV, SDP)


@gluon.jit
def _compute1(descs, bufs, bars, scal, lse_h, dl_h, out, HEAD_DIM: gl.constexpr, DKV: gl.constexpr,
              SDP: gl.constexpr):
    _compute(descs, bufs, bars, scal, lse_h, dl_h, out, HEAD_DIM, 1, DKV, SDP)


@gluon.jit
def _loader_part(descs, bufs, bars, scal, lse_h, dl_h, out, HEAD_DIM: gl.constexpr, DKV: gl.constexpr,
                 SDP: gl.constexpr):
    _loader(descs, bufs, bars, scal, HEAD_DIM, BLOCK_M, BLOCK_N)


@gluon.jit(do_not_specialize=["Sq", "Sk", "H", "GROUP", "HEADS", "mask_lo", "chunk", "stagger", "slb", "slh", "sdlb",
                              "sdlh", "sdk", "sdv"])
def bwd_wide_kernel(q_desc, k_desc, v_desc, do_desc, dq_desc, LSE2, DL, DK, DV, Sq, Sk, H, GROUP, HEADS, scale_log2,
                    scale, mask_lo, chunk, stagger, slb, slh, sdlb, sdlh, sdk, sdv, HEAD_DIM: gl.constexpr,
                    DKV: gl.constexpr, SDP: gl.constexpr, LOAD_REGS: gl.constexpr, num_warps: gl.constexpr):
    """bwd.py's bwd_kernel at d=256: the same grid (grid.py's Plan, 64 kv rows a program), the same
    arguments; see the module's docstring for how the warpgroups split a step."""
    dtype: gl.constexpr = q_desc.dtype
    scal, lse_h, dl_h, out = _program(Sq, Sk, H, GROUP, HEADS, chunk, stagger, mask_lo, scale_log2, scale, LSE2, DL,
                                      DK, DV, slb, slh, sdlb, sdlh, sdk, sdv, HEAD_DIM, BLOCK_M, BLOCK_N)

    k_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], q_desc.layout)
    do_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], do_desc.layout)
    if SDP:  # one warpgroup writes each whole tile
        ps_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    else:
        ps_layout: gl.constexpr = _PS_LAYOUT
    p_all = gl.allocate_shared_memory(dtype, [1, BLOCK_M, BLOCK_N], ps_layout)
    ds_all = gl.allocate_shared_memory(dtype, [1, BLOCK_M, BLOCK_N], ps_layout)
    dq_bufs = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, DQ_COLS], dq_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    x = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=2)  # both compute warpgroups release a buffer
    for i in gl.static_range(4):
        # "ready": written by both warpgroups (a half each) or, SDP, by one; "free": read by both
        if SDP and i % 2 == 0:
            mbarrier.init(x.index(i), count=1)
        else:
            mbarrier.init(x.index(i), count=2)

    descs = (q_desc, k_desc, v_desc, do_desc, dq_desc)
    bufs = (k_smem, v_smem, q_bufs, do_bufs, p_all, ds_all, dq_bufs)
    bars = (kv_bar, q_ready, q_empty, x)
    gl.warp_specialize([
        (_compute0, (descs, bufs, bars, scal, lse_h, dl_h, out, HEAD_DIM, DKV, SDP)),
        (_compute1, (descs, bufs, bars, scal, lse_h, dl_h, out, HEAD_DIM, DKV, SDP)),
        (_loader_part, (descs, bufs, bars, scal, lse_h, dl_h, out, HEAD_DIM, DKV, SDP)),
    ], [4, 1], [240, LOAD_REGS])


def backward_into(dout, q, k, v, lse2, delta, scale: float, mask_lo: int | None, dq, dk, dv, fresh: bool) -> None:
    """bwd.backward_into at d=256 (the same contract: bwd.supported takes the call)."""
    launch(bwd_wide_kernel, dict(SDP=SDP), DQ_COLS.value, dout, q, k, v, lse2, delta, scale, mask_lo, dq, dk, dv,
           fresh)
