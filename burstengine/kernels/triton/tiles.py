"""What the Triton attention kernels share: which tiles of a (q block, kv block) pair can see
each other, the element mask of a partly visible tile, and tile loads.

Visibility comes from a :class:`MaskSpec`: affine global positions (causal and sliding
windows as bounds on q_pos - k_pos), sorted document ids and a block mask.  A kernel walks the
tiles of one side against one tile of the other and splits them into three runs,
``[a, c)`` partly visible, ``[c, d)`` fully visible (no mask work), ``[d, e)`` partly visible;
tiles outside ``[a, e)`` are never loaded.  Positions and documents give contiguous runs
(computed in the kernel, documents through per-tile bounds from :func:`doc_bounds`); a block
mask does not, so it comes as per-tile lists of visible tiles from :func:`tile_lists`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# "no bound" on q_pos - k_pos; positions must stay well inside int32 (checked by the caller)
BIG = 1 << 30
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def row_desc(base, n_rows, stride, width, BLOCK: tl.constexpr, D: tl.constexpr, USE_TMA: tl.constexpr):
    """Handle on a batch's (n_rows, heads * D) matrix (row stride ``stride``, heads side by side),
    read in (BLOCK, D) tiles: a TMA descriptor (Hopper) or a block pointer.  One handle serves
    every head (the column offset picks one), and it is a few scalars, so unlike a tensor of
    pointers it costs no registers while a loop runs."""
    if USE_TMA:
        d = tl.make_tensor_descriptor(base, shape=[n_rows, width], strides=[stride, 1], block_shape=[BLOCK, D])
    else:
        d = tl.make_block_ptr(base, shape=(n_rows, width), strides=(stride, 1), offsets=(0, 0), block_shape=(BLOCK, D),
                              order=(1, 0))
    return d


@triton.jit
def load_rows(desc, s0, col, USE_TMA: tl.constexpr):
    """Rows [s0, s0 + BLOCK), columns [col, col + D) through a :func:`row_desc` handle, zero past the end."""
    if USE_TMA:
        x = desc.load([s0, col])
    else:
        x = tl.load(tl.advance(desc, (s0, col)), boundary_check=(0,), padding_option="zero")
    return x


@triton.jit
def store_rows(desc, s0, col, x, USE_TMA: tl.constexpr):
    """Store rows [s0, s0 + BLOCK) of one head, dropping those past the end."""
    if USE_TMA:
        desc.store([s0, col], x)
    else:
        tl.store(tl.advance(desc, (s0, col)), x, boundary_check=(0,))


@triton.jit
def zero_rows(base, stride, n_rows, s0, col, width, BLOCK: tl.constexpr, D: tl.constexpr, USE_TMA: tl.constexpr):
    """Zero rows [s0, s0 + BLOCK) of one head of a batch's (n_rows, width) matrix: a fresh
    output's tile that no visible pair reaches."""
    desc = row_desc(base, n_rows, stride, width, BLOCK, D, USE_TMA)
    store_rows(desc, s0, col, tl.zeros([BLOCK, D], base.dtype.element_ty), USE_TMA)


@triton.jit
def add_rows(desc, base, stride, s0, col, n_rows, x, BLOCK: tl.constexpr, D: tl.constexpr, USE_TMA: tl.constexpr):
    """Atomically add float32 rows [s0, s0 + BLOCK) of one head (TMA reduce-add, or per-element atomics)."""
    if USE_TMA:
        desc.atomic_add([s0, col], x)
    else:
        r = tl.arange(0, BLOCK)
        c = tl.arange(0, D)
        ptr = base + s0.to(tl.int64) * stride + col + (r[:, None] * stride + c[None, :])
        tl.atomic_add(ptr, x, mask=(s0 + r)[:, None] < n_rows, sem="relaxed")


@triton.jit
def vec_desc(base, n_heads, n_rows, stride_h, BLOCK: tl.constexpr, USE_TMA: tl.constexpr):
    """Handle on a batch's float32 (heads, rows) matrix (lse, D; rows contiguous) read in
    BLOCK-row pieces of one head: a TMA descriptor, or the base pointer."""
    if USE_TMA:
        d = tl.make_tensor_descriptor(base, shape=[n_heads, n_rows], strides=[stride_h, 1], block_shape=[1, BLOCK])
    else:
        d = base
    return d


@triton.jit
def load_vec(handle, h, stride_h, stride_r, s0, n_rows, other, BLOCK: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows [s0, s0 + BLOCK) of head ``h`` through a :func:`vec_desc` handle; past the end 0
    (TMA) or ``other`` (pointers)."""
    if USE_TMA:
        x = handle.load([h, s0]).reshape(BLOCK)
    else:
        offs = s0 + tl.arange(0, BLOCK)
        x = tl.load(handle + h * stride_h + offs * stride_r, mask=offs < n_rows, other=other)
    return x


@triton.jit
def _i64(x):
    # scalar kernel arguments equal to 1 arrive as constexprs; adding a zero tensor makes any of them int64
    return x + tl.zeros([], tl.int64)


@triton.jit
def tile_ranges(o_min, o_max, lo, hi, start, step, n_rows, BOUNDS, tile, BLOCK: tl.constexpr, HAS_DOC: tl.constexpr):
    """Tiles of the walked side (row r at position start + r * step) against one tile of the
    other side (positions o_min..o_max) when a pair is visible iff x - o in [lo, hi]:
    returns (a, c, d, e), tiles [a, e) see something, [c, d) see everything (a <= c <= d <= e).
    The ragged last tile is never counted as fully visible.  With documents, ``BOUNDS[tile]``
    holds the walked rows [r_lo, r_hi) whose documents meet the tile's, and whether the tile
    is a single document."""
    start = _i64(start)
    step = _i64(step)
    o_min = _i64(o_min)
    o_max = _i64(o_max)
    lo = _i64(lo)
    hi = _i64(hi)
    span = BLOCK * step
    width = (BLOCK - 1) * step
    n_tiles = tl.cdiv(n_rows, BLOCK)
    # first tile whose last row reaches o_min + lo; tiles whose first row is <= o_max + hi
    a = (tl.maximum(o_min + lo - start - width, 0) + span - 1) // span
    e = tl.minimum(tl.maximum(o_max + hi - start + span, 0) // span, n_tiles)
    # first tile whose first row is >= o_max + lo; tiles whose last row is <= o_min + hi
    c = (tl.maximum(o_max + lo - start, 0) + span - 1) // span
    d = tl.minimum(tl.maximum(o_min + hi - start - width + span, 0) // span, n_rows // BLOCK)
    if HAS_DOC:
        r_lo = tl.load(BOUNDS + tile * 3)
        r_hi = tl.load(BOUNDS + tile * 3 + 1)
        single = tl.load(BOUNDS + tile * 3 + 2) != 0
        a = tl.maximum(a, r_lo // BLOCK)
        e = tl.where(r_hi > r_lo, tl.minimum(e, tl.cdiv(r_hi, BLOCK)), 0)
        c = tl.maximum(c, tl.where(single, tl.cdiv(r_lo, BLOCK), e))
        d = tl.minimum(d, tl.where(single, r_hi // BLOCK, 0))
    a = tl.minimum(a, e)
    c = tl.minimum(tl.maximum(c, a), e)
    d = tl.minimum(tl.maximum(d, c), e)
    return a.to(tl.int32), c.to(tl.int32), d.to(tl.int32), e.to(tl.int32)


@triton.jit
def tile_work(t, n_rows, start, step, lo, hi, o_start, o_step, o_rows, BOUNDS, CNT, BLOCK: tl.constexpr,
              O_BLOCK: tl.constexpr, HAS_DOC: tl.constexpr, HAS_BLOCK: tl.constexpr):
    """What the program owning tile ``t`` of one side (row r at start + r * step) walks on the
    other side, where a pair is visible iff other - own position in [lo, hi]: returns (the
    other side's tile runs a, c, d, e of :func:`tile_ranges`, block-list length, any work).
    With a block mask the runs are 0 and ``CNT[t]`` counts the listed tiles instead."""
    r0 = t * BLOCK
    if HAS_BLOCK:
        a = 0
        c = 0
        d = 0
        e = 0
        n_list = tl.load(CNT + t)
        todo = n_list > 0
    else:
        p_lo = start + r0 * step
        p_hi = start + (tl.minimum(r0 + BLOCK, n_rows) - 1) * step
        a, c, d, e = tile_ranges(p_lo, p_hi, lo, hi, o_start, o_step, o_rows, BOUNDS, t, O_BLOCK, HAS_DOC)
        n_list = 0
        todo = a < e
    return a, c, d, e, n_list, todo


@triton.jit
def q_tile_work(Sq, Sk, H, q_start, q_step, k_start, k_step, lo, hi, BOUNDS, CNT, reverse,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOC: tl.constexpr, HAS_BLOCK: tl.constexpr):
    """What a program owning one (q tile, batch x head) of a grid (q tiles, B * H) does: returns
    (q tile, batch, head, first row, the k tile runs a, c, d, e, block-list length, any work).
    With ``reverse`` (causal-like masks) the last q tiles, which have the most work, go first."""
    pid_m = tl.program_id(0)
    if reverse:
        pid_m = tl.cdiv(Sq, BLOCK_M) - 1 - pid_m
    bh = tl.program_id(1)
    # visible iff q - k in [lo, hi], i.e. k - q in [-hi, -lo]
    a, c, d, e, n_list, todo = tile_work(pid_m, Sq, q_start, q_step, -hi, -lo, k_start, k_step, Sk, BOUNDS, CNT,
                                         BLOCK_M, BLOCK_N, HAS_DOC, HAS_BLOCK)
    return pid_m, bh // H, bh % H, pid_m * BLOCK_M, a, c, d, e, n_list, todo


@triton.jit
def visible(qi, kj, Sq, Sk, q_start, q_step, k_start, k_step, lo, hi, QDOC, KDOC, BMASK, bs, nbk,
            HAS_DOC: tl.constexpr, HAS_BLOCK: tl.constexpr):
    """Element visibility of query rows ``qi`` and key rows ``kj`` (broadcastable index
    tensors); rows past either end are invisible."""
    diff = (q_start + qi * q_step) - (k_start + kj * k_step)
    vis = (diff >= lo) & (diff <= hi) & (qi < Sq) & (kj < Sk)
    if HAS_DOC:
        vis = vis & (tl.load(QDOC + qi, mask=qi < Sq, other=-1) == tl.load(KDOC + kj, mask=kj < Sk, other=-2))
    if HAS_BLOCK:
        on = tl.load(BMASK + (qi // bs) * nbk + kj // bs, mask=(qi < Sq) & (kj < Sk), other=0)
        vis = vis & (on != 0)
    return vis


# --- host side ---------------------------------------------------------------------------------


def bounds_of(spec):
    """(lo, hi) with visibility iff lo <= q_pos - k_pos <= hi."""
    lo = 0 if spec.causal else -BIG
    hi = spec.window - 1 if spec.window is not None else BIG
    return lo, hi


def doc_bounds(row_doc: torch.Tensor, col_doc: torch.Tensor, block: int) -> torch.Tensor:
    """int32 (tiles, 3): per tile of ``block`` rows, the columns [lo, hi) whose documents fall in
    the tile's document range, and 1 where the tile lies in one document (ids non-decreasing)."""
    n = row_doc.numel()
    first = torch.arange(0, n, block, device=row_doc.device)
    last = torch.clamp(first + block, max=n) - 1
    d0, d1 = row_doc[first], row_doc[last]
    lo = torch.searchsorted(col_doc, d0, right=False)
    hi = torch.searchsorted(col_doc, d1, right=True)
    return torch.stack([lo, hi, (d0 == d1).long()], 1).to(torch.int32).contiguous()


def _tile_pos(start, step, n, block, device):
    first = torch.arange(0, n, block, device=device, dtype=torch.int64)
    last = torch.clamp(first + block, max=n) - 1
    return start + first * step, start + last * step, first + block <= n


def _block_counts(bm: torch.Tensor, n: int, m: int, bs: int, bq: int, bk: int):
    """Visible blocks and total blocks of ``bm`` under each (bq x bk) tile of an n x m block."""
    dev = bm.device
    pre = torch.zeros(bm.shape[0] + 1, bm.shape[1] + 1, dtype=torch.int64, device=dev)
    pre[1:, 1:] = bm.long().cumsum(0).cumsum(1)
    r = torch.arange(0, n, bq, device=dev)
    c = torch.arange(0, m, bk, device=dev)
    r0, r1 = r // bs, (torch.clamp(r + bq, max=n) - 1) // bs + 1
    c0, c1 = c // bs, (torch.clamp(c + bk, max=m) - 1) // bs + 1
    on = pre[r1][:, c1] - pre[r0][:, c1] - pre[r1][:, c0] + pre[r0][:, c0]
    area = (r1 - r0)[:, None] * (c1 - c0)[None, :]
    return on, area


def tile_classes(spec, Sq: int, Sk: int, bq: int, bk: int, device):
    """Bool (q tiles, k tiles) pairs (any visible, all visible) for a MaskSpec."""
    lo, hi = bounds_of(spec)
    qmin, qmax, qwhole = _tile_pos(spec.q_start, spec.q_step, Sq, bq, device)
    kmin, kmax, kwhole = _tile_pos(spec.k_start, spec.k_step, Sk, bk, device)
    dmin = qmin[:, None] - kmax[None, :]
    dmax = qmax[:, None] - kmin[None, :]
    any_ = (dmax >= lo) & (dmin <= hi)
    full = (dmin >= lo) & (dmax <= hi) & qwhole[:, None] & kwhole[None, :]
    if spec.q_doc is not None:
        qd = spec.q_doc.to(device=device, dtype=torch.int64)
        kd = spec.k_doc.to(device=device, dtype=torch.int64)
        qf = torch.arange(0, Sq, bq, device=device)
        kf = torch.arange(0, Sk, bk, device=device)
        q0, q1 = qd[qf], qd[torch.clamp(qf + bq, max=Sq) - 1]
        k0, k1 = kd[kf], kd[torch.clamp(kf + bk, max=Sk) - 1]
        any_ &= (q1[:, None] >= k0[None, :]) & (q0[:, None] <= k1[None, :])
        full &= (q0 == q1)[:, None] & (k0 == k1)[None, :] & (q0[:, None] == k0[None, :])
    if spec.block_mask is not None:
        on, area = _block_counts(spec.block_mask.to(device), Sq, Sk, spec.block_size, bq, bk)
        any_ &= on > 0
        full &= on == area
    return any_, full


def tile_lists(any_: torch.Tensor, full: torch.Tensor):
    """Per row of tiles: (count int32, visible tile indices int32 ascending, fully-visible flags
    int8), the lists padded to the row length so no device sync is needed."""
    order = torch.sort((~any_).to(torch.int8), dim=1, stable=True).indices
    cnt = any_.sum(1).to(torch.int32)
    return cnt.contiguous(), order.to(torch.int32).contiguous(), full.gather(1, order).to(torch.int8).contiguous()
