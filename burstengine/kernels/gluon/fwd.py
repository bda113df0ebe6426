"""Hopper attention forward in Gluon (Triton's explicit dialect), one (batch x head, 128-row q
tile) per program: the plain forward (full or causal, output and lse written fresh) and the ring
step's merge of a full, causal or strict block into the running float32 (O, lse).

Why a second forward: Triton's pipeliner waits for each wgmma before the softmax that reads it,
so inside a warpgroup the exponentials and the tensor cores take turns (490-509 TFLOP/s on
H200 at d=128, benchmarks/results/lao_bench.json as of commit 997daae).  This kernel is
FlashAttention-3's shape, written out by hand:

* warp specialisation: a loader warp issues the TMA loads of Q and of the K/V tiles into a ring
  of shared buffers (``ready`` / ``empty`` mbarriers per buffer); two compute partitions of one
  warpgroup each own 64 q rows, never wait on each other, and get the loader's registers (240);
* in each compute warpgroup the QK^T of tile j+1 is issued (async wgmma) before the softmax of
  tile j, so the tensor cores work under the exponentials.

Two things ptxas punishes, found by building for sm_90a on CPU and reading its warnings: an
accumulator still in flight across the loop's back edge (C7514) and, for a causal build of its
own, register pressure (C7511); either makes ptxas run every wgmma synchronously.  So the PV is
waited for at the end of each step, and the mask is a runtime value of the one build (the
diagonal is the last tile, always taken through the masked softmax; for a full block its mask
keeps everything).

At d=96 (_ws_pieces) every tile goes in two column pieces, 64 and 32 (a Triton tile's dimensions
are powers of two).  At d=256 (_ws_wide) a warpgroup's O is 128 registers a thread: kv tiles of 64 rows, and O in two
128-column halves so that the ring step's float32 state can pass through the Q buffer (no room for
one of its own beside two K/V buffers).

Only what the fast path needs (see :func:`supported`); everything else goes to the Triton kernel.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma, \
    warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = gl.constexpr(1.4426950408889634)
BLOCK = gl.constexpr(128)   # q rows per program: two compute warpgroups of 64
# K/V buffers per head dim; a third buffer did not help (H200 probes)
STAGES = {128: 2, 64: 2, 256: 2, 96: 2}
# kv rows a tile per head dim.  At d=256 a warpgroup's O alone is 128 registers a thread: 64-row
# kv tiles keep S (and the next tile's S in flight) at 32 each, and two buffers of K and V (128 KB)
# fit beside Q (64 KB) in shared memory
KV_ROWS = {128: 128, 64: 128, 256: 64, 96: 128}
# head dims that are not a power of two go in two column pieces (a Triton tile's dimensions are
# powers of two): Q, K, V and O each as two tiles, S = Q0 K0^T + Q1 K1^T, O0 = P V0, O1 = P V1
PIECES = {96: (64, 32)}


@gluon.jit
def _softmax_step(s, m_i, l_i, qk_scale, offs_m, offs_n, mask_lo, MASKED: gl.constexpr, FFMA: gl.constexpr):
    # scores of one kv tile -> (p, alpha, new m, new l), all in base 2; MASKED: a pair is visible
    # iff q index - k index >= mask_lo, and rows that still see nothing keep m = -inf, p = 0.
    # FFMA (qk_scale > 0): the row max is taken of the raw scores and scaled after, so the exponent
    # s * qk_scale - m is one FFMA and no scaled copy of s is made: 62 fewer of the step's 581
    # instructions a thread.  Time: 1.03x at 64K-128K in one H200 launch
    # (gluon_fwd_variants_h200.json), level in the next (gluon_fwd_h200.json) and in training: the
    # loop is not issue-bound
    if not FFMA:
        s = s * qk_scale  # before the mask: -inf times a negative scale would be +inf
    if MASKED:
        s = gl.where((offs_m[:, None] - offs_n[None, :]) >= mask_lo, s, float("-inf"))
    if FFMA:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1))
    if MASKED:
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    if FFMA:
        x = s * qk_scale - m_use[:, None]
    else:
        x = s - m_use[:, None]
    p = gl.exp2(x)
    alpha = gl.exp2(m_i - m_use)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, diag: bool, *state) -> bool:
    """Whether the fast path takes this call (else the caller uses the Triton kernel): Hopper,
    bf16/fp16, d 64, 96, 128 or 256, lengths multiples of 128 (Sq = Sk for a diagonal mask), heads side by
    side in 16-byte aligned rows; ``state`` (out, lse): float32, rows of heads side by side."""
    B, Sq, H, D = q.shape
    Sk = k.shape[1]
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if 0 in (Sq, Sk) or Sq % BLOCK.value or Sk % BLOCK.value or (diag and Sq != Sk):
        return False
    if D not in STAGES or k.shape[-1] != D or v.shape[-1] != D or H % k.shape[2] or v.shape[2] != k.shape[2]:
        return False
    if not all(t.stride(-1) == 1 and t.stride(-2) == D and t.data_ptr() % 16 == 0 for t in (q, k, v)):
        return False
    if state:
        out, lse = state
        # written in place through a (rows, heads * D) view of itself
        if out.shape != q.shape or out.dtype != torch.float32 or lse.dtype != torch.float32 or not writable_rows(out):
            return False
    return True


def rows_view(x: torch.Tensor) -> bool:
    """Whether (B, S, heads, D) ``x`` is a (B * S, heads * D) matrix without a copy: one batch
    (a slice of its rows too), or batches back to back."""
    B, S, Hx, D = x.shape
    return x.stride(-1) == 1 and x.stride(2) == D and x.stride(1) == Hx * D and (B == 1 or x.stride(0) == S * Hx * D)


def writable_rows(x: torch.Tensor) -> bool:
    """Whether a kernel can write ``x`` in place through TMA or pointers: a rows view of itself
    (see :func:`rows_view`), 16-byte aligned."""
    return rows_view(x) and x.data_ptr() % 16 == 0


def _rows(x: torch.Tensor) -> torch.Tensor:
    # (B, S, heads, D) -> (B * S, heads * D), a copy only where rows_view says it must be
    B, S, Hx, D = x.shape
    if rows_view(x):
        return x.as_strided((B * S, Hx * D), (Hx * D, 1))
    return x.contiguous().view(B * S, Hx * D)


_GL_DTYPE = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


def row_desc(x: torch.Tensor, block) -> TensorDescriptor:
    """A TMA descriptor of ``block`` tiles over the (rows, heads * D) matrix of ``x``, in the
    default NVMMA shared layout for its dtype."""
    return TensorDescriptor.from_tensor(_rows(x), list(block),
                                        gl.NVMMASharedLayout.get_default_for(list(block), _GL_DTYPE[x.dtype]))


WG_ROWS = gl.constexpr(64)
# 12 warps (two compute warpgroups + the loader's, rounded up): 65536 registers / 384 threads; the
# compiler hands the loader's share to the compute partitions (240 each)
WS_MAXNREG = 168
LOADER_REGS = 24  # the loader warp's registers: the minimum, it holds only scalars


@gluon.jit
def _ws_loader(descs, bufs, bars, scal, LSE, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
               ACC: gl.constexpr, FFMA: gl.constexpr):
    q_desc, k_desc, v_desc, o_desc = descs[0], descs[1], descs[2], descs[3]
    q_bufs, k_bufs, v_bufs, o_bufs = bufs[0], bufs[1], bufs[2], bufs[3]
    q_bar, k_ready, k_empty, v_ready, v_empty, o_bar = bars
    q_row, kv_row, q_col, kv_col, n_kv, q_pos0, mask_lo, qk_scale, lse_off, sls = scal
    # PIECES: the second column piece of each tile (descs[4:], bufs[4:]), on the same barrier
    TWO: gl.constexpr = len(descs) > 4
    if TWO:
        D0: gl.constexpr = descs[0].block_type.shape[1]
    for w in gl.static_range(2):
        mbarrier.expect(q_bar.index(w), WG_ROWS * HEAD_DIM * 2)
        tma.async_copy_global_to_shared(q_desc, [q_row + w * WG_ROWS, q_col], q_bar.index(w), q_bufs.index(w))
        if TWO:
            tma.async_copy_global_to_shared(descs[4], [q_row + w * WG_ROWS, q_col + D0], q_bar.index(w),
                                            bufs[4].index(w))
    for i in range(n_kv):
        st = i % STAGES
        ph = (i // STAGES) & 1
        mbarrier.wait(k_empty.index(st), ph ^ 1)
        mbarrier.expect(k_ready.index(st), BLOCK_N * HEAD_DIM * 2)
        tma.async_copy_global_to_shared(k_desc, [kv_row + i * BLOCK_N, kv_col], k_ready.index(st), k_bufs.index(st))
        if TWO:
            tma.async_copy_global_to_shared(descs[5], [kv_row + i * BLOCK_N, kv_col + D0], k_ready.index(st),
                                            bufs[5].index(st))
        mbarrier.wait(v_empty.index(st), ph ^ 1)
        mbarrier.expect(v_ready.index(st), BLOCK_N * HEAD_DIM * 2)
        tma.async_copy_global_to_shared(v_desc, [kv_row + i * BLOCK_N, kv_col], v_ready.index(st), v_bufs.index(st))
        if TWO:
            tma.async_copy_global_to_shared(descs[6], [kv_row + i * BLOCK_N, kv_col + D0], v_ready.index(st),
                                            bufs[6].index(st))


@gluon.jit
def _ws_compute(descs, bufs, bars, scal, LSE, W: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                ACC: gl.constexpr, FFMA: gl.constexpr):
    # rows [W * 64, W * 64 + 64) of the q tile, in one warpgroup
    q_desc, k_desc, v_desc, o_desc = descs[0], descs[1], descs[2], descs[3]
    q_bufs, k_bufs, v_bufs, o_bufs = bufs[0], bufs[1], bufs[2], bufs[3]
    q_bar, k_ready, k_empty, v_ready, v_empty, o_bar = bars
    q_row, kv_row, q_col, kv_col, n_kv, q_pos0, mask_lo, qk_scale, lse_off, sls = scal
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    q_smem = q_bufs.index(W)
    o_smem = o_bufs.index(W)

    first = q_pos0 + W * WG_ROWS  # this warpgroup's first q row in the block
    offs_m = first + gl.arange(0, WG_ROWS, layout=row_s)
    l_ptrs = LSE + lse_off + offs_m.to(gl.int64) * sls
    if ACC:
        # start from the running state: true O = acc / l, lse = (m + log2 l) / log2(e)
        lse_old = gl.load(l_ptrs)
        m_i = lse_old * LOG2E
        l_i = gl.where(lse_old == float("-inf"), 0.0, 1.0)
        mbarrier.expect(o_bar.index(W), WG_ROWS * HEAD_DIM * 4)
        tma.async_copy_global_to_shared(o_desc, [q_row + W * WG_ROWS, q_col], o_bar.index(W), o_smem)
        mbarrier.wait(o_bar.index(W), 0)
        acc = o_smem.load(o_layout)
        acc = gl.where(gl.convert_layout(l_i, row_o)[:, None] > 0, acc, 0.0)
    else:
        m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([WG_ROWS], gl.float32, row_s)
        acc = gl.zeros([WG_ROWS, HEAD_DIM], gl.float32, o_layout)
    s_zero = gl.zeros([WG_ROWS, BLOCK], gl.float32, s_layout)
    cols = gl.arange(0, BLOCK, layout=col_s)

    mbarrier.wait(q_bar.index(W), 0)
    mbarrier.wait(k_ready.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s_cur = warpgroup_mma_wait(0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(0), count=1)

    # every tile but the last is fully visible (the last holds the causal/strict diagonal)
    for j in range(n_kv - 1):
        st = j % STAGES
        nxt = j + 1
        nst = nxt % STAGES
        mbarrier.wait(k_ready.index(nst), (nxt // STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_bufs.index(nst).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale, offs_m, cols, mask_lo, False, FFMA)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        mbarrier.wait(v_ready.index(st), (j // STAGES) & 1)
        acc_tok = warpgroup_mma(p_op, v_bufs.index(st), acc, is_async=True)
        s_cur, acc = warpgroup_mma_wait(0, deps=(s_tok, acc_tok))
        mbarrier.arrive(k_empty.index(nst), count=1)
        mbarrier.arrive(v_empty.index(st), count=1)

    j = n_kv - 1
    st = j % STAGES
    p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale, offs_m, j * BLOCK + cols, mask_lo, True, FFMA)
    acc = acc * gl.convert_layout(alpha, row_o)[:, None]
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    mbarrier.wait(v_ready.index(st), (j // STAGES) & 1)
    acc_tok = warpgroup_mma(p_op, v_bufs.index(st), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc_tok, ))
    mbarrier.arrive(v_empty.index(st), count=1)

    seen = l_i > 0
    l_safe = gl.where(seen, l_i, 1.0)
    out = acc / gl.convert_layout(l_safe, row_o)[:, None]
    gl.store(l_ptrs, gl.where(seen, (m_i + gl.log2(l_safe)) / LOG2E, float("-inf")))
    # through shared memory and TMA: in q's dtype into q's buffer (fresh), or float32 into the
    # running state's (as pointer tensors the float32 rows spilled registers)
    if ACC:
        o_smem.store(out)
    else:
        o_smem.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [q_row + W * WG_ROWS, q_col], o_smem)
    tma.store_wait(0)


@gluon.jit
def _wide_step(j, s_cur, acc0, acc1, m_i, l_i, q_smem, k_bufs, v_bufs, bars, offs_m, cols, mask_lo, qk_scale,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, MASKED: gl.constexpr, FFMA: gl.constexpr):
    # kv tile j of _ws_wide: the QK^T of tile j + 1 issued, then tile j's softmax and its two PVs
    q_bar, k_ready, k_empty, v_ready, v_empty, o_bar = bars
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = s_cur.type.layout
    o_layout: gl.constexpr = acc0.type.layout
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    HALF_D: gl.constexpr = acc0.type.shape[1]
    st = j % STAGES
    nxt = j + 1
    nst = nxt % STAGES
    mbarrier.wait(k_ready.index(nst), (nxt // STAGES) & 1)
    s_tok = warpgroup_mma(q_smem, k_bufs.index(nst).permute((1, 0)), gl.zeros_like(s_cur), use_acc=False,
                          is_async=True)
    p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale, offs_m, j * BLOCK_N + cols, mask_lo, MASKED, FFMA)
    a = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    acc0 = acc0 * a
    acc1 = acc1 * a
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    mbarrier.wait(v_ready.index(st), (j // STAGES) & 1)
    v_smem = v_bufs.index(st)
    t0 = warpgroup_mma(p_op, v_smem.slice(0, HALF_D, dim=1), acc0, is_async=True)
    t1 = warpgroup_mma(p_op, v_smem.slice(HALF_D, HALF_D, dim=1), acc1, is_async=True)
    s_cur, acc0, acc1 = warpgroup_mma_wait(0, deps=(s_tok, t0, t1))
    mbarrier.arrive(k_empty.index(nst), count=1)
    mbarrier.arrive(v_empty.index(st), count=1)
    return s_cur, acc0, acc1, m_i, l_i


@gluon.jit
def _ws_wide(descs, bufs, bars, scal, LSE, W: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
             STAGES: gl.constexpr, ACC: gl.constexpr, FFMA: gl.constexpr):
    # _ws_compute at d=256: kv tiles of BLOCK_N = 64 rows, so two cross a causal diagonal (the last
    # two are taken masked); O in two 128-column halves (two PV wgmmas a tile, the same tensor
    # work), so that the running state of ACC can pass through this warpgroup's Q buffer (32 KB) a
    # half at a time: there is no room beside K and V for a float32 O buffer.  ACC starts from the
    # old state's m and l with O at zero and adds the old O at the end, scaled by 2^(m_old - m): the
    # product of the alphas that would have scaled it
    q_desc, k_desc, v_desc, o_desc = descs[0], descs[1], descs[2], descs[3]
    q_bufs, k_bufs, v_bufs, o_bufs = bufs[0], bufs[1], bufs[2], bufs[3]
    q_bar, k_ready, k_empty, v_ready, v_empty, o_bar = bars
    q_row, kv_row, q_col, kv_col, n_kv, q_pos0, mask_lo, qk_scale, lse_off, sls = scal
    dtype: gl.constexpr = q_desc.dtype
    HALF_D: gl.constexpr = HEAD_DIM // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF_D, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    q_smem = q_bufs.index(W)

    offs_m = q_pos0 + W * WG_ROWS + gl.arange(0, WG_ROWS, layout=row_s)
    l_ptrs = LSE + lse_off + offs_m.to(gl.int64) * sls
    if ACC:
        lse_old = gl.load(l_ptrs)
        m_i = lse_old * LOG2E
        l_i = gl.where(lse_old == float("-inf"), 0.0, 1.0)
    else:
        m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([WG_ROWS], gl.float32, row_s)
    m_old = m_i
    acc0 = gl.zeros([WG_ROWS, HALF_D], gl.float32, o_layout)
    acc1 = gl.zeros([WG_ROWS, HALF_D], gl.float32, o_layout)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))

    mbarrier.wait(q_bar.index(W), 0)
    mbarrier.wait(k_ready.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), gl.zeros([WG_ROWS, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
    s_cur = warpgroup_mma_wait(0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(0), count=1)

    MASKED_TILES: gl.constexpr = BLOCK // BLOCK_N  # the kv tiles a q tile's diagonal crosses
    for j in range(n_kv - MASKED_TILES):
        s_cur, acc0, acc1, m_i, l_i = _wide_step(j, s_cur, acc0, acc1, m_i, l_i, q_smem, k_bufs, v_bufs, bars, offs_m,
                                                 cols, mask_lo, qk_scale, BLOCK_N, STAGES, False, FFMA)
    for j in range(n_kv - MASKED_TILES, n_kv - 1):
        s_cur, acc0, acc1, m_i, l_i = _wide_step(j, s_cur, acc0, acc1, m_i, l_i, q_smem, k_bufs, v_bufs, bars, offs_m,
                                                 cols, mask_lo, qk_scale, BLOCK_N, STAGES, True, FFMA)
    j = n_kv - 1
    st = j % STAGES
    p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale, offs_m, j * BLOCK_N + cols, mask_lo, True, FFMA)
    a = gl.convert_layout(alpha, row_o)[:, None]
    p_op = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    mbarrier.wait(v_ready.index(st), (j // STAGES) & 1)
    v_smem = v_bufs.index(st)
    t0 = warpgroup_mma(p_op, v_smem.slice(0, HALF_D, dim=1), acc0 * a, is_async=True)
    t1 = warpgroup_mma(p_op, v_smem.slice(HALF_D, HALF_D, dim=1), acc1 * a, is_async=True)
    acc0, acc1 = warpgroup_mma_wait(0, deps=(t0, t1))
    mbarrier.arrive(v_empty.index(st), count=1)

    seen = l_i > 0
    l_safe = gl.where(seen, l_i, 1.0)
    gl.store(l_ptrs, gl.where(seen, (m_i + gl.log2(l_safe)) / LOG2E, float("-inf")))
    inv = gl.convert_layout(1.0 / l_safe, row_o)[:, None]
    row = q_row + W * WG_ROWS
    if ACC:
        # the old O a half at a time through Q's buffer (free: the last QK^T has been waited for)
        had = gl.convert_layout(m_old > float("-inf"), row_o)[:, None]
        keep = gl.convert_layout(gl.exp2(gl.where(m_old > float("-inf"), m_old - m_i, 0.0)), row_o)[:, None]
        buf = q_smem._reinterpret(gl.float32, [WG_ROWS, HALF_D], o_desc.layout)
        for h in gl.static_range(2):
            mbarrier.expect(o_bar.index(W), WG_ROWS * HALF_D * 4)
            tma.async_copy_global_to_shared(o_desc, [row, q_col + h * HALF_D], o_bar.index(W), buf)
            mbarrier.wait(o_bar.index(W), h)
            old = gl.where(had, buf.load(o_layout) * keep, 0.0)
            if h == 0:
                out = (acc0 + old) * inv
            else:
                out = (acc1 + old) * inv
            buf.store(out)
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [row, q_col + h * HALF_D], buf)
            tma.store_wait(0)
    else:
        q_smem.slice(0, HALF_D, dim=1).store((acc0 * inv).to(dtype))
        q_smem.slice(HALF_D, HALF_D, dim=1).store((acc1 * inv).to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [row, q_col], q_smem)
        tma.store_wait(0)


@gluon.jit
def _pieces_qk(q0, q1, k0, k1, zero):
    # S = Q0 K0^T + Q1 K1^T, the two wgmmas chained on one accumulator, in flight
    tok = warpgroup_mma(q0, k0.permute((1, 0)), zero, use_acc=False, is_async=True)
    return warpgroup_mma(q1, k1.permute((1, 0)), tok, is_async=True)


@gluon.jit
def _pieces_pv(p, acc0, acc1, v0, v1, alpha):
    # O_i = alpha O_i + P V_i for both column pieces, in flight
    o0: gl.constexpr = acc0.type.layout
    o1: gl.constexpr = acc1.type.layout
    acc0 = acc0 * gl.convert_layout(alpha, gl.SliceLayout(1, o0))[:, None]
    acc1 = acc1 * gl.convert_layout(alpha, gl.SliceLayout(1, o1))[:, None]
    t0 = warpgroup_mma(gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=o0, k_width=2)), v0, acc0,
                       is_async=True)
    t1 = warpgroup_mma(gl.convert_layout(p, gl.DotOperandLayout(operand_index=0, parent=o1, k_width=2)), v1, acc1,
                       is_async=True)
    return t0, t1


@gluon.jit
def _ws_pieces(descs, bufs, bars, scal, LSE, W: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
               ACC: gl.constexpr, FFMA: gl.constexpr):
    # _ws_compute for a head dim in two column pieces (PIECES: d=96 as 64 + 32): Q, K, V and O
    # each two tiles (descs[4:], bufs[4:] the second), S from two chained wgmmas, O two accumulators
    q_desc, k_desc, v_desc, o_desc, q_desc1, k_desc1, v_desc1, o_desc1 = descs
    q_bufs, k_bufs, v_bufs, o_bufs, q_bufs1, k_bufs1, v_bufs1, o_bufs1 = bufs
    q_bar, k_ready, k_empty, v_ready, v_empty, o_bar = bars
    q_row, kv_row, q_col, kv_col, n_kv, q_pos0, mask_lo, qk_scale, lse_off, sls = scal
    dtype: gl.constexpr = q_desc.dtype
    D0: gl.constexpr = q_desc.block_shape[1]
    D1: gl.constexpr = HEAD_DIM - D0
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK, 16])
    o_layout0: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, D0, 16])
    o_layout1: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, D1, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    q0 = q_bufs.index(W)
    q1 = q_bufs1.index(W)

    offs_m = q_pos0 + W * WG_ROWS + gl.arange(0, WG_ROWS, layout=row_s)
    l_ptrs = LSE + lse_off + offs_m.to(gl.int64) * sls
    row = q_row + W * WG_ROWS
    if ACC:
        lse_old = gl.load(l_ptrs)
        m_i = lse_old * LOG2E
        l_i = gl.where(lse_old == float("-inf"), 0.0, 1.0)
        mbarrier.expect(o_bar.index(W), WG_ROWS * HEAD_DIM * 4)
        tma.async_copy_global_to_shared(o_desc, [row, q_col], o_bar.index(W), o_bufs.index(W))
        tma.async_copy_global_to_shared(o_desc1, [row, q_col + D0], o_bar.index(W), o_bufs1.index(W))
        mbarrier.wait(o_bar.index(W), 0)
        acc0 = o_bufs.index(W).load(o_layout0)
        acc1 = o_bufs1.index(W).load(o_layout1)
        acc0 = gl.where(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout0))[:, None] > 0, acc0, 0.0)
        acc1 = gl.where(gl.convert_layout(l_i, gl.SliceLayout(1, o_layout1))[:, None] > 0, acc1, 0.0)
    else:
        m_i = gl.full([WG_ROWS], float("-inf"), gl.float32, row_s)
        l_i = gl.zeros([WG_ROWS], gl.float32, row_s)
        acc0 = gl.zeros([WG_ROWS, D0], gl.float32, o_layout0)
        acc1 = gl.zeros([WG_ROWS, D1], gl.float32, o_layout1)
    s_zero = gl.zeros([WG_ROWS, BLOCK], gl.float32, s_layout)
    cols = gl.arange(0, BLOCK, layout=col_s)

    mbarrier.wait(q_bar.index(W), 0)
    mbarrier.wait(k_ready.index(0), 0)
    s_tok = _pieces_qk(q0, q1, k_bufs.index(0), k_bufs1.index(0), s_zero)
    s_cur = warpgroup_mma_wait(0, deps=(s_tok, ))
    mbarrier.arrive(k_empty.index(0), count=1)

    # every tile but the last is fully visible (the last holds the causal/strict diagonal)
    for j in range(n_kv - 1):
        st = j % STAGES
        nxt = j + 1
        nst = nxt % STAGES
        mbarrier.wait(k_ready.index(nst), (nxt // STAGES) & 1)
        s_tok = _pieces_qk(q0, q1, k_bufs.index(nst), k_bufs1.index(nst), s_zero)
        p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale, offs_m, cols, mask_lo, False, FFMA)
        mbarrier.wait(v_ready.index(st), (j // STAGES) & 1)
        t0, t1 = _pieces_pv(p.to(dtype), acc0, acc1, v_bufs.index(st), v_bufs1.index(st), alpha)
        s_cur, acc0, acc1 = warpgroup_mma_wait(0, deps=(s_tok, t0, t1))
        mbarrier.arrive(k_empty.index(nst), count=1)
        mbarrier.arrive(v_empty.index(st), count=1)

    j = n_kv - 1
    st = j % STAGES
    p, alpha, m_i, l_i = _softmax_step(s_cur, m_i, l_i, qk_scale, offs_m, j * BLOCK + cols, mask_lo, True, FFMA)
    mbarrier.wait(v_ready.index(st), (j // STAGES) & 1)
    t0, t1 = _pieces_pv(p.to(dtype), acc0, acc1, v_bufs.index(st), v_bufs1.index(st), alpha)
    acc0, acc1 = warpgroup_mma_wait(0, deps=(t0, t1))
    mbarrier.arrive(v_empty.index(st), count=1)

    seen = l_i > 0
    l_safe = gl.where(seen, l_i, 1.0)
    gl.store(l_ptrs, gl.where(seen, (m_i + gl.log2(l_safe)) / LOG2E, float("-inf")))
    out0 = acc0 / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout0))[:, None]
    out1 = acc1 / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout1))[:, None]
    if ACC:
        o_bufs.index(W).store(out0)
        o_bufs1.index(W).store(out1)
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [row, q_col], o_bufs.index(W))
        tma.async_copy_shared_to_global(o_desc1, [row, q_col + D0], o_bufs1.index(W))
    else:
        q0.store(out0.to(dtype))
        q1.store(out1.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [row, q_col], q0)
        tma.async_copy_shared_to_global(o_desc1, [row, q_col + D0], q1)
    tma.store_wait(0)


@gluon.jit
def _ws_compute0(descs, bufs, bars, scal, LSE, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 ACC: gl.constexpr, FFMA: gl.constexpr):
    if HEAD_DIM > 128:
        _ws_wide(descs, bufs, bars, scal, LSE, 0, HEAD_DIM, BLOCK_N, STAGES, ACC, FFMA)
    elif len(descs) > 4:
        _ws_pieces(descs, bufs, bars, scal, LSE, 0, HEAD_DIM, STAGES, ACC, FFMA)
    else:
        _ws_compute(descs, bufs, bars, scal, LSE, 0, HEAD_DIM, STAGES, ACC, FFMA)


@gluon.jit
def _ws_compute1(descs, bufs, bars, scal, LSE, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                 ACC: gl.constexpr, FFMA: gl.constexpr):
    if HEAD_DIM > 128:
        _ws_wide(descs, bufs, bars, scal, LSE, 1, HEAD_DIM, BLOCK_N, STAGES, ACC, FFMA)
    elif len(descs) > 4:
        _ws_pieces(descs, bufs, bars, scal, LSE, 1, HEAD_DIM, STAGES, ACC, FFMA)
    else:
        _ws_compute(descs, bufs, bars, scal, LSE, 1, HEAD_DIM, STAGES, ACC, FFMA)


@gluon.jit(do_not_specialize=["Sq", "Sk", "H", "GROUP", "mask_lo", "diag", "slb", "slh", "sls"])
def fwd_kernel(q_desc, k_desc, v_desc, o_desc, LSE, Sq, Sk, H, GROUP, qk_scale, mask_lo, diag, slb, slh, sls,
               q_desc1, k_desc1, v_desc1, o_desc1, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, ACC: gl.constexpr,
               LOAD_REGS: gl.constexpr, FFMA: gl.constexpr, num_warps: gl.constexpr):
    """One program per (128-row q tile, batch x head).  ``diag``: causal-like (Sq = Sk, kv tiles up
    to the q tile's own, the diagonal masked by ``mask_lo``: 0 causal, 1 strict); else every kv tile.
    ``ACC``: start from and write back the running float32 (O, lse) instead of a fresh output
    (``o_desc`` then reads and writes float32 rows).  ``*_desc1``: the second column pieces of a
    head dim in two (PIECES; else unused)."""
    dtype: gl.constexpr = q_desc.dtype
    pid_m = Sq // BLOCK - 1 - gl.program_id(0)  # the longest rows first
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    n_kv = gl.where(diag != 0, (pid_m + 1) * (BLOCK // BLOCK_N), Sk // BLOCK_N)
    D0: gl.constexpr = q_desc.block_shape[1]  # HEAD_DIM, or its first piece (PIECES)
    q_bufs = gl.allocate_shared_memory(dtype, [2, WG_ROWS, D0], q_desc.layout)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D0], k_desc.layout)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D0], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    o_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if ACC and HEAD_DIM <= 128 and D0 == HEAD_DIM:
        o_bufs = gl.allocate_shared_memory(gl.float32, [2, WG_ROWS, HEAD_DIM], o_desc.layout)
    else:
        o_bufs = q_bufs  # the fresh output leaves through q's buffer (and d=256's running O: _ws_wide)
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(o_bar.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # both compute warpgroups release a buffer
        mbarrier.init(v_empty.index(i), count=2)
    if D0 < HEAD_DIM:
        D1: gl.constexpr = HEAD_DIM - D0
        q_bufs1 = gl.allocate_shared_memory(dtype, [2, WG_ROWS, D1], q_desc1.layout)
        k_bufs1 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D1], k_desc1.layout)
        v_bufs1 = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D1], v_desc1.layout)
        if ACC:
            o_bufs = gl.allocate_shared_memory(gl.float32, [2, WG_ROWS, D0], o_desc.layout)
            o_bufs1 = gl.allocate_shared_memory(gl.float32, [2, WG_ROWS, D1], o_desc1.layout)
        else:
            o_bufs1 = q_bufs1
        descs = (q_desc, k_desc, v_desc, o_desc, q_desc1, k_desc1, v_desc1, o_desc1)
        bufs = (q_bufs, k_bufs, v_bufs, o_bufs, q_bufs1, k_bufs1, v_bufs1, o_bufs1)
    else:
        descs = (q_desc, k_desc, v_desc, o_desc)
        bufs = (q_bufs, k_bufs, v_bufs, o_bufs)
    bars = (q_bar, k_ready, k_empty, v_ready, v_empty, o_bar)
    scal = (b * Sq + pid_m * BLOCK, b * Sk, h * HEAD_DIM, (h // GROUP) * HEAD_DIM, n_kv, pid_m * BLOCK, mask_lo,
            qk_scale, b.to(gl.int64) * slb + h * slh, sls)
    gl.warp_specialize([
        (_ws_compute0, (descs, bufs, bars, scal, LSE, HEAD_DIM, BLOCK_N, STAGES, ACC, FFMA)),
        (_ws_compute1, (descs, bufs, bars, scal, LSE, HEAD_DIM, BLOCK_N, STAGES, ACC, FFMA)),
        (_ws_loader, (descs, bufs, bars, scal, LSE, HEAD_DIM, BLOCK_N, STAGES, ACC, FFMA)),
    ], [4, 1], [240, LOAD_REGS])


BIG = 1 << 30  # "no bound" for mask_lo


def _launch(q, k, v, scale, mask_lo, diag, out, lse, acc: bool):
    """``acc``: ``out`` is the running float32 O, read and written in place; else the fresh output
    in q's dtype."""
    B, Sq, H, D = q.shape
    d0, d1 = PIECES.get(D, (D, 0))
    q_desc = row_desc(q, (WG_ROWS.value, d0))
    # d=256's running O passes a 128-column half at a time (_ws_wide)
    o_desc = row_desc(out, (WG_ROWS.value, d0 if not acc or D <= 128 else D // 2))
    k_desc, v_desc = (row_desc(x, (KV_ROWS[D], d0)) for x in (k, v))
    # the second column pieces (PIECES), else the first again (unused)
    second = [row_desc(x, (rows, d1)) for x, rows in ((q, WG_ROWS.value), (k, KV_ROWS[D]), (v, KV_ROWS[D]),
                                                   (out, WG_ROWS.value))] if d1 else [q_desc, k_desc, v_desc, o_desc]
    grid = (Sq // BLOCK.value, B * H)
    fwd_kernel[grid](q_desc, k_desc, v_desc, o_desc, lse, Sq, k.shape[1], H, H // k.shape[2], scale * LOG2E.value,
                     mask_lo, int(diag), *lse.stride(), *second, HEAD_DIM=D, BLOCK_N=KV_ROWS[D], STAGES=STAGES[D], ACC=acc,
                     LOAD_REGS=LOADER_REGS, FFMA=scale > 0, num_warps=4, maxnreg=WS_MAXNREG)


def forward(q, k, v, scale: float, causal: bool):
    """(out (B, S, H, D) in q's dtype, lse (B, H, S) float32) of softmax(q k^T * scale) v, causal
    (query i sees keys j <= i) or full; the tensors must pass :func:`supported`."""
    B, S, H, D = q.shape
    out = torch.empty(B, S, H, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, S, dtype=torch.float32, device=q.device)
    _launch(q, k, v, scale, 0 if causal else -BIG, causal, out, lse, acc=False)
    return out, lse


def forward_into(q, k, v, scale: float, mask_lo: int | None, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge this block into the running float32 (out, lse) in place (the ring step).
    ``mask_lo``: None for a full block, 0 causal, 1 strict (query i sees keys j < i); ``out`` is
    written through a view of its rows (see :func:`supported`), never a copy."""
    diag = mask_lo is not None
    _launch(q, k, v, scale, mask_lo if diag else -BIG, diag, out, lse, acc=True)
