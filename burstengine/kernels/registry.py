"""The kernel registry: every local attention kernel by name, and the automatic choice.

:func:`get_kernel` looks a name up ("auto": on CUDA an :class:`AutoKernel` that picks per call,
by direction, mask and block size, the kernel measured faster (``AUTO_TABLE``); on CPU the
kernel on torch's CPU flash attention op (kernels/cpu_flash.py, which hands float64 calls, the
tests' oracle, to the reference kernel); the reference kernel elsewhere).  Which name a call uses (the ``kernel=`` argument, else ``BURST_KERNEL``) and
whether Gluon may run (``BURST_GLUON``) are decided by attention/planning.py, which passes them
here: kernels read no environment.
"""
from __future__ import annotations

import torch

from ..masks import CAUSAL, FULL, STRICT, MaskSpec
from .base import Kernel
from .cpu_flash import CpuFlashKernel
from .fp8 import Fp8Kernel
from .pieces import large_pairs
from .reference import ReferenceKernel
from .sdpa import CudnnKernel, FlashKernel
from .triton.kernel import TritonKernel, gluon_bwd_takes, gluon_forward_into

# "fp8" (kernels/fp8.py) runs only where named: forward only, and less precise than the others
KERNELS: dict[str, Kernel] = {k.name: k for k in (ReferenceKernel(), FlashKernel(), CudnnKernel(), TritonKernel(),
                                                   CpuFlashKernel(), Fp8Kernel())}

# Which kernel "auto" runs on CUDA for each (direction, mask): (most query rows in the block, kernel)
# pairs, first match wins; before the table, a forward_into (ring step) of a full/causal/strict block
# that kernels/gluon/fwd.py takes (Hopper, lengths multiples of 128) runs there: 1.01-1.38x cuDNN +
# the torch merge on every ring-step case of benchmarks/results/lao_bench.json.  The table:
# "spec" is any MaskSpec (windows, documents, block masks), which SDPA cannot express.  Elsewhere
# the Triton forward_into beats cuDNN + merge only on STRICT blocks of up to 8K rows (SDPA pays a
# shifted call there); the plain forward in gluon runs at 0.94-1.05x cuDNN, so cuDNN keeps it.
# Before the table too, a backward (plain or ring step) that kernels/gluon/bwd.py takes runs there:
# 1.00-1.05x cuDNN at 16K-128K tokens, causal, 24 q / 8 kv heads, on H200 (gluon_bwd_*_h200.json), and
# 1.03-1.23x cuDNN + the gradient adds on every ring-step case of lao_bench.json;
# the table's cuDNN rows are for the blocks it does not take (not Hopper, d != 128, lengths not
# multiples of 128).
AUTO_TABLE = {
    ("forward", FULL): [(None, "cudnn")],
    ("forward", CAUSAL): [(None, "cudnn")],
    ("forward", STRICT): [(8192, "triton"), (None, "cudnn")],
    ("forward", "spec"): [(None, "triton")],
    ("backward", FULL): [(None, "cudnn")],
    ("backward", CAUSAL): [(None, "cudnn")],
    ("backward", STRICT): [(None, "cudnn")],
    ("backward", "spec"): [(None, "triton")],
}


# A MaskSpec block whose FULL/CAUSAL pieces (kernels/pieces.py) are mostly large goes to cuDNN
# piece by piece rather than to Triton: "mostly" = at least half the visible pairs lie in pieces
# with at least this many query rows and keys.  Measured on one H200 at 128K tokens, fwd+bwd,
# Triton vs cuDNN pieces (benchmarks/results/sparse_1gpu_{triton,cudnn}.json): window 4K 89 vs
# 132 ms (many small pieces, a launch and a merge each), 16K 283 vs 285, 32K 512 vs 465; packed
# documents of 1K-64K tokens 217 vs 201.
# Packed documents never go to cuDNN pieces: their lengths change from batch to batch, and each
# new piece shape makes cuDNN build an execution plan on the host.  In training (a 3B model at 64K
# tokens on one H200, new documents every step) the GPU sat idle 1.46 s of a 5.45 s step that
# way; with Triton the step took 4.08 s with 0.03 s idle (benchmarks/results/
# profile_3b_64k_docmask_{auto,triton}.json).  The 201 vs 217 ms above reused one mask.
SPEC_PIECE_ROWS = 8192


def _large_pieces(mask: MaskSpec, sq: int, sk: int) -> bool:
    if mask.q_doc is not None:
        return False
    big, total = large_pairs(mask, sq, sk, SPEC_PIECE_ROWS)
    return 2 * big >= total > 0


class AutoKernel(Kernel):
    """Dispatches each call to ``AUTO_TABLE``'s kernel for its direction, mask and block size
    (cuDNN when Triton is missing, the reference for a MaskSpec then)."""

    name = "auto"

    def __init__(self, table=None, gluon: bool = True):
        self.table = dict(AUTO_TABLE if table is None else table)
        self.gluon = gluon  # False (BURST_GLUON=0): Triton's kernels run without their Gluon paths

    def available(self, device):
        return torch.device(device).type == "cuda" and torch.cuda.is_available()

    def choose(self, direction: str, mask, sq: int, sk: int) -> str:
        """The kernel's name for a block of sq query rows and sk keys (before availability)."""
        kind = "spec" if isinstance(mask, MaskSpec) else mask
        name = next(n for rows, n in self.table[(direction, kind)] if rows is None or sq <= rows)
        if kind == "spec" and name == "triton" and _large_pieces(mask, sq, sk):
            name = "cudnn"
        return name

    def pick(self, direction: str, mask, q, k) -> Kernel:
        kind = "spec" if isinstance(mask, MaskSpec) else mask
        k = _named(self.choose(direction, mask, q.shape[1], k.shape[1]), self.gluon)
        if k.available(q.device):
            return k
        return KERNELS["reference" if kind == "spec" else "cudnn"]

    def forward(self, q, k, v, scale, mask):
        return self.pick("forward", mask, q, k).forward(q, k, v, scale, mask)

    def delta(self, out, dout, dtype=torch.float32):
        # one fused pass over dO and O where Triton runs (the torch expression makes float32 copies)
        return _named("triton", self.gluon).delta(out, dout, dtype)

    def forward_into(self, q, k, v, scale, mask, out, lse):
        if gluon_forward_into(q, k, v, scale, mask, out, lse, gluon=self.gluon):
            return
        return self.pick("forward", mask, q, k).forward_into(q, k, v, scale, mask, out, lse)

    def backward(self, dout, q, k, v, lse, delta, scale, mask, out=None):
        if gluon_bwd_takes(q, k, v, mask, dout, gluon=self.gluon):
            return _named("triton", self.gluon).backward(dout, q, k, v, lse, delta, scale, mask, out=out)
        return self.pick("backward", mask, q, k).backward(dout, q, k, v, lse, delta, scale, mask, out=out)

    def backward_into(self, dout, q, k, v, lse, delta, scale, mask, dq, dk, dv, out=None):
        if gluon_bwd_takes(q, k, v, mask, dout, dq, dk, dv, gluon=self.gluon):
            return _named("triton", self.gluon).backward_into(dout, q, k, v, lse, delta, scale, mask, dq, dk, dv,
                                                              out=out)
        return self.pick("backward", mask, q, k).backward_into(dout, q, k, v, lse, delta, scale, mask, dq, dk, dv,
                                                            out=out)


_AUTO = {True: AutoKernel(), False: AutoKernel(gluon=False)}
_NO_GLUON = {"triton": TritonKernel(gluon=False)}  # the kernels whose Gluon paths can be turned off


def _named(name: str, gluon: bool) -> Kernel:
    return KERNELS[name] if gluon or name not in _NO_GLUON else _NO_GLUON[name]


def get_kernel(name: str | None, device, gluon: bool = True) -> Kernel:
    """The kernel called ``name`` (None: "auto") for ``device``; ``gluon=False`` keeps Triton's
    kernels off their Gluon paths.  Raises ValueError for an unknown name or a kernel that
    cannot run on ``device``."""
    name = name or "auto"
    device = torch.device(device)
    if name == "auto":
        auto = _AUTO[bool(gluon)]
        if auto.available(device):
            return auto
        return KERNELS["cpu_flash"] if device.type == "cpu" else KERNELS["reference"]
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; expected 'auto' or one of {sorted(KERNELS)}")
    k = _named(name, gluon)
    if not k.available(device):
        raise ValueError(f"kernel {name!r} cannot run on device {device}")
    return k


__all__ = ["AutoKernel", "AUTO_TABLE", "Kernel", "KERNELS", "get_kernel"]
