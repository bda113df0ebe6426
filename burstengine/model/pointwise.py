"""An RMSNorm with the projections it feeds, and the MLP's gate (SwiGLU or GeGLU) with the
projection it feeds, as autograd Functions that recompute the pointwise part in backward instead
of keeping it.

``F.linear(rms_norm(x))`` under plain autograd keeps both ``x`` (for the norm's backward) and the
normed ``n`` (for the linear's weight gradient); ``F.linear(silu(g) * u)`` keeps ``g``, ``u`` and the
product.  These Functions keep ``x`` (resp. ``g`` and ``u``) and the weights, and recompute ``n``
(resp. ``act(g) * u``) in backward, one pointwise kernel each (:mod:`.fused`): the matmuls are never
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


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., width) as (tokens, width)."""
    return t.reshape(-1, t.shape[-1])


_LEAD = 4  # _NormLinears' inputs before the projections' (x, w, eps, plus_one)


class _NormLinears(torch.autograd.Function):
    """(F.linear(n, W_i, b_i) for each i), n = rms_norm(x, w, eps, plus_one).  Inputs: x, w, eps,
    plus_one, then W_0, b_0, W_1, b_1, ... (a bias may be None)."""

    @staticmethod
    def forward(ctx, x, w, eps, plus_one, *params):
        n = fused.rms_norm(x, w, eps, plus_one)
        weights, biases = params[0::2], params[1::2]
        ctx.eps, ctx.plus_one = eps, plus_one
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
            n = fused.rms_norm(xr, wr, ctx.eps, ctx.plus_one)
        n_rows = _rows(n.detach())
        dn = None
        for i, (g, W) in enumerate(zip(grads, weights)):
            if g is None:
                continue
            g_rows = _rows(g)
            if need_x or need_w:
                dn = g_rows @ W if dn is None else dn.addmm_(g_rows, W)
            if need[_LEAD + 2 * i]:
                out[_LEAD + 2 * i] = (g_rows.t() @ n_rows).to(W.dtype)
            if need[_LEAD + 1 + 2 * i]:
                out[_LEAD + 1 + 2 * i] = g_rows.sum(0).to(ctx.bias_dtypes[i])
        if dn is not None:
            wrt = [t for t, r in ((xr, need_x), (wr, need_w)) if r]
            dxw = iter(torch.autograd.grad(n, wrt, dn.view_as(n)))
            out[0] = next(dxw) if need_x else None
            out[1] = next(dxw) if need_w else None
        return tuple(out)


class _GateLinear(torch.autograd.Function):
    """F.linear(gate(g, u), W, b) (b may be None) for a gate of :data:`.fused.GATES`."""

    @staticmethod
    def forward(ctx, g, u, W, b, activation):
        ctx.bias_dtype = None if b is None else b.dtype
        ctx.gate = fused.GATES[activation]
        ctx.save_for_backward(g, u, W)  # not act(g) * u: backward recomputes it
        return F.linear(ctx.gate(g, u), W, b)

    @staticmethod
    @once_differentiable("gate_linear (the pointwise checkpointing policy's MLP gate and w2)")
    def backward(ctx, dy):
        g, u, W = ctx.saved_tensors
        need_g, need_u, need_W, need_b, _ = ctx.needs_input_grad
        with torch.enable_grad():
            gr = g.detach().requires_grad_(need_g)
            ur = u.detach().requires_grad_(need_u)
            a = ctx.gate(gr, ur)
        dy_rows = _rows(dy)
        dW = (dy_rows.t() @ _rows(a.detach())).to(W.dtype) if need_W else None
        db = dy_rows.sum(0).to(ctx.bias_dtype) if need_b else None
        dg = du = None
        if need_g or need_u:
            wrt = [t for t, r in ((gr, need_g), (ur, need_u)) if r]
            dgu = iter(torch.autograd.grad(a, wrt, (dy_rows @ W).view_as(a)))
            dg = next(dgu) if need_g else None
            du = next(dgu) if need_u else None
        return dg, du, dW, db, None


def norm_linears(x: torch.Tensor, norm, *linears) -> tuple[torch.Tensor, ...]:
    """``tuple(lin(norm(x)) for lin in linears)`` for an RMSNorm-like ``norm`` (``weight``, ``eps``,
    ``plus_one``) and Linear-like ``linears`` (``weight``, ``bias`` or None), keeping ``x`` but not
    ``norm(x)`` for backward."""
    params = [p for lin in linears for p in (lin.weight, lin.bias)]
    return _NormLinears.apply(x, norm.weight, norm.eps, norm.plus_one, *params)


def gate_linear(g: torch.Tensor, u: torch.Tensor, linear, activation: str = "silu") -> torch.Tensor:
    """``linear(act(g) * u)`` (``activation``: silu, SwiGLU; gelu_tanh, GeGLU), keeping ``g`` and
    ``u`` but not their product for backward."""
    return _GateLinear.apply(g, u, linear.weight, linear.bias, activation)
