"""Triton backward for one (q block, kv block) pair from the *global* lse and D = rowsum(dO * O)
of the query rows (no O needed, so the burst backward can move D instead of O), adding into
float32 dQ, dK, dV in place.

``kv_kernel``: one program per (k tile, batch x kv head) walks the q tiles of every q head of
its group, so dK and dV of a kv head are summed in registers by one program (GQA without
copies and without races).  dQ either goes out from the same program with float32 atomic adds
(``ATOMIC_DQ``: 5 matmuls per tile pair), or comes from ``dq_kernel``, one program per
(q tile, batch x q head) that recomputes P and dP (7 matmuls, no atomics, deterministic).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_tiles import LOG2E, load_rows, row_desc, tile_ranges, visible


@triton.jit
def _kv_tiles(dk, dv, k, v, q_desc, do_desc, q_base, do_base, lse_base, dl_base, dq_base, sqs, sdos, sls, sdls, sdqs,
              t_lo, t_hi, offs_n, Sq, Sk, scale_log2, scale, q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC,
              BMASK, bs, nbk, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr,
              HAS_DOC: tl.constexpr, HAS_BLOCK: tl.constexpr, USE_TMA: tl.constexpr, ATOMIC_DQ: tl.constexpr,
              WS: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HEAD_DIM)
    for t in tl.range(t_lo, t_hi, warp_specialize=WS):
        i0 = t * BLOCK_M
        offs_m = i0 + rows
        q = load_rows(q_desc, q_base, i0, Sq, sqs, BLOCK_M, HEAD_DIM, USE_TMA)
        lse = tl.load(lse_base + offs_m * sls, mask=offs_m < Sq, other=float("inf"))
        # rows that saw nothing anywhere (lse = -inf) get P = 0, not exp(+inf)
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * scale_log2 - lse2[None, :])
        if MASKED:
            vis = visible(offs_m[None, :], offs_n[:, None], Sq, Sk, q_start, q_step, k_start, k_step, lo, hi, QDOC,
                          KDOC, BMASK, bs, nbk, HAS_DOC, HAS_BLOCK)
            p_t = tl.where(vis, p_t, 0.0)
        do = load_rows(do_desc, do_base, i0, Sq, sdos, BLOCK_M, HEAD_DIM, USE_TMA)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        delta = tl.load(dl_base + offs_m * sdls, mask=offs_m < Sq, other=0.0)
        ds_t = p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])
        ds_t = ds_t.to(q.dtype)
        dk = tl.dot(ds_t, q, dk)
        if ATOMIC_DQ:
            dq = tl.dot(tl.trans(ds_t), k) * scale
            ptr = dq_base + i0.to(tl.int64) * sdqs + (rows[:, None] * sdqs + cols[None, :])
            tl.atomic_add(ptr, dq, mask=(offs_m < Sq)[:, None], sem="relaxed")
    return dk, dv


@triton.jit
def kv_kernel(Q, K, V, DO, LSE, DL, DQ, DK, DV,
              sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, slb, slh, sls, sdlb, sdlh, sdls,
              sdqb, sdqs, sdqh, sdkb, sdks, sdkh, sdvb, sdvs, sdvh,
              Sq, Sk, Hkv, GROUP, scale_log2, scale,
              q_start, q_step, k_start, k_step, lo, hi,
              QDOC, KDOC, BOUNDS, BMASK, bs, nbk, CNT, IDX, FULL,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOC: tl.constexpr,
              HAS_BLOCK: tl.constexpr, USE_TMA: tl.constexpr, ATOMIC_DQ: tl.constexpr, WS: tl.constexpr):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    hk = bh % Hkv
    j0 = pid_n * BLOCK_N
    n_qt = tl.cdiv(Sq, BLOCK_M)
    if HAS_BLOCK:
        a = 0
        c = 0
        d = 0
        e = 0
        n_list = tl.load(CNT + pid_n)
        todo = n_list > 0
    else:
        k_lo = k_start + j0 * k_step
        k_hi = k_start + (tl.minimum(j0 + BLOCK_N, Sk) - 1) * k_step
        a, c, d, e = tile_ranges(k_lo, k_hi, lo, hi, q_start, q_step, Sq, BOUNDS, pid_n, BLOCK_M, HAS_DOC)
        n_list = 0
        todo = a < e
    if todo:
        b64 = b.to(tl.int64)
        rows = tl.arange(0, BLOCK_N)
        offs_n = j0 + rows
        cols = tl.arange(0, HEAD_DIM)
        k_base = K + b64 * skb + hk * skh
        v_base = V + b64 * svb + hk * svh
        k = load_rows(row_desc(k_base, Sk, sks, BLOCK_N, HEAD_DIM, USE_TMA), k_base, j0, Sk, sks, BLOCK_N, HEAD_DIM,
                      USE_TMA)
        v = load_rows(row_desc(v_base, Sk, svs, BLOCK_N, HEAD_DIM, USE_TMA), v_base, j0, Sk, svs, BLOCK_N, HEAD_DIM,
                      USE_TMA)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
        for g in range(GROUP):
            h = hk * GROUP + g
            q_base = Q + b64 * sqb + h * sqh
            do_base = DO + b64 * sdob + h * sdoh
            lse_base = LSE + b64 * slb + h * slh
            dl_base = DL + b64 * sdlb + h * sdlh
            dq_base = DQ + b64 * sdqb + h * sdqh
            q_desc = row_desc(q_base, Sq, sqs, BLOCK_M, HEAD_DIM, USE_TMA)
            do_desc = row_desc(do_base, Sq, sdos, BLOCK_M, HEAD_DIM, USE_TMA)
            if HAS_BLOCK:
                for i in range(n_list):
                    t = tl.load(IDX + pid_n * n_qt + i)
                    if tl.load(FULL + pid_n * n_qt + i) != 0:
                        dk, dv = _kv_tiles(dk, dv, k, v, q_desc, do_desc, q_base, do_base, lse_base, dl_base, dq_base,
                                           sqs, sdos, sls, sdls, sdqs, t, t + 1, offs_n, Sq, Sk, scale_log2, scale,
                                           q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk,
                                           BLOCK_M, HEAD_DIM, False, HAS_DOC, HAS_BLOCK, USE_TMA, ATOMIC_DQ, False)
                    else:
                        dk, dv = _kv_tiles(dk, dv, k, v, q_desc, do_desc, q_base, do_base, lse_base, dl_base, dq_base,
                                           sqs, sdos, sls, sdls, sdqs, t, t + 1, offs_n, Sq, Sk, scale_log2, scale,
                                           q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk,
                                           BLOCK_M, HEAD_DIM, True, HAS_DOC, HAS_BLOCK, USE_TMA, ATOMIC_DQ, False)
            else:
                dk, dv = _kv_tiles(dk, dv, k, v, q_desc, do_desc, q_base, do_base, lse_base, dl_base, dq_base, sqs,
                                   sdos, sls, sdls, sdqs, a, c, offs_n, Sq, Sk, scale_log2, scale, q_start, q_step,
                                   k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk, BLOCK_M, HEAD_DIM, True,
                                   HAS_DOC, HAS_BLOCK, USE_TMA, ATOMIC_DQ, False)
                dk, dv = _kv_tiles(dk, dv, k, v, q_desc, do_desc, q_base, do_base, lse_base, dl_base, dq_base, sqs,
                                   sdos, sls, sdls, sdqs, c, d, offs_n, Sq, Sk, scale_log2, scale, q_start, q_step,
                                   k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk, BLOCK_M, HEAD_DIM, False,
                                   HAS_DOC, HAS_BLOCK, USE_TMA, ATOMIC_DQ, WS)
                dk, dv = _kv_tiles(dk, dv, k, v, q_desc, do_desc, q_base, do_base, lse_base, dl_base, dq_base, sqs,
                                   sdos, sls, sdls, sdqs, d, e, offs_n, Sq, Sk, scale_log2, scale, q_start, q_step,
                                   k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk, BLOCK_M, HEAD_DIM, True,
                                   HAS_DOC, HAS_BLOCK, USE_TMA, ATOMIC_DQ, False)
        ok = (offs_n < Sk)[:, None]
        dk_ptrs = DK + b64 * sdkb + hk * sdkh + j0.to(tl.int64) * sdks + (rows[:, None] * sdks + cols[None, :])
        dv_ptrs = DV + b64 * sdvb + hk * sdvh + j0.to(tl.int64) * sdvs + (rows[:, None] * sdvs + cols[None, :])
        dk_old = tl.load(dk_ptrs, mask=ok, other=0.0).to(tl.float32)
        tl.store(dk_ptrs, (dk_old + dk * scale).to(DK.dtype.element_ty), mask=ok)
        dv_old = tl.load(dv_ptrs, mask=ok, other=0.0).to(tl.float32)
        tl.store(dv_ptrs, (dv_old + dv).to(DV.dtype.element_ty), mask=ok)


@triton.jit
def _q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, k_base, v_base, sks, svs, t_lo, t_hi, offs_m, Sq, Sk,
             scale_log2, q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk,
             BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, HAS_DOC: tl.constexpr,
             HAS_BLOCK: tl.constexpr, USE_TMA: tl.constexpr, WS: tl.constexpr):
    for t in tl.range(t_lo, t_hi, warp_specialize=WS):
        j0 = t * BLOCK_N
        k = load_rows(k_desc, k_base, j0, Sk, sks, BLOCK_N, HEAD_DIM, USE_TMA)
        p = tl.math.exp2(tl.dot(q, tl.trans(k)) * scale_log2 - lse2[:, None])
        if MASKED:
            kj = j0 + tl.arange(0, BLOCK_N)
            vis = visible(offs_m[:, None], kj[None, :], Sq, Sk, q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC,
                          BMASK, bs, nbk, HAS_DOC, HAS_BLOCK)
            p = tl.where(vis, p, 0.0)
        v = load_rows(v_desc, v_base, j0, Sk, svs, BLOCK_N, HEAD_DIM, USE_TMA)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def dq_kernel(Q, K, V, DO, LSE, DL, DQ,
              sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sdob, sdos, sdoh, slb, slh, sls, sdlb, sdlh, sdls,
              sdqb, sdqs, sdqh,
              Sq, Sk, H, GROUP, scale_log2, scale,
              q_start, q_step, k_start, k_step, lo, hi,
              QDOC, KDOC, BOUNDS, BMASK, bs, nbk, CNT, IDX, FULL, reverse,
              HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOC: tl.constexpr,
              HAS_BLOCK: tl.constexpr, USE_TMA: tl.constexpr, WS: tl.constexpr):
    n_qt = tl.cdiv(Sq, BLOCK_M)
    pid_m = tl.program_id(0)
    if reverse:
        pid_m = n_qt - 1 - pid_m
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // GROUP
    i0 = pid_m * BLOCK_M
    n_kt = tl.cdiv(Sk, BLOCK_N)
    if HAS_BLOCK:
        a = 0
        c = 0
        d = 0
        e = 0
        n_list = tl.load(CNT + pid_m)
        todo = n_list > 0
    else:
        q_lo = q_start + i0 * q_step
        q_hi = q_start + (tl.minimum(i0 + BLOCK_M, Sq) - 1) * q_step
        a, c, d, e = tile_ranges(q_lo, q_hi, -hi, -lo, k_start, k_step, Sk, BOUNDS, pid_m, BLOCK_N, HAS_DOC)
        n_list = 0
        todo = a < e
    if todo:
        b64 = b.to(tl.int64)
        rows = tl.arange(0, BLOCK_M)
        offs_m = i0 + rows
        cols = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < Sq
        q_base = Q + b64 * sqb + h * sqh
        do_base = DO + b64 * sdob + h * sdoh
        k_base = K + b64 * skb + hk * skh
        v_base = V + b64 * svb + hk * svh
        k_desc = row_desc(k_base, Sk, sks, BLOCK_N, HEAD_DIM, USE_TMA)
        v_desc = row_desc(v_base, Sk, svs, BLOCK_N, HEAD_DIM, USE_TMA)
        q = load_rows(row_desc(q_base, Sq, sqs, BLOCK_M, HEAD_DIM, USE_TMA), q_base, i0, Sq, sqs, BLOCK_M, HEAD_DIM,
                      USE_TMA)
        do = load_rows(row_desc(do_base, Sq, sdos, BLOCK_M, HEAD_DIM, USE_TMA), do_base, i0, Sq, sdos, BLOCK_M,
                       HEAD_DIM, USE_TMA)
        lse = tl.load(LSE + b64 * slb + h * slh + offs_m * sls, mask=row_ok, other=float("inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
        delta = tl.load(DL + b64 * sdlb + h * sdlh + offs_m * sdls, mask=row_ok, other=0.0)
        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        if HAS_BLOCK:
            for i in range(n_list):
                t = tl.load(IDX + pid_m * n_kt + i)
                if tl.load(FULL + pid_m * n_kt + i) != 0:
                    dq = _q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, k_base, v_base, sks, svs, t, t + 1, offs_m,
                                  Sq, Sk, scale_log2, q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs,
                                  nbk, BLOCK_N, HEAD_DIM, False, HAS_DOC, HAS_BLOCK, USE_TMA, False)
                else:
                    dq = _q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, k_base, v_base, sks, svs, t, t + 1, offs_m,
                                  Sq, Sk, scale_log2, q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs,
                                  nbk, BLOCK_N, HEAD_DIM, True, HAS_DOC, HAS_BLOCK, USE_TMA, False)
        else:
            dq = _q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, k_base, v_base, sks, svs, a, c, offs_m, Sq, Sk,
                          scale_log2, q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk, BLOCK_N,
                          HEAD_DIM, True, HAS_DOC, HAS_BLOCK, USE_TMA, False)
            dq = _q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, k_base, v_base, sks, svs, c, d, offs_m, Sq, Sk,
                          scale_log2, q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk, BLOCK_N,
                          HEAD_DIM, False, HAS_DOC, HAS_BLOCK, USE_TMA, WS)
            dq = _q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, k_base, v_base, sks, svs, d, e, offs_m, Sq, Sk,
                          scale_log2, q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk, BLOCK_N,
                          HEAD_DIM, True, HAS_DOC, HAS_BLOCK, USE_TMA, False)
        dq_ptrs = DQ + b64 * sdqb + h * sdqh + i0.to(tl.int64) * sdqs + (rows[:, None] * sdqs + cols[None, :])
        old = tl.load(dq_ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
        tl.store(dq_ptrs, (old + dq * scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])
