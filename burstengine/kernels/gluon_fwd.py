"""Hopper forward in Gluon (Triton's explicit-layout dialect) for the plain attention forward:
full or causal, one (batch, head, q tile) per program, output and lse written fresh.

Why a second forward: Triton's own pipeliner waits for each wgmma before the softmax that
reads it, so the exponentials and the tensor cores take turns inside a warpgroup (about 500
TFLOP/s on H200 for d=128).  Here the wgmma are issued asynchronously by hand, FlashAttention-3's
intra-warpgroup overlap: at step j the QK^T of tile j+1 and the PV of tile j-1 run on the tensor
cores while the warpgroup does the softmax of tile j.  K and V arrive by TMA into a two-stage
ring of shared buffers, each refilled as soon as the wgmma that read it is known to be done.

Only what the fast path needs: Sq = Sk, a multiple of the tile, d 64 or 128, bf16/fp16, rows of
(B, S, H, D) tensors with the head dim contiguous; everything else goes to the Triton kernel.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = 1.4426950408889634
BLOCK = gl.constexpr(128)   # q rows per tile
WARPS = 8                   # two warpgroups of 64 q rows each
# per head dim: (kv rows per tile, K/V buffers); 64-row kv tiles (3 or 4 buffers) were ~18% slower
# at d=128 on H200 in our probes: twice the wgmma issues and barrier waits for the same work
TILES = {128: (128, 2), 64: (128, 2)}


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


@gluon.jit(do_not_specialize=["S", "H", "GROUP", "causal"])
def fwd_kernel(q_desc, k_desc, v_desc, o_desc, LSE, S, H, GROUP, qk_scale, causal,
               HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = q_desc.dtype
    n_m = S // BLOCK
    pid_m = gl.program_id(0)
    # the longest rows first (causal), the same code for both masks: a causal build of its own needs
    # more registers, and ptxas then runs every wgmma synchronously
    pid_m = n_m - 1 - pid_m
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    q_row = b * S + pid_m * BLOCK
    kv_row = b * S
    RATIO: gl.constexpr = BLOCK // BLOCK_N  # kv tiles per q tile
    q_col = h * HEAD_DIM
    kv_col = (h // GROUP) * HEAD_DIM

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=1)
        mbarrier.init(v_bar.index(i), count=1)

    n_kv = gl.where(causal != 0, pid_m + 1, n_m) * RATIO
    q_bytes: gl.constexpr = BLOCK * HEAD_DIM * 2
    tile_bytes: gl.constexpr = BLOCK_N * HEAD_DIM * 2
    mbarrier.expect(q_bar, q_bytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, q_col], q_bar, q_smem)
    for i in gl.static_range(STAGES):
        pred = i < n_kv
        mbarrier.expect(k_bar.index(i), tile_bytes, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [kv_row + i * BLOCK_N, kv_col], k_bar.index(i), k_smem.index(i),
                                        pred=pred)
        mbarrier.expect(v_bar.index(i), tile_bytes, pred=pred)
        tma.async_copy_global_to_shared(v_desc, [kv_row + i * BLOCK_N, kv_col], v_bar.index(i), v_smem.index(i),
                                        pred=pred)

    offs_m = pid_m * BLOCK + gl.arange(0, BLOCK, layout=row_s)
    m_i = gl.full([BLOCK], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK], gl.float32, row_s)
    acc = gl.zeros([BLOCK, HEAD_DIM], gl.float32, o_layout)
    s_zero = gl.zeros([BLOCK, BLOCK_N], gl.float32, s_layout)

    # scores of tile 0
    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_bar.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s_cur = warpgroup_mma_wait(0, deps=(s_tok, ))

    # every tile but the last (the causal diagonal): no mask, the next scores always exist
    for j in range(n_kv - 1):
        st = j % STAGES
        nxt = j + 1
        # scores of tile j + 1 start now and run under this tile's softmax
        mbarrier.wait(k_bar.index(nxt % STAGES), (nxt // STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_smem.index(nxt % STAGES).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)
        if RATIO > 1:
            # the kv tiles under the q tile's diagonal but the last
            if (causal != 0) & (j >= n_kv - RATIO):
                p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale, offs_m, j * BLOCK_N, True, BLOCK_N,
                                                   s_layout)
            else:
                p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale, offs_m, j * BLOCK_N, False, BLOCK_N,
                                                   s_layout)
        else:
            p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale, offs_m, j * BLOCK_N, False, BLOCK_N,
                                               s_layout)
        # PV of tile j - 1 is done once at most the scores just issued are in flight
        acc = warpgroup_mma_wait(1, deps=(acc, ))
        # both warpgroups are past their reads of K tile j and V tile j - 1: refill those buffers
        gl.thread_barrier()
        rk = j + STAGES
        mbarrier.expect(k_bar.index(st), tile_bytes, pred=rk < n_kv)
        tma.async_copy_global_to_shared(k_desc, [kv_row + rk * BLOCK_N, kv_col], k_bar.index(st), k_smem.index(st),
                                        pred=rk < n_kv)
        rv = j - 1 + STAGES
        vst = rv % STAGES
        mbarrier.expect(v_bar.index(vst), tile_bytes, pred=(j > 0) & (rv < n_kv))
        tma.async_copy_global_to_shared(v_desc, [kv_row + rv * BLOCK_N, kv_col], v_bar.index(vst), v_smem.index(vst),
                                        pred=(j > 0) & (rv < n_kv))
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        mbarrier.wait(v_bar.index(st), (j // STAGES) & 1)
        acc_tok = warpgroup_mma(p_op, v_smem.index(st), acc, is_async=True)
        # the PV is waited for here, not under the next softmax: an accumulator in flight across the loop's
        # back edge makes ptxas run every wgmma synchronously (C7514)
        s_cur, acc = warpgroup_mma_wait(0, deps=(s_tok, acc_tok))

    j = n_kv - 1
    st = j % STAGES
    # the last tile always goes through the masked step (for full attention its mask keeps everything):
    # one code shape for both, and ptxas then keeps the wgmma of the loop asynchronous
    diag0 = j * BLOCK_N - gl.where(causal != 0, 0, S)
    p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale, offs_m, diag0, True, BLOCK_N, s_layout)
    acc = warpgroup_mma_wait(0, deps=(acc, ))
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    mbarrier.wait(v_bar.index(st), (j // STAGES) & 1)
    acc_tok = warpgroup_mma(p_op, v_smem.index(st), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
    gl.thread_barrier()

    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_bar.index(i))
        mbarrier.invalidate(v_bar.index(i))

    l_o = gl.convert_layout(l_i, row_o)
    out = acc / l_o[:, None]
    lse = (m_i + gl.log2(l_i)) / 1.4426950408889634
    gl.store(LSE + bh.to(gl.int64) * S + offs_m, lse)
    q_smem.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row, q_col], q_smem)
    tma.store_wait(0)


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the fast path takes this call (else the caller uses the Triton kernel): Hopper,
    bf16/fp16, d 64/128, Sq = Sk a multiple of the tile, heads side by side in 16-byte aligned rows."""
    B, S, H, D = q.shape
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if k.shape[1] != S or S == 0 or S % BLOCK.value or D not in TILES or k.shape[-1] != D or v.shape[-1] != D:
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


def forward(q, k, v, scale: float, causal: bool, block_n: int | None = None, stages: int | None = None):
    """(out (B, S, H, D) in q's dtype, lse (B, H, S) float32) of softmax(q k^T * scale) v."""
    B, S, H, D = q.shape
    block_n = block_n or TILES[D][0]
    stages = stages or TILES[D][1]
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    layout = gl.NVMMASharedLayout.get_default_for([BLOCK.value, D], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, D], gdt)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    descs = [TensorDescriptor.from_tensor(_rows(q), [BLOCK.value, D], layout),
             TensorDescriptor.from_tensor(_rows(k), [block_n, D], kv_layout),
             TensorDescriptor.from_tensor(_rows(v), [block_n, D], kv_layout),
             TensorDescriptor.from_tensor(_rows(out), [BLOCK.value, D], layout)]
    grid = (S // BLOCK.value, B * H)
    fwd_kernel[grid](*descs, lse, S, H, H // k.shape[2], scale * LOG2E, int(bool(causal)), HEAD_DIM=D,
                     BLOCK_N=block_n, STAGES=stages, num_warps=WARPS)
    return out, lse
