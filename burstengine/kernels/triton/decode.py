"""Triton flash-decoding: one query token per sequence against a KV cache read in place.

``decode_attention(q (B, H, D), k, v (B, Hkv, capacity, D), scale, valid (B,))`` returns
float32 (out (B, H, D), lse (B, H)) of each query over the slots its sequence sees: slot j of
sequence b counts when ``j < valid[b]``, and, when given, ``visible[b, j]`` and
``qpos[b] - kpos[b, j] < window`` (a sliding window).  A query that sees no slot gets out = 0,
lse = -inf (the contract of ``inference.kvcache.shard_attention``).

Two kernels.  The first splits every sequence's capacity into a fixed number of chunks (from
the capacity and the SM count, so the grid depends on no value that changes between decode
steps) and runs one program per (chunk, sequence, kv head): it reads its chunk of K and V once
for the ``g = H / Hkv`` query heads sharing that kv head (GQA: the g query rows are one tile,
padded to the 16 rows a tensor-core dot needs) and writes a partial output and its base-2
log-sum-exp; a chunk past ``valid[b]`` reads nothing.  The second merges the partials of each
(sequence, query head) exactly, the online-softmax merge of the ring.  Every value a call reads
lives in a device tensor (the valid counts, the visibility, the positions), so a step that
moves them forward in place replays one captured CUDA graph.

Slots past ``valid[b]`` are never loaded (they may hold anything); slots hidden by the mask are
loaded with their tile but weigh 0.  fp16 / bf16 caches on tensor cores with float32
accumulation; float32 caches with IEEE float32 dots (exact enough for the tests' comparisons).

An FP8 cache (float8_e4m3fn K and V with one float32 scale per slot and kv head, ``k_scale``,
``v_scale`` (B, Hkv, capacity)): a slot's row is ``scale * row8``.  Tiles are read as bytes (half
the bf16 cache's traffic: decode at long context reads little else) and widened to q's dtype,
exactly (every e4m3 value is a bf16 / fp16 one); a slot's K scale multiplies its column of
scores (float32).  Its V scale multiplies its column of P before the P·V product (the softmax's
sums see the unscaled P): a (G, BLOCK_N) product per tile, and P times a scale keeps float32's
range in bf16.  Not in fp16: V's scales are its rows' largest magnitudes over 448, ~1e-5 for rows
of ~1e-3, and P times them sank below fp16's normal range (a 1% error there, 13% for rows of
~1e-4: tests/decode_cases.py's small-V cases), so under fp16 queries the scales multiply V's tile
instead, in float32 before the cast (``V_TILE``): P·V reads the values an fp16 cache would hold.
``widen="f16"`` (the default) takes another road under bf16 / fp16 queries: FP8 widens to fp16
in one instruction per pair on Hopper, to bf16 in several, so the tiles go to fp16, q's rows are
scaled into [-1, 1] first by a power of two (its largest magnitude rounded up; back on the scores
after: fp16 holds q's bf16 digits exactly there and cannot overflow), and P's columns take the V
scales over the largest of the tile's visible slots (in [0, 1]: the fp16 underflow above cannot
happen), that largest back on P·V.

Triton is imported with this module: callers import it only when a kernel runs.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LN2 = tl.constexpr(0.6931471805599453)
LOG2E = 1.4426950408889634

MAX_SPLITS = 64       # partials merged per (sequence, head): one register tile in the reduce
PROGRAMS_PER_SM = 4   # split until the grid has this many programs per SM (or a chunk is one tile)


@triton.jit
def _split_kernel(Q, K, V, KS, VS, VALID, VIS, QPOS, KPOS, PO, PL,
                  sqb, sqh, skb, skh, sks, svb, svh, svs, ssb, ssh, svisb, skpb,
                  H, Hkv, G, chunk, window, scale_log2,
                  HEAD_DIM: tl.constexpr, G_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                  HAS_VIS: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr,
                  V_TILE: tl.constexpr, F16: tl.constexpr):
    split = tl.program_id(0)
    bh = tl.program_id(1)
    n_splits = tl.num_programs(0)
    b = (bh // Hkv).to(tl.int64)
    hk = (bh % Hkv).to(tl.int64)
    # slot indices fit int32 (capacity < 2^31); the batch and head offsets are int64
    n = tl.load(VALID + b).to(tl.int32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n)

    gi = tl.arange(0, G_BLOCK)
    g_ok = gi < G
    heads = hk * G + gi
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + b * sqb + heads[:, None] * sqh + d[None, :], mask=g_ok[:, None], other=0.0)
    if F16:  # FP8 tiles widen to fp16 (see the module docstring): q's rows scaled into [-1, 1] first
        qf = q.to(tl.float32)
        q_max = tl.max(tl.abs(qf), 1)
        # a power of two: the division is exact, q's bf16 digits survive in fp16; at most 2^127
        # (2^128 is inf in float32: bf16's largest values would make inf * 0 on the scores)
        q_max = tl.where(q_max > 0, tl.math.exp2(tl.minimum(tl.math.ceil(tl.math.log2(q_max)), 127.0)), 1.0)
        q = (qf / q_max[:, None]).to(tl.float16)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    ks_base = KS + b * ssb + hk * ssh  # FP8: the scales (B, Hkv, capacity), one layout for K's and V's
    vs_base = VS + b * ssb + hk * ssh
    if HAS_WINDOW:
        qp = tl.load(QPOS + b)

    # running state in base 2: out = acc / l, lse = m + log2(l)
    m_i = tl.full([G_BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([G_BLOCK], tl.float32)
    acc = tl.zeros([G_BLOCK, HEAD_DIM], tl.float32)
    for j0 in range(lo, hi, BLOCK_N):
        offs = j0 + tl.arange(0, BLOCK_N)
        inb = offs < hi
        rows = offs.to(tl.int64)[:, None]
        kt = tl.load(k_base + rows * sks + d[None, :], mask=inb[:, None], other=0.0)
        if FP8:
            kt = kt.to(q.dtype)  # fp16 under F16 (q was made fp16)
        if IEEE:
            s = tl.dot(q, tl.trans(kt), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(kt))
        if FP8:
            s = s * tl.load(ks_base + offs, mask=inb, other=0.0)[None, :]
        if F16:
            s = s * q_max[:, None]
        ok = inb
        if HAS_VIS:
            ok = ok & (tl.load(VIS + b * svisb + offs, mask=inb, other=0) != 0)
        if HAS_WINDOW:
            ok = ok & (qp - tl.load(KPOS + b * skpb + offs, mask=inb, other=0) < window)
        s = tl.where(ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a row that has seen nothing yet keeps m = -inf: subtract 0 there, so p = 0 and not NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_base + rows * svs + d[None, :], mask=inb[:, None], other=0.0)
        pw = p
        if FP8:  # the V scales: on P's columns, or (fp16) on V's tile: see the module docstring
            vs = tl.load(vs_base + offs, mask=inb, other=0.0)
            if F16:  # P times the scales over the tile's largest, in [0, 1]: no fp16 underflow to speak of
                # the largest of the slots that count: a hidden slot's row (any finite values)
                # must not push the visible ones' P below fp16's range
                vs = tl.where(ok, vs, 0.0)
                v_max = tl.max(vs, 0)
                v_max = tl.where(v_max > 0, v_max, 1.0)
                vt = vt.to(tl.float16)
                pw = p * (vs / v_max)[None, :]
            elif V_TILE:
                vt = (vt.to(tl.float32) * vs[:, None]).to(q.dtype)
            else:
                vt = vt.to(q.dtype)
                pw = p * vs[None, :]
        if IEEE:
            pv = tl.dot(pw.to(vt.dtype), vt, input_precision="ieee")
        else:
            pv = tl.dot(pw.to(vt.dtype), vt)
        if F16:
            pv = pv * v_max
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    row = (b * H + heads) * n_splits + split           # partials: (B, H, splits[, D]), contiguous
    tl.store(PO + row[:, None] * HEAD_DIM + d[None, :], acc / l_safe[:, None], mask=g_ok[:, None])
    tl.store(PL + row, tl.where(seen, m_i + tl.math.log2(l_safe), float("-inf")), mask=g_ok)


@triton.jit
def _reduce_kernel(PO, PL, O, LSE, n_splits, o_row, HEAD_DIM: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                # one (sequence, query head)
    si = tl.arange(0, SPLIT_BLOCK)
    s_ok = si < n_splits
    lse2 = tl.load(PL + row * n_splits + si, mask=s_ok, other=float("-inf"))
    m = tl.max(lse2, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse2 - m_use)                     # a chunk that saw nothing weighs 0
    den = tl.sum(w, 0)
    d = tl.arange(0, HEAD_DIM)
    po = tl.load(PO + (row * n_splits + si[:, None]) * HEAD_DIM + d[None, :], mask=s_ok[:, None], other=0.0)
    o = tl.sum(w[:, None] * po, 0)
    den_safe = tl.where(den > 0, den, 1.0)
    tl.store(O + row * o_row + d, o / den_safe)
    tl.store(LSE + row * o_row, tl.where(den > 0, (m_use + tl.math.log2(den_safe)) * LN2, float("-inf")))


def _pow2(x: int) -> int:
    return 1 << (max(1, x) - 1).bit_length()


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def block_n(head_dim: int, fp8: bool = False) -> int:
    """Cache rows per tile: two (BLOCK_N, D) tiles of K and V in flight fit shared memory; an FP8
    cache's tiles twice as many rows of half the bytes (the fastest of 64 / 128 rows and 4 / 8
    warps at 32K-512K slots on H200: decode_fp8_h200.json)."""
    return (64 if head_dim <= 128 else 32) * (2 if fp8 else 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _chunks(capacity: int, splits: int, bn: int) -> tuple[int, int]:
    """(splits, chunk) for at most ``splits`` chunks of whole tiles covering ``capacity`` (>= 1
    slot), the chunk as short as that allows, and no chunk empty."""
    capacity = max(capacity, 1)
    splits = max(1, min(splits, _cdiv(capacity, bn)))
    chunk = _cdiv(_cdiv(capacity, splits), bn) * bn
    return _cdiv(capacity, chunk), chunk


def plan_splits(capacity: int, programs: int, sms: int, bn: int) -> tuple[int, int]:
    """(splits, chunk): chunks of ``chunk`` slots (a multiple of ``bn``) covering ``capacity``,
    enough of them that ``programs`` x splits fills the SMs, at most :data:`MAX_SPLITS`."""
    return _chunks(capacity, min(_cdiv(PROGRAMS_PER_SM * sms, max(programs, 1)), MAX_SPLITS), bn)


WIDEN = ("q", "f16")
# fp16: faster than widening to bf16 at every size timed (decode_fp8_h200.json, H200) and 8x closer to
# float64 (P rounded to fp16, not bf16)
WIDEN_DEFAULT = "f16"


def supported_head_dim(d: int) -> bool:
    return 16 <= d <= 256 and d & (d - 1) == 0


def decode_attention(q, k, v, scale: float, valid, visible=None, window: int | None = None, qpos=None, kpos=None,
                     splits: int | None = None, bn: int | None = None, warps: int = 4, stages: int = 2,
                     k_scale=None, v_scale=None, widen: str | None = None):
    """float32 (out (B, H, D), lse (B, H)) of one query per sequence, views of one (B, H, D + 1)
    buffer (lse in its last column); see the module docstring.

    ``valid`` (B,) integer, ``visible`` (B, capacity) bool, ``qpos`` (B,) and ``kpos``
    (B, capacity) integer positions with ``window``: device tensors on q's device.  ``splits``
    and ``bn`` (rows per tile) override the plan (the interpreter tests use small ones).
    ``k_scale``, ``v_scale`` (B, Hkv, capacity) float32: k and v are an FP8 cache; ``widen``
    (:data:`WIDEN`) how its tiles reach the tensor cores: ``"q"`` in q's dtype, ``"f16"`` in fp16
    under bf16 / fp16 queries (float32 ones take ``"q"``); None: :data:`WIDEN_DEFAULT`."""
    B, H, D = q.shape
    Bk, Hkv, cap, Dk = k.shape
    if (Bk, Dk) != (B, D) or v.shape != k.shape or H % Hkv:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} does not fit k/v {tuple(k.shape)} / "
                         f"{tuple(v.shape)} (batch, heads a multiple of kv heads, head dim)")
    fp8 = k_scale is not None or v_scale is not None
    cache = torch.float8_e4m3fn if fp8 else q.dtype
    if not (cache == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"decode_attention takes one of float16/bfloat16/float32 for q and the same for k and v "
                         f"(float8_e4m3fn with k_scale and v_scale), got {q.dtype}, {k.dtype}, {v.dtype}")
    if fp8 and not (k_scale is not None and v_scale is not None and k_scale.shape == v_scale.shape == k.shape[:3]
                    and k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1
                    and k_scale.dtype == v_scale.dtype == torch.float32):
        raise ValueError(f"decode_attention: an FP8 cache needs k_scale and v_scale, float32 {tuple(k.shape[:3])} "
                         f"with one layout and contiguous rows")
    if not supported_head_dim(D):
        raise ValueError(f"decode_attention needs a power-of-two head dim in [16, 256], got {D}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("decode_attention reads rows of q, k and v: their last dims must be contiguous")
    if cap >= 1 << 31:
        raise ValueError(f"decode_attention: capacity {cap} does not fit the kernel's int32 slot indices")
    if valid.shape != (B,):
        raise ValueError(f"decode_attention: valid must be ({B},), got {tuple(valid.shape)}")
    if window is not None and (qpos is None or kpos is None):
        raise ValueError("decode_attention: a window needs qpos (B,) and kpos (B, capacity)")
    for name, t in (("visible", visible), ("kpos", kpos if window is not None else None)):
        if t is not None and (t.shape != (B, cap) or t.stride(1) != 1):
            raise ValueError(f"decode_attention: {name} must be ({B}, {cap}) with contiguous rows, got "
                             f"{tuple(t.shape)} strides {t.stride()}")
    widen = widen or WIDEN_DEFAULT
    if widen not in WIDEN:
        raise ValueError(f"decode_attention: widen must be one of {WIDEN}, got {widen!r}")
    f16 = fp8 and widen == "f16" and q.dtype != torch.float32
    G = H // Hkv
    bn = bn or block_n(D, fp8)
    if splits is None:
        sms = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device()) \
            if q.is_cuda else 4
        splits, chunk = plan_splits(cap, B * Hkv, sms, bn)
    else:
        splits, chunk = _chunks(cap, splits, bn)
    po = torch.empty(B, H, splits, D, device=q.device, dtype=torch.float32)
    pl = torch.empty(B, H, splits, device=q.device, dtype=torch.float32)
    # out and lse packed in one (B, H, D + 1) buffer: a decode step's merge all-gathers it as it is
    ol = torch.empty(B, H, D + 1, device=q.device, dtype=torch.float32)
    out, lse = ol[..., :D], ol[..., D]
    vis = visible.view(torch.uint8) if visible is not None and visible.dtype == torch.bool else visible
    has_win = window is not None
    dummy = valid
    _split_kernel[(splits, B * Hkv)](
        q, k, v, k_scale if fp8 else lse, v_scale if fp8 else lse, valid, vis if vis is not None else dummy,
        qpos if has_win else dummy, kpos if has_win else dummy,
        po, pl, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0,
        vis.stride(0) if vis is not None else 0, kpos.stride(0) if has_win else 0,
        H, Hkv, G, chunk, int(window) if has_win else 0, float(scale) * LOG2E,
        HEAD_DIM=D, G_BLOCK=max(16, _pow2(G)), BLOCK_N=bn, HAS_VIS=vis is not None, HAS_WINDOW=has_win,
        IEEE=q.dtype == torch.float32, FP8=fp8, V_TILE=fp8 and q.dtype == torch.float16 and not f16, F16=f16,
        num_warps=warps, num_stages=stages)
    _reduce_kernel[(B * H,)](po, pl, out, lse, splits, D + 1, HEAD_DIM=D, SPLIT_BLOCK=max(2, _pow2(splits)), num_warps=4)
    return out, lse
