"""The single-GPU speeds a distributed run is rated against (`bench prefill --efficiency`): one
causal attention block's forward on the local kernel the ring would run, and one matmul of a
model's projection shape, each timed alone on this process's device (no collectives: the other
ranks wait, so nothing shares the device).

The attention call is the one the ring makes on every block, ``forward_into`` a running float32
output and log-sum-exp (kernels/base.py), on the kernel :func:`attention.planning.resolve_kernel`
gives for the same name (``auto``: per card and block size, kernels/choices.py; Gluon for a causal
block on an H100/H200 today).  On CPU the same code runs with CPU shapes; its figures say nothing
of a GPU.
"""
from __future__ import annotations

import torch

from ...attention.planning import resolve_kernel
from ...comm.dist import LOCAL
from ...kernels import AutoKernel, acc_dtype
from ...kernels.choices import device_name
from ...masks import CAUSAL
from ...timing import median, timed
from ..harness import attn_flops

WARMUP, ITERS = 2, 5


def _chosen(kern, q, k, v, out, lse) -> str:
    """The kernel that runs the probe's call: an ``auto`` kernel's pick for it ("auto: gluon")."""
    if not isinstance(kern, AutoKernel):
        return kern.name
    return f"auto: {kern.forward_into_runs(q, k, v, CAUSAL, out, lse)}"


def attention_speed(kernel: str | None, rows: int, heads: int, kv_heads: int, head_dim: int, dtype, device,
                    scale: float | None = None) -> dict:
    """TFLOP/s of a causal block of ``rows`` query rows and keys (batch 1, ``heads`` q and
    ``kv_heads`` kv heads of ``head_dim``) through ``kernel`` (a name; None: BURST_KERNEL, else
    auto), counted as 2·rows²·heads·head_dim FLOPs (docs/design.md, "FLOP conventions")."""
    device = torch.device(device)
    kern = resolve_kernel(kernel, device)
    q = torch.randn(1, rows, heads, head_dim, dtype=dtype, device=device)
    k, v = (torch.randn(1, rows, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2))
    out = torch.zeros(1, rows, heads, head_dim, dtype=acc_dtype(dtype), device=device)
    lse = torch.full((1, heads, rows), float("-inf"), dtype=acc_dtype(dtype), device=device)
    scale = head_dim ** -0.5 if scale is None else scale
    secs = median(timed(lambda: kern.forward_into(q, k, v, scale, CAUSAL, out, lse), device, LOCAL, WARMUP, ITERS))
    return dict(kernel=_chosen(kern, q, k, v, out, lse), rows=rows, heads=heads, kv_heads=kv_heads,
                head_dim=head_dim, seconds=secs, tflops=attn_flops(1, rows, rows, heads, head_dim, 0.5) / secs / 1e12)


def matmul_speed(rows: int, dim: int, ffn: int, dtype, device) -> dict:
    """TFLOP/s of a (rows x dim) @ (dim x ffn) matmul: 2·rows·dim·ffn FLOPs."""
    device = torch.device(device)
    a = torch.randn(rows, dim, dtype=dtype, device=device)
    b = torch.randn(dim, ffn, dtype=dtype, device=device)
    c = torch.empty(rows, ffn, dtype=dtype, device=device)
    secs = median(timed(lambda: torch.mm(a, b, out=c), device, LOCAL, WARMUP, ITERS))
    return dict(rows=rows, dim=dim, ffn=ffn, seconds=secs, tflops=2.0 * rows * dim * ffn / secs / 1e12)


def device_label(device) -> str:
    """The card's name, or "cpu" (whose figures say nothing of a GPU)."""
    return device_name(device) or torch.device(device).type
