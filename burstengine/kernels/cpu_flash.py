"""PyTorch's CPU flash attention (``aten._scaled_dot_product_flash_attention_for_cpu`` and its
backward) behind the kernel interface: the fast kernel for CPU work.

The op returns the log-sum-exp a ring needs, tiles the scores (no (Sq, Sk) matrix is ever
built) and is about 10x faster than the plain-torch reference kernel on a causal 4096-token
block (benchmarks/results/cpu_kernels_cpu.json,
burstengine bench cpu-kernels).  What it cannot do is handled here:

* float64 (the tests' oracle) and a value head dim that differs from the query's go to the
  reference kernel, which stays the definition of the right answer;
* STRICT blocks: CAUSAL on q[1:] against k[:-1] (base.ShiftStrict); row 0 sees nothing;
* sparse masks (MaskSpec): cut into exact FULL / CAUSAL pieces (kernels/pieces.py), the specs
  with no such cut (and slivers) run on the reference kernel;
* D instead of O: the backward op recomputes D = rowsum(dO * out) from ``out``; without one we
  pass out' with rowsum(dO * out') = D (sdpa.out_from_delta), as the CUDA SDPA kernels do;
* empty blocks (no query rows or no keys): the op aborts the process on them, so they never
  reach it.

GQA needs nothing: the op takes fewer kv heads (query head h reads kv head h // (H / Hkv)) and
its backward returns dK/dV with Hkv heads.
"""
from __future__ import annotations

import torch

from .base import ShiftStrict
from .pieces import PiecewiseMasks
from .reference import ReferenceKernel
from .sdpa import out_from_delta

aten = torch.ops.aten

_REFERENCE = ReferenceKernel()
# dtypes the op computes in (float64 runs too, but the reference is its definition)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _bhsd(x):
    # the op reads (B, H, S, D) views of (B, S, H, D) tensors laid out densely: other strides (a
    # slice of a wider tensor, a transposed head dim) come out wrong, so such inputs are copied
    return x.contiguous().transpose(1, 2)


def takes(q, k, v) -> bool:
    """Whether the op runs these inputs (else the reference kernel does)."""
    return (q.device.type == "cpu" and q.dtype in DTYPES and q.dtype == k.dtype == v.dtype
            and v.shape[-1] == q.shape[-1] and q.shape[1] > 0 and k.shape[1] > 0)


class _CpuFlashOps(ShiftStrict):
    """The two ops on FULL / CAUSAL blocks (STRICT through ShiftStrict)."""

    def _fwd(self, q, k, v, scale, causal):
        if not takes(q, k, v):
            return _REFERENCE.forward(q, k, v, scale, "causal" if causal else "full")
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(_bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal,
                                                                  scale=scale)
        return _bhsd(o), lse

    def _bwd(self, dout, q, k, v, lse, delta, scale, causal, out):
        if not takes(q, k, v):
            return _REFERENCE.backward(dout, q, k, v, lse, delta, scale, "causal" if causal else "full", out=out)
        if out is None:
            out = out_from_delta(dout, delta)
        # the op wants dO and out in the inputs' dtype and the lse in float32
        dout, out = dout.to(q.dtype), out.to(q.dtype)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.float().contiguous(), 0.0, causal,
            scale=scale)
        return _bhsd(dq), _bhsd(dk), _bhsd(dv)


class CpuFlashKernel(PiecewiseMasks, _CpuFlashOps):
    """torch's CPU flash attention for float32 / bfloat16 / float16; float64 (and anything else
    the op does not take) runs on the reference kernel, whole calls at a time."""

    name = "cpu_flash"

    def available(self, device):
        return torch.device(device).type == "cpu"

    def forward(self, q, k, v, scale, mask):
        if not takes(q, k, v):
            return _REFERENCE.forward(q, k, v, scale, mask)
        return super().forward(q, k, v, scale, mask)

    def forward_into(self, q, k, v, scale, mask, out, lse):
        if not takes(q, k, v):
            return _REFERENCE.forward_into(q, k, v, scale, mask, out, lse)
        return super().forward_into(q, k, v, scale, mask, out, lse)

    def backward(self, dout, q, k, v, lse, delta, scale, mask, out=None):
        if not takes(q, k, v):
            return _REFERENCE.backward(dout, q, k, v, lse, delta, scale, mask, out=out)
        return super().backward(dout, q, k, v, lse, delta, scale, mask, out=out)

    def backward_into(self, dout, q, k, v, lse, delta, scale, mask, dq, dk, dv, out=None):
        if not takes(q, k, v):
            return _REFERENCE.backward_into(dout, q, k, v, lse, delta, scale, mask, dq, dk, dv, out=out)
        return super().backward_into(dout, q, k, v, lse, delta, scale, mask, dq, dk, dv, out=out)
