"""A few rows times a weight: ``y = x @ w.T (+ b)`` for a decode step's projections.

A decode step multiplies one row per sequence (up to 16) by every weight of the model, so each
projection is a read of its weight: its speed is the fraction of the memory bandwidth the read
reaches, and in a step of ~1,000 small kernels, the kernels it takes.  cuBLAS reads the large
weights at full speed but launches a split-K product and a reduction for most of these shapes and
reads a tensor-parallel rank's short slices at 55-75% of the copy bandwidth
(benchmarks/results/gemv_h200_graph.json).  Here one program owns ``BN`` output columns over the
whole of K (no split, no second kernel): it streams its (BN, K) slab of the weight in (BN, BK)
tiles, pipelined ``STAGES`` deep, against the (at most 16) rows of x, which every program reads
from L2.  The rows are padded to the 16 a tensor-core dot needs; accumulation is float32, the
output in x's dtype, as ``torch.nn.functional.linear``.

Triton is imported with this module: callers import it only when the kernel runs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # rows of x one call takes: the tensor-core dot's smallest M
# (columns per program, K per tile, warps, stages) by N, from the tile sweep of bench gemv inside a
# CUDA graph on one H200 (benchmarks/results/gemv_h200_graph.json, Llama-3.1-8B's projections at 1, 2
# and 4 ranks, 1 and 8 rows): 32 x 512 was the fastest or within 5% of it on every weight but the
# widest, where 64 x 128 was; over the four projections of a layer at 2 ranks it takes 67 us where
# cuBLAS takes 71
NARROW, WIDE, WIDE_FROM = (32, 512, 4, 3), (64, 128, 4, 3), 12288


@triton.jit
def _gemv_kernel(X, W, B, Y, M, N, K, sxm, swn, sym,
                 HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    rk = tl.arange(0, BK)
    n_ok = rn < N
    m_ok = rm < M
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    w_ptr = W + rn[:, None].to(tl.int64) * swn + rk[None, :]
    x_ptr = X + rm[:, None] * sxm + rk[None, :]
    for k0 in range(0, K, BK):
        k_ok = (k0 + rk) < K
        w = tl.load(w_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
        w_ptr += BK
        x_ptr += BK
    if HAS_BIAS:
        acc += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rm[:, None] * sym + rn[None, :], acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`gemv` runs ``x @ w.T``: CUDA, fp16 / bf16, at most MAX_ROWS rows of x,
    w's rows contiguous."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and w.dtype == x.dtype
            and 0 < rows <= MAX_ROWS and w.dim() == 2 and w.stride(1) == 1 and x.shape[-1] == w.shape[1])


def config_for(N: int) -> tuple[int, int, int, int]:
    """(columns per program, K per tile, warps, stages) for a weight of N rows."""
    return WIDE if N >= WIDE_FROM else NARROW


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, config=None) -> torch.Tensor:
    """``x @ w.T + bias`` (x (..., K) with at most MAX_ROWS rows, w (N, K)), in x's dtype."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape[0], w.shape[0]
    bn, bk, warps, stages = config or config_for(N)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, bn),)](
        x2, w, bias if bias is not None else w, y, M, N, K, x2.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BM=MAX_ROWS, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    return y.reshape(tuple(x.shape[:-1]) + (N,))
