"""PyTorch's fused SDPA kernels (flash and cuDNN) called through their aten ops, which return
the log-sum-exp a ring needs.

Three things these ops cannot do are handled here:
* sparse masks (MaskSpec: windows, documents, block-sparse): cut into FULL and CAUSAL pieces
  that cover exactly the visible pairs (kernels/pieces.py); the few specs with no such cut go
  to the reference kernel.
* GQA: the ops want as many kv heads as q heads, so K/V are repeated per group for the call
  and dK/dV summed back.  Only the local copy grows: the ring still moves the small K/V.
* D instead of O: their backward takes ``out`` and computes D = rowsum(dO * out) itself.  The
  burst backward moves D, not O, so when no ``out`` is given we pass
  out' = dO * D / rowsum(dO * dO), for which rowsum(dO * out') = D up to one rounding of out'
  to the input dtype.  Rows whose dO is zero get out' = 0 (their D is 0 unless the lse itself
  carries a gradient).
"""
from __future__ import annotations

import torch

from .base import ShiftStrict
from .pieces import PiecewiseMasks

aten = torch.ops.aten


def _expand_kv(k, v, H):
    g = H // k.shape[2]
    if g == 1:
        return k, v, 1
    return k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2), g


def _reduce_kv(dk, dv, g):
    if g == 1:
        return dk, dv
    B, S, H, D = dk.shape
    return dk.view(B, S, H // g, g, D).sum(3), dv.view(B, S, H // g, g, dv.shape[-1]).sum(3)


def out_from_delta(dout: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """A tensor o with rowsum(dout * o) == delta (rows over the head dim), in dout's dtype."""
    d = dout.float()
    norm = (d * d).sum(-1)  # (B, S, H)
    coef = delta.transpose(1, 2) / torch.where(norm > 0, norm, 1.0)
    return (d * coef.unsqueeze(-1)).to(dout.dtype)


def _bhsd(x):
    return x.transpose(1, 2)


class _SDPABase(PiecewiseMasks, ShiftStrict):
    # sparse MaskSpec blocks run as exact FULL / CAUSAL pieces (kernels/pieces.py)
    def available(self, device):
        return torch.device(device).type == "cuda" and torch.cuda.is_available()


class FlashKernel(_SDPABase):
    name = "flash"

    def _fwd(self, q, k, v, scale, causal):
        H = q.shape[2]
        k, v, _ = _expand_kv(k, v, H)
        res = aten._scaled_dot_product_flash_attention(_bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, False,
                                                       scale=scale)
        return _bhsd(res[0]), res[1].view(q.shape[0], H, q.shape[1])

    def _bwd(self, dout, q, k, v, lse, delta, scale, causal, out):
        B, Sq, H, _ = q.shape
        k, v, g = _expand_kv(k, v, H)
        if out is None:
            out = out_from_delta(dout, delta)
        # cum_seq_* must be undefined (None), not empty: defined ones switch the op to varlen
        empty = torch.empty(0, device=q.device, dtype=torch.int64)
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.contiguous(), None, None,
            Sq, k.shape[1], 0.0, causal, empty, empty, scale=scale)
        dk, dv = _reduce_kv(_bhsd(dk), _bhsd(dv), g)
        return _bhsd(dq), dk, dv


class CudnnKernel(_SDPABase):
    name = "cudnn"

    def _fwd(self, q, k, v, scale, causal):
        H = q.shape[2]
        k, v, _ = _expand_kv(k, v, H)
        res = aten._scaled_dot_product_cudnn_attention(_bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, causal,
                                                       False, scale=scale)
        return _bhsd(res[0]), res[1].reshape(q.shape[0], H, q.shape[1])

    def _bwd(self, dout, q, k, v, lse, delta, scale, causal, out):
        B, Sq, H, _ = q.shape
        k, v, g = _expand_kv(k, v, H)
        if out is None:
            out = out_from_delta(dout, delta)
        # cuDNN keeps lse as (B, H, S, 1); cum_seq_* undefined (defined ones mean nested input)
        empty = torch.empty(0, device=q.device, dtype=torch.int64)
        dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
            _bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.unsqueeze(-1).contiguous(), empty, empty,
            None, None, None, Sq, k.shape[1], 0.0, causal, scale=scale)
        dk, dv = _reduce_kv(_bhsd(dk), _bhsd(dv), g)
        return _bhsd(dq), dk, dv
