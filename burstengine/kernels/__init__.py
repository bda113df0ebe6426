"""Local (single-device) attention kernels behind one interface (see base.Kernel).

Choice, first match wins: the ``kernel=`` argument, the ``BURST_KERNEL`` environment
variable, then automatic: on CUDA an :class:`AutoKernel` that picks per call, by direction and
mask, the kernel measured faster (``AUTO_TABLE``); the reference kernel elsewhere.
"""
from __future__ import annotations

import os

import torch

from ..attention.schedule import CAUSAL, FULL, STRICT
from .base import Kernel, MaskSpec
from .reference import ReferenceKernel
from .sdpa import CudnnKernel, FlashKernel
from .triton_kernel import TritonKernel

KERNELS: dict[str, Kernel] = {k.name: k for k in (ReferenceKernel(), FlashKernel(), CudnnKernel(), TritonKernel())}

# Which kernel "auto" runs on CUDA for each (direction, mask); "spec" is any MaskSpec (windows,
# documents, block masks), which SDPA cannot express.  From the ring-step timings in
# benchmarks/results/lao_bench.json ("ring_step", H200, bf16, d=128, 32 heads, 8K-32K rows per
# block): STRICT costs SDPA a shifted call and the backward a rebuilt `out` from D, which our
# kernels take directly.
AUTO_TABLE = {
    ("forward", FULL): "cudnn",
    ("forward", CAUSAL): "cudnn",
    ("forward", STRICT): "triton",
    ("forward", "spec"): "triton",
    ("backward", FULL): "cudnn",
    ("backward", CAUSAL): "cudnn",
    ("backward", STRICT): "triton",
    ("backward", "spec"): "triton",
}


class AutoKernel(Kernel):
    """Dispatches each call to ``AUTO_TABLE``'s kernel for its direction and mask (cuDNN when
    Triton is missing, the reference for a MaskSpec then)."""

    name = "auto"

    def __init__(self, table=None):
        self.table = dict(AUTO_TABLE if table is None else table)

    def available(self, device):
        return torch.device(device).type == "cuda" and torch.cuda.is_available()

    def pick(self, direction: str, mask, device) -> Kernel:
        kind = "spec" if isinstance(mask, MaskSpec) else mask
        k = KERNELS[self.table[(direction, kind)]]
        if k.available(device):
            return k
        return KERNELS["reference" if kind == "spec" else "cudnn"]

    def forward(self, q, k, v, scale, mask):
        return self.pick("forward", mask, q.device).forward(q, k, v, scale, mask)

    def forward_into(self, q, k, v, scale, mask, out, lse):
        return self.pick("forward", mask, q.device).forward_into(q, k, v, scale, mask, out, lse)

    def backward(self, dout, q, k, v, lse, delta, scale, mask, out=None):
        return self.pick("backward", mask, q.device).backward(dout, q, k, v, lse, delta, scale, mask, out=out)

    def backward_into(self, dout, q, k, v, lse, delta, scale, mask, dq, dk, dv, out=None):
        return self.pick("backward", mask, q.device).backward_into(dout, q, k, v, lse, delta, scale, mask, dq, dk, dv,
                                                                   out=out)


_AUTO = AutoKernel()


def get_kernel(name: str | None, device) -> Kernel:
    name = name or os.environ.get("BURST_KERNEL") or "auto"
    device = torch.device(device)
    if name == "auto":
        return _AUTO if _AUTO.available(device) else KERNELS["reference"]
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; expected 'auto' or one of {sorted(KERNELS)}")
    k = KERNELS[name]
    if not k.available(device):
        raise ValueError(f"kernel {name!r} cannot run on device {device}")
    return k


__all__ = ["AutoKernel", "AUTO_TABLE", "Kernel", "KERNELS", "get_kernel"]
