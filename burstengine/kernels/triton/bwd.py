"""Triton backward for one (q block, kv block) pair from the *global* lse and D = rowsum(dO * O)
of the query rows (no O needed, so the burst backward can move D instead of O), adding into
float32 dQ, dK, dV in place.  The kernels take lse in base 2 with +inf for rows that saw nothing
(``LSE2``, made once per call by the host), so no tile pays for the conversion.

``kv_kernel``: one program per (k tile, batch x kv head) walks the q tiles of every q head of
its group (one flat loop over (head, tile), so the pipeline runs across heads), so dK and dV of
a kv head are summed in registers by one program: GQA without copies and without races.  dQ
either goes out from the same program with float32 atomic adds (``ATOMIC_DQ``, TMA reduce-add
on Hopper: 5 matmuls per tile pair), or comes from ``dq_kernel``, one program per (q tile,
batch x q head) that recomputes P and dP (7 matmuls, no atomics, deterministic).

The dK/dV loop reads LSE2 and D of each q tile through TMA descriptors too (``VEC_TMA``): as
pointer loads they were per-thread copies of every column a thread
holds, with 64-bit addresses live across the loop, which spilled registers (sm_90 build of the
64x128 tile: 255 registers and 64 bytes of stack before, no spills and a third fewer
instructions per iteration after).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (add_rows, load_rows, load_vec, q_tile_work, row_desc, store_rows, tile_work,
                           vec_desc, visible, zero_rows)


@triton.jit
def _kv_tiles(dk, dv, k, v, q_desc, do_desc, dq_desc, DQ_b, lse_h, dl_h, slh, sls, sdlh, sdls, sdqs, h0, n_heads,
              t_lo, t_hi, offs_n, Sq, Sk, scale_log2, scale, q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC,
              BMASK, bs, nbk, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
              HAS_DOC: tl.constexpr, HAS_BLOCK: tl.constexpr, USE_TMA: tl.constexpr, ATOMIC_DQ: tl.constexpr,
              WS: tl.constexpr, VEC_TMA: tl.constexpr):
    n = t_hi - t_lo
    for it in tl.range(0, n_heads * n, warp_specialize=WS):
        g = it // n
        h = h0 + g
        col = h * HEAD_DIM
        i0 = (t_lo + it - g * n) * BLOCK_M
        offs_m = i0 + tl.arange(0, BLOCK_M)
        q = load_rows(q_desc, i0, col, USE_TMA)
        do = load_rows(do_desc, i0, col, USE_TMA)
        # rows past the end read LSE2 = D = 0 through TMA (+inf / 0 by pointer): their q and dO
        # rows are zero, so they add nothing either way
        lse2 = load_vec(lse_h, h, slh, sls, i0, Sq, float("inf"), BLOCK_M, VEC_TMA)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * scale_log2 - lse2[None, :])
        if MASKED:
            vis = visible(offs_m[None, :], offs_n[:, None], Sq, Sk, q_start, q_step, k_start, k_step, lo, hi, QDOC,
                          KDOC, BMASK, bs, nbk, HAS_DOC, HAS_BLOCK)
            p_t = tl.where(vis, p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        delta = load_vec(dl_h, h, sdlh, sdls, i0, Sq, 0.0, BLOCK_M, VEC_TMA)
        ds_t = (p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk)
        if ATOMIC_DQ:
            add_rows(dq_desc, DQ_b, sdqs, i0, col, Sq, tl.dot(tl.trans(ds_t), k) * scale, BLOCK_M, HEAD_DIM, USE_TMA)
    return dk, dv


@triton.jit(do_not_specialize=["Sq", "Sk", "Hkv", "GROUP", "q_start", "q_step", "k_start", "k_step", "lo", "hi",
                               "bs", "nbk", "slb", "slh", "sls", "sdlb", "sdlh", "sdls"])
def kv_kernel(Q, K, V, DO, LSE2, DL, DQ, DK, DV,
              sqb, sqs, skb, sks, svb, svs, sdob, sdos, slb, slh, sls, sdlb, sdlh, sdls, sdqb, sdqs, sdkb, sdks,
              sdvb, sdvs, Sq, Sk, Hkv, GROUP, scale_log2, scale,
              q_start, q_step, k_start, k_step, lo, hi,
              QDOC, KDOC, BOUNDS, BMASK, bs, nbk, CNT, IDX, FULL,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOC: tl.constexpr,
              HAS_BLOCK: tl.constexpr, USE_TMA: tl.constexpr, ATOMIC_DQ: tl.constexpr, WS: tl.constexpr,
              VEC_TMA: tl.constexpr, FRESH: tl.constexpr):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    hk = bh % Hkv
    j0 = pid_n * BLOCK_N
    n_qt = tl.cdiv(Sq, BLOCK_M)
    a, c, d, e, n_list, todo = tile_work(pid_n, Sk, k_start, k_step, lo, hi, q_start, q_step, Sq, BOUNDS, CNT,
                                         BLOCK_N, BLOCK_M, HAS_DOC, HAS_BLOCK)
    if todo:
        b64 = b.to(tl.int64)
        H = Hkv * GROUP
        kv_col = hk * HEAD_DIM
        h0 = hk * GROUP
        offs_n = j0 + tl.arange(0, BLOCK_N)
        k_desc = row_desc(K + b64 * skb, Sk, sks, Hkv * HEAD_DIM, BLOCK_N, HEAD_DIM, USE_TMA)
        v_desc = row_desc(V + b64 * svb, Sk, svs, Hkv * HEAD_DIM, BLOCK_N, HEAD_DIM, USE_TMA)
        q_desc = row_desc(Q + b64 * sqb, Sq, sqs, H * HEAD_DIM, BLOCK_M, HEAD_DIM, USE_TMA)
        do_desc = row_desc(DO + b64 * sdob, Sq, sdos, H * HEAD_DIM, BLOCK_M, HEAD_DIM, USE_TMA)
        DQ_b = DQ + b64 * sdqb
        if ATOMIC_DQ:
            dq_desc = row_desc(DQ_b, Sq, sdqs, H * HEAD_DIM, BLOCK_M, HEAD_DIM, USE_TMA)
        else:
            dq_desc = None
        lse_h = vec_desc(LSE2 + b64 * slb, H, Sq, slh, BLOCK_M, VEC_TMA)
        dl_h = vec_desc(DL + b64 * sdlb, H, Sq, sdlh, BLOCK_M, VEC_TMA)
        k = load_rows(k_desc, j0, kv_col, USE_TMA)
        v = load_rows(v_desc, j0, kv_col, USE_TMA)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        if HAS_BLOCK:
            for i in range(n_list):
                t = tl.load(IDX + pid_n * n_qt + i)
                if tl.load(FULL + pid_n * n_qt + i) != 0:
                    dk, dv = _kv_tiles(dk, dv, k, v, q_desc, do_desc, dq_desc, DQ_b, lse_h, dl_h, slh, sls, sdlh, sdls,
                                       sdqs, h0, GROUP, t, t + 1, offs_n, Sq, Sk, scale_log2, scale, q_start, q_step,
                                       k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk, BLOCK_M, HEAD_DIM, False,
                                       HAS_DOC, HAS_BLOCK, USE_TMA, ATOMIC_DQ, False, VEC_TMA)
                else:
                    dk, dv = _kv_tiles(dk, dv, k, v, q_desc, do_desc, dq_desc, DQ_b, lse_h, dl_h, slh, sls, sdlh, sdls,
                                       sdqs, h0, GROUP, t, t + 1, offs_n, Sq, Sk, scale_log2, scale, q_start, q_step,
                                       k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk, BLOCK_M, HEAD_DIM, True,
                                       HAS_DOC, HAS_BLOCK, USE_TMA, ATOMIC_DQ, False, VEC_TMA)
        else:
            dk, dv = _kv_tiles(dk, dv, k, v, q_desc, do_desc, dq_desc, DQ_b, lse_h, dl_h, slh, sls, sdlh, sdls, sdqs,
                               h0, GROUP, a, c, offs_n, Sq, Sk, scale_log2, scale, q_start, q_step, k_start, k_step,
                               lo, hi, QDOC, KDOC, BMASK, bs, nbk, BLOCK_M, HEAD_DIM, True, HAS_DOC, HAS_BLOCK,
                               USE_TMA, ATOMIC_DQ, False, VEC_TMA)
            dk, dv = _kv_tiles(dk, dv, k, v, q_desc, do_desc, dq_desc, DQ_b, lse_h, dl_h, slh, sls, sdlh, sdls, sdqs,
                               h0, GROUP, c, d, offs_n, Sq, Sk, scale_log2, scale, q_start, q_step, k_start, k_step,
                               lo, hi, QDOC, KDOC, BMASK, bs, nbk, BLOCK_M, HEAD_DIM, False, HAS_DOC, HAS_BLOCK,
                               USE_TMA, ATOMIC_DQ, WS, VEC_TMA)
            dk, dv = _kv_tiles(dk, dv, k, v, q_desc, do_desc, dq_desc, DQ_b, lse_h, dl_h, slh, sls, sdlh, sdls, sdqs,
                               h0, GROUP, d, e, offs_n, Sq, Sk, scale_log2, scale, q_start, q_step, k_start, k_step,
                               lo, hi, QDOC, KDOC, BMASK, bs, nbk, BLOCK_M, HEAD_DIM, True, HAS_DOC, HAS_BLOCK,
                               USE_TMA, ATOMIC_DQ, False, VEC_TMA)
        dk_desc = row_desc(DK + b64 * sdkb, Sk, sdks, Hkv * HEAD_DIM, BLOCK_N, HEAD_DIM, USE_TMA)
        dv_desc = row_desc(DV + b64 * sdvb, Sk, sdvs, Hkv * HEAD_DIM, BLOCK_N, HEAD_DIM, USE_TMA)
        dk = dk * scale
        if not FRESH:
            dk += load_rows(dk_desc, j0, kv_col, USE_TMA).to(tl.float32)
            dv += load_rows(dv_desc, j0, kv_col, USE_TMA).to(tl.float32)
        store_rows(dk_desc, j0, kv_col, dk.to(DK.dtype.element_ty), USE_TMA)
        store_rows(dv_desc, j0, kv_col, dv.to(DV.dtype.element_ty), USE_TMA)
    elif FRESH:
        b64 = b.to(tl.int64)
        zero_rows(DK + b64 * sdkb, sdks, Sk, j0, hk * HEAD_DIM, Hkv * HEAD_DIM, BLOCK_N, HEAD_DIM, USE_TMA)
        zero_rows(DV + b64 * sdvb, sdvs, Sk, j0, hk * HEAD_DIM, Hkv * HEAD_DIM, BLOCK_N, HEAD_DIM, USE_TMA)



@triton.jit
def _q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, kv_col, t_lo, t_hi, offs_m, Sq, Sk, scale_log2,
             q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk,
             BLOCK_N: tl.constexpr, MASKED: tl.constexpr, HAS_DOC: tl.constexpr, HAS_BLOCK: tl.constexpr,
             USE_TMA: tl.constexpr, WS: tl.constexpr):
    for t in tl.range(t_lo, t_hi, warp_specialize=WS):
        j0 = t * BLOCK_N
        k = load_rows(k_desc, j0, kv_col, USE_TMA)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * scale_log2 - lse2[:, None])
        if MASKED:
            kj = j0 + tl.arange(0, BLOCK_N)
            vis = visible(offs_m[:, None], kj[None, :], Sq, Sk, q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC,
                          BMASK, bs, nbk, HAS_DOC, HAS_BLOCK)
            p = tl.where(vis, p, 0.0)
        ds = p * (tl.dot(do, tl.trans(load_rows(v_desc, j0, kv_col, USE_TMA))) - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit(do_not_specialize=["Sq", "Sk", "H", "GROUP", "q_start", "q_step", "k_start", "k_step", "lo", "hi", "bs",
                               "nbk", "reverse", "slb", "slh", "sls", "sdlb", "sdlh", "sdls"])
def dq_kernel(Q, K, V, DO, LSE2, DL, DQ,
              sqb, sqs, skb, sks, svb, svs, sdob, sdos, slb, slh, sls, sdlb, sdlh, sdls, sdqb, sdqs,
              Sq, Sk, H, GROUP, scale_log2, scale,
              q_start, q_step, k_start, k_step, lo, hi,
              QDOC, KDOC, BOUNDS, BMASK, bs, nbk, CNT, IDX, FULL, reverse,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOC: tl.constexpr,
              HAS_BLOCK: tl.constexpr, USE_TMA: tl.constexpr, WS: tl.constexpr, FRESH: tl.constexpr):
    pid_m, b, h, i0, a, c, d, e, n_list, todo = q_tile_work(Sq, Sk, H, q_start, q_step, k_start, k_step, lo, hi,
                                                            BOUNDS, CNT, reverse, BLOCK_M, BLOCK_N, HAS_DOC,
                                                            HAS_BLOCK)
    n_kt = tl.cdiv(Sk, BLOCK_N)
    if todo:
        b64 = b.to(tl.int64)
        q_col = h * HEAD_DIM
        kv_col = (h // GROUP) * HEAD_DIM
        Hkv = H // GROUP
        offs_m = i0 + tl.arange(0, BLOCK_M)
        row_ok = offs_m < Sq
        k_desc = row_desc(K + b64 * skb, Sk, sks, Hkv * HEAD_DIM, BLOCK_N, HEAD_DIM, USE_TMA)
        v_desc = row_desc(V + b64 * svb, Sk, svs, Hkv * HEAD_DIM, BLOCK_N, HEAD_DIM, USE_TMA)
        q = load_rows(row_desc(Q + b64 * sqb, Sq, sqs, H * HEAD_DIM, BLOCK_M, HEAD_DIM, USE_TMA), i0, q_col, USE_TMA)
        do = load_rows(row_desc(DO + b64 * sdob, Sq, sdos, H * HEAD_DIM, BLOCK_M, HEAD_DIM, USE_TMA), i0, q_col,
                       USE_TMA)
        lse2 = tl.load(LSE2 + b64 * slb + h * slh + offs_m * sls, mask=row_ok, other=float("inf"))
        delta = tl.load(DL + b64 * sdlb + h * sdlh + offs_m * sdls, mask=row_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if HAS_BLOCK:
            for i in range(n_list):
                t = tl.load(IDX + pid_m * n_kt + i)
                if tl.load(FULL + pid_m * n_kt + i) != 0:
                    dq = _q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, kv_col, t, t + 1, offs_m, Sq, Sk,
                                  scale_log2, q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk,
                                  BLOCK_N, False, HAS_DOC, HAS_BLOCK, USE_TMA, False)
                else:
                    dq = _q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, kv_col, t, t + 1, offs_m, Sq, Sk,
                                  scale_log2, q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk,
                                  BLOCK_N, True, HAS_DOC, HAS_BLOCK, USE_TMA, False)
        else:
            dq = _q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, kv_col, a, c, offs_m, Sq, Sk, scale_log2, q_start,
                          q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk, BLOCK_N, True, HAS_DOC,
                          HAS_BLOCK, USE_TMA, False)
            dq = _q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, kv_col, c, d, offs_m, Sq, Sk, scale_log2, q_start,
                          q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk, BLOCK_N, False, HAS_DOC,
                          HAS_BLOCK, USE_TMA, WS)
            dq = _q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, kv_col, d, e, offs_m, Sq, Sk, scale_log2, q_start,
                          q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk, BLOCK_N, True, HAS_DOC,
                          HAS_BLOCK, USE_TMA, False)
        dq_desc = row_desc(DQ + b64 * sdqb, Sq, sdqs, H * HEAD_DIM, BLOCK_M, HEAD_DIM, USE_TMA)
        dq = dq * scale
        if not FRESH:
            dq += load_rows(dq_desc, i0, q_col, USE_TMA).to(tl.float32)
        store_rows(dq_desc, i0, q_col, dq.to(DQ.dtype.element_ty), USE_TMA)
    elif FRESH:
        zero_rows(DQ + b.to(tl.int64) * sdqb, sdqs, Sq, i0, h * HEAD_DIM, H * HEAD_DIM, BLOCK_M, HEAD_DIM, USE_TMA)


@triton.jit(do_not_specialize=["S", "H", "sdlb", "sdlh"])
def delta_kernel(O, DO, DL, sob, sos, sdob, sdos, sdlb, sdlh, S, H, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """D = rowsum(dO * O) in float32 for BLOCK rows of one (batch, head): one pass over both."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    b = (tl.program_id(1) // H).to(tl.int64)
    h = tl.program_id(1) % H
    cols = h * HEAD_DIM + tl.arange(0, HEAD_DIM)
    ok = rows[:, None] < S
    o = tl.load(O + b * sob + rows[:, None].to(tl.int64) * sos + cols[None, :], mask=ok, other=0.0)
    do = tl.load(DO + b * sdob + rows[:, None].to(tl.int64) * sdos + cols[None, :], mask=ok, other=0.0)
    tl.store(DL + b * sdlb + h * sdlh + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < S)
