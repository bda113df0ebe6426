"""An RMSNorm with the projections it feeds, and SwiGLU's gate with the projection it feeds, as
autograd Functions that recompute the pointwise part in backward instead of keeping it.

``F.linear(rms_norm(x))`` under plain autograd keeps both ``x`` (for the norm's backward) and the
normed ``n`` (for the linear's weight gradient); ``F.linear(silu(g) * u)`` keeps ``g``, ``u`` and the
product.  These Functions keep ``x`` (resp. ``g`` and ``u``) and the weights, and recompute ``n``
(resp. ``silu(g) * u``) in backward, one pointwise kernel each (:mod:`.fused`): the matmuls are never
run again.  The ``pointwise`` checkpointing policy (:mod:`.checkpointing`) is built on them.  Their
backward calls ``torch.autograd.grad``, which torch.compile(fullgraph=True) does not trace.

The weights are the modules' parameters themselves, saved as ``nn.Linear`` saves its weight (FSDP2
unshards them before the block's forward and again before its backward).  Gradients come out in the
dtypes of the tensors they belong to, as ``nn.Linear``'s do.  The backward is not differentiable:
differentiating its gradients again raises (:func:`burstengine.autograd.once_differentiable`;
torch's own decorator would let ``torch.autograd.grad(second, params)`` return second-order
gradients that silently miss these Functions' terms).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..autograd import once_differentiable
from . import fused
from .lora import LoraLinear


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., width) as (tokens, width)."""
    return t.reshape(-1, t.shape[-1])


class _NormLinears(torch.autograd.Function):
    """(F.linear(n, W_i, b_i) for each i), n = rms_norm(x, w, eps).  Inputs: x, w, eps, then
    W_0, b_0, W_1, b_1, ... (a bias may be None)."""

    @staticmethod
    def forward(ctx, x, w, eps, *params):
        n = fused.rms_norm(x, w, eps)
        weights, biases = params[0::2], params[1::2]
        ctx.eps = eps
        ctx.bias_dtypes = [None if b is None else b.dtype for b in biases]
        ctx.set_materialize_grads(False)  # an unused output costs no matmul in backward
        ctx.save_for_backward(x, w, *weights)  # not n: backward recomputes it
        return tuple(F.linear(n, W, b) for W, b in zip(weights, biases))

    @staticmethod
    @once_differentiable("norm_linears (the pointwise checkpointing policy's norm and projections)")
    def backward(ctx, *grads):
        x, w, *weights = ctx.saved_tensors
        need = ctx.needs_input_grad
        need_x, need_w = need[0], need[1]
        out = [None] * len(need)
        with torch.enable_grad():
            xr = x.detach().requires_grad_(need_x)
            wr = w.detach().requires_grad_(need_w)
            n = fused.rms_norm(xr, wr, ctx.eps)
        n_rows = _rows(n.detach())
        dn = None
        for i, (g, W) in enumerate(zip(grads, weights)):
            if g is None:
                continue
            g_rows = _rows(g)
            if need_x or need_w:
                dn = g_rows @ W if dn is None else dn.addmm_(g_rows, W)
            if need[3 + 2 * i]:
                out[3 + 2 * i] = (g_rows.t() @ n_rows).to(W.dtype)
            if need[4 + 2 * i]:
                out[4 + 2 * i] = g_rows.sum(0).to(ctx.bias_dtypes[i])
        if dn is not None:
            wrt = [t for t, r in ((xr, need_x), (wr, need_w)) if r]
            dxw = iter(torch.autograd.grad(n, wrt, dn.view_as(n)))
            out[0] = next(dxw) if need_x else None
            out[1] = next(dxw) if need_w else None
        return tuple(out)


class _SwigluLinears(torch.autograd.Function):
    """(F.linear(silu(g) * u, W_i, b_i) for each i).  Inputs: g, u, then W_0, b_0, W_1, b_1, ...
    (a bias may be None)."""

    @staticmethod
    def forward(ctx, g, u, *params):
        weights, biases = params[0::2], params[1::2]
        ctx.bias_dtypes = [None if b is None else b.dtype for b in biases]
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(g, u, *weights)  # not silu(g) * u: backward recomputes it
        a = fused.swiglu(g, u)
        return tuple(F.linear(a, W, b) for W, b in zip(weights, biases))

    @staticmethod
    @once_differentiable("swiglu_linear (the pointwise checkpointing policy's SwiGLU and w2)")
    def backward(ctx, *grads):
        g, u, *weights = ctx.saved_tensors
        need = ctx.needs_input_grad
        need_g, need_u = need[0], need[1]
        out = [None] * len(need)
        with torch.enable_grad():
            gr = g.detach().requires_grad_(need_g)
            ur = u.detach().requires_grad_(need_u)
            a = fused.swiglu(gr, ur)
        a_rows = _rows(a.detach())
        da = None
        for i, (dy, W) in enumerate(zip(grads, weights)):
            if dy is None:
                continue
            dy_rows = _rows(dy)
            if need_g or need_u:
                da = dy_rows @ W if da is None else da.addmm_(dy_rows, W)
            if need[2 + 2 * i]:
                out[2 + 2 * i] = (dy_rows.t() @ a_rows).to(W.dtype)
            if need[3 + 2 * i]:
                out[3 + 2 * i] = dy_rows.sum(0).to(ctx.bias_dtypes[i])
        if da is not None:
            wrt = [t for t, r in ((gr, need_g), (ur, need_u)) if r]
            dgu = iter(torch.autograd.grad(a, wrt, da.view_as(a)))
            out[0] = next(dgu) if need_g else None
            out[1] = next(dgu) if need_u else None
        return tuple(out)


def _feeds(linears) -> list:
    """The linears a Function runs on its (recomputed) input: each of ``linears``, then the
    ``lora_A`` of each LoRA one (:mod:`.lora`), whose output the projection adds back."""
    adapted = [lin for lin in linears if isinstance(lin, LoraLinear)]
    for lin in adapted:
        if lin.p and lin.training:
            raise ValueError("the pointwise checkpointing policy cannot run LoRA dropout (its backward recomputes "
                             "the adapter's input without the RNG): set lora.dropout=0 or another policy")
    return list(linears) + [lin.lora_A for lin in adapted]


def _adapted(linears, outs) -> tuple[torch.Tensor, ...]:
    """The outputs of ``linears`` from a Function's outputs over :func:`_feeds`: a LoRA
    projection's base output plus its adapter's."""
    rest = iter(outs[len(linears):])
    return tuple(lin.adapt(y, next(rest)) if isinstance(lin, LoraLinear) else y for lin, y in zip(linears, outs))


def norm_linears(x: torch.Tensor, norm, *linears) -> tuple[torch.Tensor, ...]:
    """``tuple(lin(norm(x)) for lin in linears)`` for an RMSNorm-like ``norm`` (``weight``, ``eps``)
    and Linear-like ``linears`` (``weight``, ``bias`` or None; LoRA ones with their adapters),
    keeping ``x`` but not ``norm(x)`` for backward."""
    feeds = _feeds(linears)
    params = [p for lin in feeds for p in (lin.weight, lin.bias)]
    return _adapted(linears, _NormLinears.apply(x, norm.weight, norm.eps, *params))


def swiglu_linear(g: torch.Tensor, u: torch.Tensor, linear) -> torch.Tensor:
    """``linear(silu(g) * u)`` (a LoRA ``linear`` with its adapter), keeping ``g`` and ``u`` but not
    their product for backward."""
    feeds = _feeds([linear])
    params = [p for lin in feeds for p in (lin.weight, lin.bias)]
    return _adapted([linear], _SwigluLinears.apply(g, u, *params))[0]
