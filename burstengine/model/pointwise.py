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
from .lora import LoraLinear


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., width) as (tokens, width)."""
    return t.reshape(-1, t.shape[-1])


def _forward(ctx, fn, inputs, params):
    """(F.linear(a, W_i, b_i) for each i), a = fn(*inputs); keeps the inputs and the weights,
    not ``a``.  ``params``: W_0, b_0, W_1, b_1, ... (a bias may be None)."""
    weights, biases = params[0::2], params[1::2]
    ctx.bias_dtypes = [None if b is None else b.dtype for b in biases]
    ctx.set_materialize_grads(False)  # an unused output costs no matmul in backward
    ctx.save_for_backward(*inputs, *weights)  # not a: backward recomputes it
    a = fn(*inputs)
    return tuple(F.linear(a, W, b) for W, b in zip(weights, biases))


def _backward(ctx, grads, fn, first: int) -> tuple:
    """The gradients of :func:`_forward`'s inputs: ``a`` recomputed from the kept inputs, each
    weight's and bias's from it, the inputs' through ``fn``.  ``first``: the position of W_0 among
    the Function's inputs."""
    n_in = len(ctx.saved_tensors) - (len(ctx.needs_input_grad) - first) // 2  # the kept inputs, then weights
    inputs, weights = ctx.saved_tensors[:n_in], ctx.saved_tensors[n_in:]
    need = ctx.needs_input_grad
    need_in = need[:n_in]
    out = [None] * len(need)
    with torch.enable_grad():
        rs = [t.detach().requires_grad_(r) for t, r in zip(inputs, need_in)]
        a = fn(*rs)
    a_rows = _rows(a.detach())
    da = None
    for i, (g, W) in enumerate(zip(grads, weights)):
        if g is None:
            continue
        g_rows = _rows(g)
        if any(need_in):
            da = g_rows @ W if da is None else da.addmm_(g_rows, W)
        if need[first + 2 * i]:
            out[first + 2 * i] = (g_rows.t() @ a_rows).to(W.dtype)
        if need[first + 2 * i + 1]:
            out[first + 2 * i + 1] = g_rows.sum(0).to(ctx.bias_dtypes[i])
    if da is not None:
        got = iter(torch.autograd.grad(a, [t for t, r in zip(rs, need_in) if r], da.view_as(a)))
        for j, r in enumerate(need_in):
            out[j] = next(got) if r else None
    return tuple(out)


class _NormLinears(torch.autograd.Function):
    """(F.linear(n, W_i, b_i) for each i), n = rms_norm(x, w, eps, plus_one).  Inputs: x, w, eps,
    plus_one, then W_0, b_0, W_1, b_1, ... (a bias may be None)."""

    @staticmethod
    def forward(ctx, x, w, eps, plus_one, *params):
        ctx.eps, ctx.plus_one = eps, plus_one
        return _forward(ctx, lambda x, w: fused.rms_norm(x, w, eps, plus_one), (x, w), params)

    @staticmethod
    @once_differentiable("norm_linears (the pointwise checkpointing policy's norm and projections)")
    def backward(ctx, *grads):
        return _backward(ctx, grads, lambda x, w: fused.rms_norm(x, w, ctx.eps, ctx.plus_one), 4)


class _GateLinears(torch.autograd.Function):
    """(F.linear(gate(g, u), W_i, b_i) for each i) for a gate of :data:`.fused.GATES`.  Inputs: g,
    u, the activation's name, then W_0, b_0, W_1, b_1, ... (a bias may be None)."""

    @staticmethod
    def forward(ctx, g, u, activation, *params):
        ctx.gate = fused.GATES[activation]
        return _forward(ctx, ctx.gate, (g, u), params)

    @staticmethod
    @once_differentiable("gate_linear (the pointwise checkpointing policy's MLP gate and w2)")
    def backward(ctx, *grads):
        return _backward(ctx, grads, ctx.gate, 3)


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
    """``tuple(lin(norm(x)) for lin in linears)`` for an RMSNorm-like ``norm`` (``weight``, ``eps``,
    ``plus_one``) and Linear-like ``linears`` (``weight``, ``bias`` or None; LoRA ones with their adapters),
    keeping ``x`` but not ``norm(x)`` for backward."""
    feeds = _feeds(linears)
    params = [p for lin in feeds for p in (lin.weight, lin.bias)]
    return _adapted(linears, _NormLinears.apply(x, norm.weight, norm.eps, norm.plus_one, *params))


def gate_linear(g: torch.Tensor, u: torch.Tensor, linear, activation: str = "silu") -> torch.Tensor:
    """``linear(act(g) * u)`` (``activation``: silu, SwiGLU; gelu_tanh, GeGLU; a LoRA ``linear``
    with its adapter), keeping ``g`` and ``u`` but not their product for backward."""
    feeds = _feeds([linear])
    params = [p for lin in feeds for p in (lin.weight, lin.bias)]
    return _adapted([linear], _GateLinears.apply(g, u, activation, *params))[0]
