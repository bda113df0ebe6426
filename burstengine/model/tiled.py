"""A decoder layer's MLP half run over the sequence a chunk of tokens at a time, in forward and in
backward (ALST's TiledMLP), so that its ffn-wide intermediates exist for one chunk only.

``mlp(h, fn, chunk, params)`` is ``fn(h)`` for a token-wise ``fn`` (the block's ``ffn_norm`` and
SwiGLU MLP): the forward runs ``fn`` on ``chunk`` tokens at a time under no_grad and keeps only
``h``; the backward runs each chunk's forward again with autograd and takes its gradients, chunk
after chunk, summing the parameters' gradients.  What a layer keeps for its MLP is then its input
``h`` (dim-wide) instead of the normed input, gate, up and their product (dim + 3 x ffn-wide), and
its backward holds one chunk's of them: the price is one more forward of the MLP per layer.

The parameters are inputs of the Function (their gradients come out of it, as a Linear's do, so
FSDP2 and ``torch.autograd.grad`` see them).  ``rng=True`` (a model with dropout: LoRA's) saves
torch's RNG state before each chunk's forward and replays it for the chunk's recompute.
"""
from __future__ import annotations

import torch

from ..autograd import once_differentiable


MODES = ("auto", "on", "off")


def check(mode: str, chunk: int) -> None:
    if mode not in MODES:
        raise ValueError(f"tiled_mlp must be one of {list(MODES)}, got {mode!r}")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"tiled_mlp_chunk must be a whole number of tokens >= 1, got {chunk!r}")


def _rng_state(device) -> tuple:
    cuda = device.type == "cuda"
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device) if cuda else None)


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, fn, chunk, rng, *params):
        n = h.shape[1]
        out = None
        states = []
        with torch.no_grad():
            for a in range(0, n, chunk):
                if rng:
                    states.append(_rng_state(h.device))
                y = fn(h[:, a:a + chunk])
                if out is None:
                    out = y.new_empty(y.shape[:1] + (n,) + y.shape[2:])
                out[:, a:a + chunk] = y
        ctx.fn, ctx.chunk, ctx.states = fn, chunk, states
        ctx.save_for_backward(h, *params)
        return out

    @staticmethod
    @once_differentiable("tiled_mlp (the sequence-chunked MLP)")
    def backward(ctx, dy):
        h, *params = ctx.saved_tensors
        need = ctx.needs_input_grad
        need_h, need_p = need[0], need[4:]
        wrt_params = [p for p, r in zip(params, need_p) if r]
        dh = torch.empty_like(h) if need_h else None
        grads = [None] * len(wrt_params)
        n, chunk = h.shape[1], ctx.chunk
        for i, a in enumerate(range(0, n, chunk)):
            hc = h[:, a:a + chunk].detach().requires_grad_(need_h)
            with torch.random.fork_rng(devices=[h.device] if ctx.states and h.is_cuda else [],
                                       enabled=bool(ctx.states)), torch.enable_grad():
                if ctx.states:
                    cpu, dev = ctx.states[i]
                    torch.set_rng_state(cpu)
                    if dev is not None:
                        torch.cuda.set_rng_state(dev, h.device)
                y = ctx.fn(hc)
            wrt = ([hc] if need_h else []) + wrt_params
            got = list(torch.autograd.grad(y, wrt, dy[:, a:a + chunk])) if wrt else []
            if need_h:
                dh[:, a:a + chunk] = got.pop(0)
            grads = [g if s is None else s.add_(g) for s, g in zip(grads, got)]
        it = iter(grads)
        return (dh, None, None, None, *(next(it) if r else None for r in need_p))


def mlp(h: torch.Tensor, fn, chunk: int, params, rng: bool = False) -> torch.Tensor:
    """``fn(h)`` for a token-wise ``fn`` over dim 1 of ``h`` (B, n, ...), run ``chunk`` tokens at a
    time in forward and backward, keeping ``h`` only (one chunk or more: what the memory plan
    counts); ``params``: the parameters ``fn`` uses."""
    if torch.is_grad_enabled():
        return _Tiled.apply(h, fn, chunk, rng, *params)
    if h.shape[1] <= chunk:  # no autograd (inference, a forward under no_grad): chunks, no Function
        return fn(h)
    return torch.cat([fn(h[:, a:a + chunk]) for a in range(0, h.shape[1], chunk)], dim=1)


def chunk_bytes(args, elem: int, chunk: int) -> int:
    """Device bytes one tiled chunk's backward holds: its normed input, gate, up and product, and
    their gradients."""
    return 2 * (args.dim + 3 * args.ffn_dim) * elem * chunk
