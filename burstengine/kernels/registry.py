"""The kernel registry: every local attention kernel by name, and the automatic choice.

:func:`get_kernel` looks a name up ("auto": on CUDA an :class:`AutoKernel` that picks per call,
by call, mask, block size and card, the kernel measured faster (kernels/choices.py); on CPU the
kernel on torch's CPU flash attention op (kernels/cpu_flash.py, which hands float64 calls, the
tests' oracle, to the reference kernel); the reference kernel elsewhere).  Which name a call uses
(the ``kernel=`` argument, else ``BURST_KERNEL``) and whether Gluon may run (``BURST_GLUON``) are
decided by attention/planning.py, which passes them here: kernels read no environment (the card
is read from the device's properties).
"""
from __future__ import annotations

import torch

from ..masks import MaskSpec
from . import choices
from .base import Kernel
from .choices import AUTO_TABLE, CARDS
from .cpu_flash import CpuFlashKernel
from .fp8 import Fp8Kernel
from .pieces import large_pairs
from .reference import ReferenceKernel
from .sdpa import CudnnKernel, FlashKernel
from .triton.kernel import TritonKernel, gluon_bwd_takes, gluon_takes

# "fp8" (kernels/fp8.py) runs only where named: forward only, and less precise than the others
KERNELS: dict[str, Kernel] = {k.name: k for k in (ReferenceKernel(), FlashKernel(), CudnnKernel(), TritonKernel(),
                                                   CpuFlashKernel(), Fp8Kernel())}


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
    """Dispatches each call to the kernel its card's rules (kernels/choices.py) give for its call,
    mask, head dim and block size (cuDNN when that kernel cannot run, the reference for a
    MaskSpec then).  ``table``: the rules of every card (``AUTO_TABLE``); ``cards``: the rules
    cards measured otherwise (``CARDS``)."""

    name = "auto"

    def __init__(self, table=None, gluon: bool = True, cards=None):
        self.table = dict(AUTO_TABLE if table is None else table)
        self.cards = dict(CARDS if cards is None else cards)
        self.gluon = gluon  # False (BURST_GLUON=0): no Gluon rule is taken, Triton's kernels run without Gluon
        self._names = {}  # device -> its name, read once

    def available(self, device):
        return torch.device(device).type == "cuda" and torch.cuda.is_available()

    def card(self, device) -> str:
        """The name of ``device``'s card, read from its properties once."""
        if device not in self._names:
            self._names[device] = choices.device_name(device)
        return self._names[device]

    def choose(self, call: str, mask, sq: int, sk: int, card: str = "", head_dim: int | None = None,
               takes=None) -> str:
        """The kernel's name for ``call`` (a call of kernels/choices.py's rules) of a block of
        sq query rows and sk keys on the card named ``card`` (before availability).  ``takes``: a
        function saying whether kernels/gluon takes this call, asked only where a rule offers
        Gluon; a "gluon" rule leads to "triton", whose kernel runs Gluon wherever it takes the
        block."""
        kind = "spec" if isinstance(mask, MaskSpec) else mask
        rules = (choices.card_rules(card, self.cards).get((call, kind, head_dim))
                 or self.table.get((call, kind, head_dim)) or self.table[(call, kind)])
        name = next(n for rows, n in rules if (rows is None or sq <= rows)
                    and (n != "gluon" or (self.gluon and takes is not None and takes())))
        if name == "gluon":
            return "triton"
        if kind == "spec" and name == "triton" and _large_pieces(mask, sq, sk):
            name = "cudnn"
        return name

    def pick(self, call: str, mask, q, k, takes=None) -> Kernel:
        kind = "spec" if isinstance(mask, MaskSpec) else mask
        name = self.choose(call, mask, q.shape[1], k.shape[1], self.card(q.device), q.shape[-1], takes)
        k = _named(name, self.gluon)
        if k.available(q.device):
            return k
        return KERNELS["reference" if kind == "spec" else "cudnn"]

    def forward(self, q, k, v, scale, mask):
        kern = self.pick("forward", mask, q, k, lambda: gluon_takes(q, k, v, mask, gluon=self.gluon))
        return kern.forward(q, k, v, scale, mask)

    def delta(self, out, dout, dtype=torch.float32):
        # one fused pass over dO and O where Triton runs (the torch expression makes float32 copies)
        return _named("triton", self.gluon).delta(out, dout, dtype)

    def forward_into(self, q, k, v, scale, mask, out, lse):
        kern = self.pick("forward_into", mask, q, k, lambda: gluon_takes(q, k, v, mask, out, lse, gluon=self.gluon))
        return kern.forward_into(q, k, v, scale, mask, out, lse)

    def forward_into_runs(self, q, k, v, mask, out, lse) -> str:
        """The kernel :meth:`forward_into` runs for this call, by name ("gluon" where the Triton
        kernel hands it to its Gluon path): what a record says ran."""
        def takes():
            return gluon_takes(q, k, v, mask, out, lse, gluon=self.gluon)

        name = self.pick("forward_into", mask, q, k, takes).name
        return "gluon" if name == "triton" and takes() else name

    def backward(self, dout, q, k, v, lse, delta, scale, mask, out=None):
        kern = self.pick("backward", mask, q, k, lambda: gluon_bwd_takes(q, k, v, mask, dout, gluon=self.gluon))
        return kern.backward(dout, q, k, v, lse, delta, scale, mask, out=out)

    def backward_into(self, dout, q, k, v, lse, delta, scale, mask, dq, dk, dv, out=None):
        kern = self.pick("backward_into", mask, q, k,
                         lambda: gluon_bwd_takes(q, k, v, mask, dout, dq, dk, dv, gluon=self.gluon))
        return kern.backward_into(dout, q, k, v, lse, delta, scale, mask, dq, dk, dv, out=out)


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


__all__ = ["AutoKernel", "AUTO_TABLE", "CARDS", "Kernel", "KERNELS", "get_kernel"]
