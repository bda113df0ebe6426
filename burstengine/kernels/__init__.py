"""Local (single-device) attention kernels behind one interface (see base.Kernel).

Choice, first match wins: the ``kernel=`` argument, the ``BURST_KERNEL`` environment
variable, then automatic: cuDNN on CUDA (the fastest SDPA backend measured on H100/H200),
the reference kernel elsewhere.
"""
from __future__ import annotations

import os

import torch

from .base import Kernel
from .reference import ReferenceKernel
from .sdpa import CudnnKernel, FlashKernel

KERNELS: dict[str, Kernel] = {k.name: k for k in (ReferenceKernel(), FlashKernel(), CudnnKernel())}
AUTO_ORDER = ("cudnn", "flash", "reference")


def get_kernel(name: str | None, device) -> Kernel:
    name = name or os.environ.get("BURST_KERNEL") or "auto"
    device = torch.device(device)
    if name == "auto":
        for n in AUTO_ORDER:
            if KERNELS[n].available(device):
                return KERNELS[n]
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; expected 'auto' or one of {sorted(KERNELS)}")
    k = KERNELS[name]
    if not k.available(device):
        raise ValueError(f"kernel {name!r} cannot run on device {device}")
    return k


__all__ = ["Kernel", "KERNELS", "get_kernel"]
