"""The decoder's projections (``x @ w.T + b``): torch's ``F.linear``, or, for a decode step's few
rows on a GPU, our GEMV kernel (kernels/triton/gemv.py), which reads the weight in one kernel
where cuBLAS launches a split-K product and a reduction.  Which one runs is set once per process
(``set_gemv``: the decode bench's ``--gemv``, generation's default); training never takes the
kernel (it records gradients), nor does anything torch.compile traces."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

_gemv = {"on": True}


def set_gemv(on: bool) -> None:
    """Let a decode step's projections run the GEMV kernel on CUDA (default) or always F.linear."""
    _gemv["on"] = bool(on)


def _may_gemv(x: torch.Tensor) -> bool:
    return _gemv["on"] and x.is_cuda and not torch.is_grad_enabled() and not torch.compiler.is_compiling()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the GEMV kernel where it takes the call."""
    if _may_gemv(x):
        from ..kernels.triton import gemv  # imports triton: only where the kernel may run

        if gemv.takes(x, weight):
            return gemv.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def project(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``; a plain ``nn.Linear`` without hooks through :func:`linear` where the GEMV
    kernel may run (anything else, a LoRA wrapper or a hooked module, as itself)."""
    if (type(module) is nn.Linear and _may_gemv(x) and not module._forward_hooks
            and not module._forward_pre_hooks):
        return linear(x, module.weight, module.bias)
    return module(x)
