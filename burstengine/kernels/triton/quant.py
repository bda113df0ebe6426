"""Block quantization to float8 e4m3 for the FP8 forward (kernels/fp8.py), in two passes over x
(B, S, H, D) with heads side by side in a row: each block of BLOCK rows and head's largest magnitude,
then the cast by the block's scale (which the caller may floor in between, as V's are against its
head's largest), optionally into V's transposed layout (B, H * D, columns) that Hopper's FP8 wgmma
reads.  The torch expression behind them (kernels/fp8.py) makes float32 copies of x; these read
it twice and write one byte per element.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _block(X, sxb, sxs, S, H, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """This program's (block of BLOCK rows, batch x head): (x tile, batch, head, block, rows, cols,
    rows inside S)."""
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    rows = blk * BLOCK + tl.arange(0, BLOCK)
    cols = tl.arange(0, HEAD_DIM)
    ok = rows[:, None] < S
    x = tl.load(X + b * sxb + rows[:, None].to(tl.int64) * sxs + h * HEAD_DIM + cols[None, :], mask=ok, other=0.0)
    return x, b, h, blk, rows, cols, ok


@triton.jit
def amax_kernel(X, A, sxb, sxs, S, H, n_b, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr):
    """A (B, blocks, H) float32: the largest |x| of each block of BLOCK rows and head."""
    x, b, h, blk, rows, cols, ok = _block(X, sxb, sxs, S, H, HEAD_DIM, BLOCK)
    tl.store(A + (b * n_b + blk) * H + h, tl.max(tl.max(tl.abs(x.to(tl.float32)), 1), 0))


@triton.jit
def cast_kernel(X, SC, Y, sxb, sxs, syb, sys_, S, H, n_b, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                TRANS: tl.constexpr):
    """Y = x / its block's scale SC (B, blocks, H), rounded to e4m3 (nearest even, saturating):
    rows of (B, S, H * D) like x, or with ``TRANS`` V's layout (B, H * D, columns), element (s, h, d)
    at row h * D + d, column s."""
    x, b, h, blk, rows, cols, ok = _block(X, sxb, sxs, S, H, HEAD_DIM, BLOCK)
    inv = 1.0 / tl.load(SC + (b * n_b + blk) * H + h)
    y = tl.clamp(x.to(tl.float32) * inv, -448.0, 448.0).to(Y.dtype.element_ty)
    if TRANS:
        tl.store(Y + b * syb + (h * HEAD_DIM + cols[None, :]).to(tl.int64) * sys_ + rows[:, None], y, mask=ok)
    else:
        tl.store(Y + b * syb + rows[:, None].to(tl.int64) * sys_ + h * HEAD_DIM + cols[None, :], y, mask=ok)
