"""The one small interface every local attention kernel implements.

Tensors follow the flash-attn convention: q (B, Sq, H, D), k/v (B, Sk, Hkv, D) with H a
multiple of Hkv (query head h uses kv head h // (H // Hkv)).  ``lse`` and ``delta`` are
float32 (B, H, Sq).  ``mask`` is one of ``masks.MASKS`` (CAUSAL and STRICT blocks are
square) or a :class:`~burstengine.masks.MaskSpec` for anything else (windows, documents, block sparsity).
Kernels know nothing about rings: they see one (q block, kv block) pair.

Two entry points per direction: ``forward``/``backward`` return fresh block results, and
``forward_into``/``backward_into`` accumulate into the caller's running buffers (LAO: a
kernel that can fuse the online-softmax merge or the gradient sum overrides them; the
defaults here call the plain ones and merge in torch).
"""
from __future__ import annotations

import torch

from ..masks import CAUSAL, STRICT


def acc_dtype(x) -> torch.dtype:
    """The accumulation dtype of a tensor (or a dtype): float32 for everything but float64
    inputs, which the tests use as an oracle and which keep float64."""
    dtype = x if isinstance(x, torch.dtype) else x.dtype
    return torch.float64 if dtype == torch.float64 else torch.float32


def merge_(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor) -> None:
    """Online-softmax merge of a block result (o, l) into the running (out, lse), in place.

    out: (B, S, H, D) in the accumulation dtype, lse: (B, H, S); views are fine.  A row empty
    on both sides stays (0, -inf) rather than becoming NaN."""
    new = torch.logaddexp(lse, l)
    # both sides empty: new = -inf; subtract 0 so the factors are exp(-inf) = 0, not NaN
    safe = torch.where(torch.isinf(new), 0.0, new)
    a = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    b = torch.exp(l - safe).transpose(1, 2).unsqueeze(-1)
    # addcmul_ promotes o inside the kernel: no fp32 copy of the block result is made
    out.mul_(a).addcmul_(o, b)
    lse.copy_(new)


class Kernel:
    name = "base"
    forward_only = ""  # why a kernel without a backward has none (its message), else empty

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

    def delta(self, out, dout, dtype=torch.float32) -> torch.Tensor:
        """D = rowsum(dO * O) (B, H, S) in ``dtype``, what every backward reads per query row."""
        return (dout.to(dtype) * out.to(dtype)).sum(-1).transpose(1, 2).contiguous()

    def forward_into(self, q, k, v, scale: float, mask, out, lse) -> None:
        """Merge this block's attention into the running ``out`` (B, Sq, H, D) and ``lse``
        (B, H, Sq), both in the accumulation dtype, in place."""
        o, l = self.forward(q, k, v, scale, mask)
        merge_(out, lse, o, l)

    def backward_into(self, dout, q, k, v, lse, delta, scale: float, mask, dq, dk, dv, out=None) -> None:
        """Add this block's gradients into the accumulators ``dq`` (B, Sq, H, D), ``dk`` and
        ``dv`` (B, Sk, Hkv, D), in place (same arguments as :meth:`backward`)."""
        a, b, c = self.backward(dout, q, k, v, lse, delta, scale, mask, out=out)
        dq += a
        dk += b
        dv += c


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
