"""The one small interface every local attention kernel implements.

Tensors follow the flash-attn convention: q (B, Sq, H, D), k/v (B, Sk, Hkv, D) with H a
multiple of Hkv (query head h uses kv head h // (H // Hkv)).  ``lse`` and ``delta`` are
float32 (B, H, Sq).  ``mask`` is one of ``schedule.MASKS``; CAUSAL and STRICT blocks are
square.  Kernels know nothing about rings: they see one (q block, kv block) pair.
"""
from __future__ import annotations

import torch

from ..attention.schedule import CAUSAL, FULL, STRICT


class Kernel:
    name = "base"

    def available(self, device: torch.device) -> bool:
        raise NotImplementedError

    def forward(self, q, k, v, scale: float, mask: str):
        """-> (out (B, Sq, H, D), lse float32 (B, H, Sq)); rows with nothing visible: lse = -inf, out = 0."""
        raise NotImplementedError

    def backward(self, dout, q, k, v, lse, delta, scale: float, mask: str, out=None):
        """Block gradients given the *global* lse and delta = rowsum(dO * O) of the query rows.

        ``out`` (the global output of these rows) may be passed when the caller has it; kernels
        that need it (SDPA) rebuild one from delta otherwise.  Returns (dq, dk, dv), dk/dv with
        Hkv heads.
        """
        raise NotImplementedError


class ShiftStrict(Kernel):
    """Mixin for kernels that only know FULL and CAUSAL: STRICT (j < i) on an n x n block is
    CAUSAL on q[1:] against k[:-1], and query row 0 sees nothing."""

    def _fwd(self, q, k, v, scale, causal):
        raise NotImplementedError

    def _bwd(self, dout, q, k, v, lse, delta, scale, causal, out):
        raise NotImplementedError

    def forward(self, q, k, v, scale, mask):
        if mask != STRICT:
            return self._fwd(q, k, v, scale, mask == CAUSAL)
        B, S, H, D = q.shape
        out = q.new_zeros(B, S, H, v.shape[-1])
        lse = torch.full((B, H, S), float("-inf"), device=q.device, dtype=torch.float32)
        if S > 1:
            o, l = self._fwd(q[:, 1:], k[:, :-1], v[:, :-1], scale, True)
            out[:, 1:] = o
            lse[:, :, 1:] = l
        return out, lse

    def backward(self, dout, q, k, v, lse, delta, scale, mask, out=None):
        if mask != STRICT:
            return self._bwd(dout, q, k, v, lse, delta, scale, mask == CAUSAL, out)
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        if q.shape[1] > 1:
            o = None if out is None else out[:, 1:]
            a, b, c = self._bwd(dout[:, 1:], q[:, 1:], k[:, :-1], v[:, :-1], lse[:, :, 1:], delta[:, :, 1:],
                                scale, True, o)
            dq[:, 1:] = a
            dk[:, :-1] = b
            dv[:, :-1] = c
        return dq, dk, dv


def visible_mask(mask: str, sq: int, sk: int, device) -> torch.Tensor | None:
    """Boolean (sq, sk) visibility for a mask kind, None when everything is visible."""
    if mask == FULL:
        return None
    if sq != sk:
        raise ValueError(f"mask {mask!r} needs a square block, got {sq} x {sk}")
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(0 if mask == CAUSAL else -1)
