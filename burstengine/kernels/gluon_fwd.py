"""Hopper forward in Gluon (Triton's explicit dialect) for the plain attention forward: full or
causal, one (batch x head, 128-row q tile) per program, output and lse written fresh.

Why a second forward: Triton's pipeliner waits for each wgmma before the softmax that reads it,
so inside a warpgroup the exponentials and the tensor cores take turns (about 500-520 TFLOP/s on
H200 at d=128).  This kernel is FlashAttention-3's shape, written out by hand:

* warp specialisation: a loader warp issues the TMA loads of Q and of the K/V tiles into a ring
  of shared buffers (``ready`` / ``empty`` mbarriers per buffer); two compute partitions of one
  warpgroup each own 64 q rows, never wait on each other, and get the loader's registers (240);
* in each compute warpgroup the QK^T of tile j+1 is issued (async wgmma) before the softmax of
  tile j, so the tensor cores work under the exponentials.

Two things ptxas punishes, found by building for sm_90a on CPU and reading its warnings: an
accumulator still in flight across the loop's back edge (C7514) and, for a causal build of its
own, register pressure (C7511); either makes ptxas run every wgmma synchronously.  So the PV is
waited for at the end of each step, and causal is a runtime flag of the one build (the causal
diagonal is the last tile, always taken through the masked softmax; for full attention its
mask keeps everything).

Only what the fast path needs (see :func:`supported`); everything else goes to the Triton kernel.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634
BLOCK = gl.constexpr(128)   # q rows per program: two compute warpgroups of 64
# K/V buffers per head dim (kv tiles are BLOCK rows too); a third buffer did not help (H200 probes)
STAGES = {128: 2, 64: 2}


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, offs_m, kv0, DIAG: gl.constexpr, BLOCK_N: gl.constexpr,
                  s_layout: gl.constexpr):
    # scores of one kv tile -> (p, alpha, new m, new l), all in base 2
    if DIAG:
        offs_n = kv0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(offs_m[:, None] >= offs_n[None, :], s * qk_scale, float("-inf"))
    else:
        s = s * qk_scale
    m_new = gl.maximum(m_i, gl.max(s, 1))
    p = gl.exp2(s - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the fast path takes this call (else the caller uses the Triton kernel): Hopper,
    bf16/fp16, d 64/128, Sq = Sk a multiple of the tile, heads side by side in 16-byte aligned rows."""
    B, S, H, D = q.shape
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if k.shape[1] != S or S == 0 or S % BLOCK.value or D not in STAGES or k.shape[-1] != D or v.shape[-1] != D:
        return False
    if H % k.shape[2] or v.shape[2] != k.shape[2]:
        return False
    return all(t.stride(-1) == 1 and t.stride(-2) == D and t.data_ptr() % 16 == 0 for t in (q, k, v))


def _rows(x: torch.Tensor) -> torch.Tensor:
    # (B, S, heads, D) -> (B * S, heads * D) without a copy when the layout allows one
    B, S, Hx, D = x.shape
    if x.stride(2) != D or x.stride(1) != Hx * D or x.stride(0) != S * Hx * D:
        x = x.contiguous()
    return x.view(B * S, Hx * D)


WG_ROWS = gl.constexpr(64)
# 12 warps (two compute warpgroups + the loader's, rounded up): 65536 registers / 384 threads; the
# compiler hands the loader's share to the compute partitions (240 each)
WS_MAXNREG = 168


@gluon.jit
def _ws_loader(descs, bufs, bars, scal, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    q_desc, k_desc, v_desc, o_desc = descs
    q_bufs, k_bufs, v_bufs = bufs
    q_bar, k_ready, k_empty, v_ready, v_empty = bars
    q_row, kv_row, q_col, kv_col, n_kv, causal, qk_scale, lse_base, S = scal
    for w in gl.static_range(2):
        mbarrier.expect(q_bar.index(w), WG_ROWS * HEAD_DIM * 2)
        tma.async_copy_global_to_shared(q_desc, [q_row + w * WG_ROWS, q_col], q_bar.index(w), q_bufs.index(w))
    for i in range(n_kv):
        st = i % STAGES
        ph = (i // STAGES) & 1
        mbarrier.wait(k_empty.index(st), ph ^ 1)
        mbarrier.expect(k_ready.index(st), BLOCK_N * HEAD_DIM * 2)
        tma.async_copy_global_to_shared(k_desc, [kv_row + i * BLOCK_N, kv_col], k_ready.index(st), k_bufs.index(st))
        mbarrier.wait(v_empty.index(st), ph ^ 1)
        mbarrier.expect(v_ready.index(st), BLOCK_N * HEAD_DIM * 2)
        tma.async_copy_global_to_shared(v_desc, [kv_row + i * BLOCK_N, kv_col], v_ready.index(st), v_bufs.index(st))


@gluon.jit
def _ws_compute(descs, bufs, bars, scal, W: gl.constexpr, LSE, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                STAGES: gl.constexpr):
    # rows [W * 64, W * 64 + 64) of the q tile, in one warpgroup
    q_desc, k_desc, v_desc, o_desc = descs
    q_bufs, k_bufs, v_bufs = bufs
    q_bar, k_ready, k_empty, v_ready, v_empty = bars
    q_row, kv_row, q_col, kv_col, n_kv, causal, qk_scale, lse_base, S = scal
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_smem = q_bufs.index(W)

    row0 = q_row - kv_row + W * WG_ROWS  # this warpgroup's first query position
    offs_m = row0 + gl.arange(0, WG_ROWS, layout=row_s)
    m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([WG_ROWS], gl.float32, row_s)
    acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, o_layout)
    s_zero = gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout)

    mbarrier.wait(q_bar.index(W), 0)
    mbarrier.wait(k_ready.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s_cur = warpgroup_mma_wait(0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(0), count=1)

    for j in range(n_kv - 1):
        st = j % STAGES
        nxt = j + 1
        nst = nxt % STAGES
        mbarrier.wait(k_ready.index(nst), (nxt // STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_bufs.index(nst).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale, offs_m, j * BLOCK_N, False, BLOCK_N, s_layout)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        mbarrier.wait(v_ready.index(st), (j // STAGES) & 1)
        acc_tok = warpgroup_mma(p_op, v_bufs.index(st), acc, is_async=True)
        s_cur, acc = warpgroup_mma_wait(0, deps=(s_tok, acc_tok))
        mbarrier.arrive(k_empty.index(nst), count=1)
        mbarrier.arrive(v_empty.index(st), count=1)

    j = n_kv - 1
    st = j % STAGES
    diag0 = j * BLOCK_N - gl.where(causal != 0, 0, S)
    p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale, offs_m, diag0, True, BLOCK_N, s_layout)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    mbarrier.wait(v_ready.index(st), (j // STAGES) & 1)
    acc_tok = warpgroup_mma(p_op, v_bufs.index(st), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
    mbarrier.arrive(v_empty.index(st), count=1)

    l_o = gl.convert_layout(l_i, row_o)
    out = acc / l_o[:, None]
    lse = (m_i + gl.log2(l_i)) / 1.4426950408889634
    gl.store(LSE + lse_base + offs_m, lse)
    q_smem.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row + W * WG_ROWS, q_col], q_smem)
    tma.store_wait(0)


@gluon.jit
def _ws_compute0(descs, bufs, bars, scal, LSE, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    _ws_compute(descs, bufs, bars, scal, 0, LSE, HEAD_DIM, BLOCK_N, STAGES)


@gluon.jit
def _ws_compute1(descs, bufs, bars, scal, LSE, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    _ws_compute(descs, bufs, bars, scal, 1, LSE, HEAD_DIM, BLOCK_N, STAGES)


@gluon.jit
def _ws_load(descs, bufs, bars, scal, LSE, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    _ws_loader(descs, bufs, bars, scal, HEAD_DIM, BLOCK_N, STAGES)


@gluon.jit(do_not_specialize=["S", "H", "GROUP", "causal"])
def fwd_kernel(q_desc, k_desc, v_desc, o_desc, LSE, S, H, GROUP, qk_scale, causal,
                  HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, LOAD_REGS: gl.constexpr,
                  num_warps: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    n_m = S // BLOCK
    pid_m = n_m - 1 - gl.program_id(0)
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    n_kv = gl.where(causal != 0, pid_m + 1, n_m)
    q_bufs = gl.allocate_shared_memory(dtype, [2, WG_ROWS, HEAD_DIM], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both compute warpgroups release a buffer
        mbarrier.init(v_empty.index(i), count=2)
    descs = (q_desc, k_desc, v_desc, o_desc)
    bufs = (q_bufs, k_bufs, v_bufs)
    bars = (q_bar, k_ready, k_empty, v_ready, v_empty)
    scal = (b * S + pid_m * BLOCK, b * S, h * HEAD_DIM, (h // GROUP) * HEAD_DIM, n_kv, causal, qk_scale,
            bh.to(gl.int64) * S, S)
    gl.warp_specialize([
        (_ws_compute0, (descs, bufs, bars, scal, LSE, HEAD_DIM, BLOCK_N, STAGES)),
        (_ws_compute1, (descs, bufs, bars, scal, LSE, HEAD_DIM, BLOCK_N, STAGES)),
        (_ws_load, (descs, bufs, bars, scal, LSE, HEAD_DIM, BLOCK_N, STAGES)),
    ], [4, 1], [240, LOAD_REGS])


def forward(q, k, v, scale: float, causal: bool, stages: int | None = None, load_regs: int = 24):
    """(out (B, S, H, D) in q's dtype, lse (B, H, S) float32) of softmax(q k^T * scale) v, causal
    (query i sees keys j <= i) or full; the tensors must pass :func:`supported`."""
    B, S, H, D = q.shape
    block_n = BLOCK.value
    stages = stages or STAGES[D]
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for([WG_ROWS.value, D], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, D], gdt)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    descs = [TensorDescriptor.from_tensor(_rows(q), [WG_ROWS.value, D], q_layout),
             TensorDescriptor.from_tensor(_rows(k), [block_n, D], kv_layout),
             TensorDescriptor.from_tensor(_rows(v), [block_n, D], kv_layout),
             TensorDescriptor.from_tensor(_rows(out), [WG_ROWS.value, D], q_layout)]
    grid = (S // BLOCK.value, B * H)
    fwd_kernel[grid](*descs, lse, S, H, H // k.shape[2], scale * LOG2E, int(bool(causal)), HEAD_DIM=D,
                        BLOCK_N=block_n, STAGES=stages, LOAD_REGS=load_regs, num_warps=4, maxnreg=WS_MAXNREG)
    return out, lse
