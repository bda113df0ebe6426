"""Triton forward for one (q block, kv block) pair that merges into the running (O, lse) in
place (DistFlashAttn's standalone_fwd): the online softmax starts from the caller's state
(m = lse, l = 1, acc = O) instead of from zero, so the ring step needs no separate merge pass.

One program per (q tile, batch x q head); GQA reads kv head h // group, no K/V copies.  Rows
that see nothing in this block keep their state; a q tile that sees nothing is not touched.
With ``FRESH`` (the plain forward) the state is known to be empty: O and lse are not read,
and q tiles that see nothing write O = 0, lse = -inf, so the caller need not fill them first.

With ``FP8`` (kernels/fp8.py) Q and K arrive in float8 e4m3 with one scale per block of ``QB``
rows and head, and V transposed, (Hkv * D, keys) per batch, because Hopper's FP8 wgmma reads its B
operand K-major.  The scales cost no work per element: Q's and K's go into the scalar that
scales a tile's scores, and V's block scale (as log2 of its ratio to the head's largest, times
256) into the exponent's offset, so P is stored already multiplied by it (at most 256, in e4m3's
range, and small probabilities stay out of its subnormals); the row sums take it back out once
per row, and the head's largest scale / 256 multiplies O at the end.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .tiles import LOG2E, load_rows, q_tile_work, row_desc, store_rows, visible, zero_rows


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, kv_col, t_lo, t_hi, offs_m, Sq, Sk, scale_log2,
               q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk, KS, VOFF,
               BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_DOC: tl.constexpr, HAS_BLOCK: tl.constexpr,
               USE_TMA: tl.constexpr, WS: tl.constexpr, FP8: tl.constexpr, QB: tl.constexpr):
    for t in tl.range(t_lo, t_hi, warp_specialize=WS):
        j0 = t * BLOCK_N
        qk = tl.dot(q, tl.trans(load_rows(k_desc, j0, kv_col, USE_TMA)))
        if FP8:
            # this tile's K scale into the scores' factor; V's block offset (log2) into the exponent
            sc = scale_log2 * tl.load(KS + j0 // QB)
            c_j = tl.load(VOFF + j0 // QB)
        else:
            sc = scale_log2
            c_j = 0.0
        if MASKED:
            kj = j0 + tl.arange(0, BLOCK_N)
            vis = visible(offs_m[:, None], kj[None, :], Sq, Sk, q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC,
                          BMASK, bs, nbk, HAS_DOC, HAS_BLOCK)
            qk = tl.where(vis, qk * sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # a row with nothing visible yet keeps m = -inf; subtract 0 so p = 0, not NaN
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - (m_use - c_j)[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(qk, 1) * sc)
            m_use = m_new
            p = tl.math.exp2(qk * sc - (m_use - c_j)[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        if FP8:
            l_i = l_i * alpha + tl.sum(p, 1) * tl.math.exp2(-c_j)
            v = tl.trans(load_rows(v_desc, kv_col, j0, USE_TMA))
        else:
            l_i = l_i * alpha + tl.sum(p, 1)
            v = load_rows(v_desc, j0, kv_col, USE_TMA)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["Sq", "Sk", "H", "GROUP", "q_start", "q_step", "k_start", "k_step", "lo", "hi", "bs",
                               "nbk", "reverse", "slb", "slh", "sls", "n_qb", "n_kb", "vt_cols"])
def fwd_kernel(Q, K, V, O, LSE, sqb, sqs, skb, sks, svb, svs, sob, sos, slb, slh, sls,
               Sq, Sk, H, GROUP, scale_log2,
               q_start, q_step, k_start, k_step, lo, hi,
               QDOC, KDOC, BOUNDS, BMASK, bs, nbk, CNT, IDX, FULL, reverse,
               QS, KS, VOFF, VU, n_qb, n_kb, vt_cols,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOC: tl.constexpr,
               HAS_BLOCK: tl.constexpr, USE_TMA: tl.constexpr, WS: tl.constexpr, FRESH: tl.constexpr,
               FP8: tl.constexpr = False, QB: tl.constexpr = 128):
    pid_m, b, h, i0, a, c, d, e, n_list, todo = q_tile_work(Sq, Sk, H, q_start, q_step, k_start, k_step, lo, hi,
                                                            BOUNDS, CNT, reverse, BLOCK_M, BLOCK_N, HAS_DOC,
                                                            HAS_BLOCK)
    n_kt = tl.cdiv(Sk, BLOCK_N)
    if todo:
        b64 = b.to(tl.int64)
        q_col = h * HEAD_DIM
        kv_col = (h // GROUP) * HEAD_DIM
        Hkv = H // GROUP
        q_desc = row_desc(Q + b64 * sqb, Sq, sqs, H * HEAD_DIM, BLOCK_M, HEAD_DIM, USE_TMA)
        k_desc = row_desc(K + b64 * skb, Sk, sks, Hkv * HEAD_DIM, BLOCK_N, HEAD_DIM, USE_TMA)
        if FP8:
            # V^T: (Hkv * D, vt_cols) per batch, read as (D, BLOCK_N) tiles; its columns are padded
            # with zeros to a multiple of the largest tile, so no tile reads past them
            v_desc = row_desc(V + b64 * svb, Hkv * HEAD_DIM, svs, vt_cols, HEAD_DIM, BLOCK_N, USE_TMA)
            kvh = b64 * Hkv + h // GROUP
            KS = KS + kvh * n_kb
            VOFF = VOFF + kvh * n_kb
            u = tl.load(VU + kvh)
            scale_log2 = scale_log2 * tl.load(QS + (b64 * H + h) * n_qb + i0 // QB)
        else:
            v_desc = row_desc(V + b64 * svb, Sk, svs, Hkv * HEAD_DIM, BLOCK_N, HEAD_DIM, USE_TMA)
            u = 1.0
        o_desc = row_desc(O + b64 * sob, Sq, sos, H * HEAD_DIM, BLOCK_M, HEAD_DIM, USE_TMA)
        q = load_rows(q_desc, i0, q_col, USE_TMA)

        offs_m = i0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < Sq
        l_ptrs = LSE + b64 * slb + h * slh + offs_m * sls
        # the running state in base 2: true O = acc / l, true lse = (m + log2 l) / log2(e)
        if FRESH:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        else:
            lse_old = tl.load(l_ptrs, mask=row_ok, other=float("-inf"))
            m_i = lse_old * LOG2E
            l_i = tl.where(lse_old == float("-inf"), 0.0, 1.0)
            acc = load_rows(o_desc, i0, q_col, USE_TMA).to(tl.float32)
            if FP8:
                acc = acc / u
            acc = tl.where(l_i[:, None] > 0, acc, 0.0)

        if HAS_BLOCK:
            for i in range(n_list):
                t = tl.load(IDX + pid_m * n_kt + i)
                if tl.load(FULL + pid_m * n_kt + i) != 0:
                    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, kv_col, t, t + 1, offs_m, Sq, Sk,
                                               scale_log2, q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK,
                                               bs, nbk, KS, VOFF, BLOCK_N, False, HAS_DOC, HAS_BLOCK, USE_TMA, False,
                                               FP8, QB)
                else:
                    acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, kv_col, t, t + 1, offs_m, Sq, Sk,
                                               scale_log2, q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK,
                                               bs, nbk, KS, VOFF, BLOCK_N, True, HAS_DOC, HAS_BLOCK, USE_TMA, False,
                                               FP8, QB)
        else:
            acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, kv_col, a, c, offs_m, Sq, Sk, scale_log2,
                                       q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk, KS, VOFF,
                                       BLOCK_N, True, HAS_DOC, HAS_BLOCK, USE_TMA, False, FP8, QB)
            acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, kv_col, c, d, offs_m, Sq, Sk, scale_log2,
                                       q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk, KS, VOFF,
                                       BLOCK_N, False, HAS_DOC, HAS_BLOCK, USE_TMA, WS, FP8, QB)
            acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, k_desc, v_desc, kv_col, d, e, offs_m, Sq, Sk, scale_log2,
                                       q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk, KS, VOFF,
                                       BLOCK_N, True, HAS_DOC, HAS_BLOCK, USE_TMA, False, FP8, QB)

        seen = l_i > 0
        l_safe = tl.where(seen, l_i, 1.0)
        if FP8:
            acc = acc * (u / l_safe)[:, None]
        else:
            acc = acc / l_safe[:, None]
        store_rows(o_desc, i0, q_col, acc.to(O.dtype.element_ty), USE_TMA)
        tl.store(l_ptrs, tl.where(seen, (m_i + tl.math.log2(l_safe)) / LOG2E, float("-inf")), mask=row_ok)
    elif FRESH:
        b64 = b.to(tl.int64)
        offs_m = i0 + tl.arange(0, BLOCK_M)
        zero_rows(O + b64 * sob, sos, Sq, i0, h * HEAD_DIM, H * HEAD_DIM, BLOCK_M, HEAD_DIM, USE_TMA)
        tl.store(LSE + b64 * slb + h * slh + offs_m * sls, tl.full([BLOCK_M], float("-inf"), tl.float32),
                 mask=offs_m < Sq)
