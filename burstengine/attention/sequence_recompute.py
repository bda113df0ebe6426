"""Sequence-level selective checkpointing (BurstEngine §3.2) for one transformer block.

Full activation checkpointing keeps only a block's input and recomputes everything in the
backward, attention included.  Selective checkpointing++ also keeps the attention output, so
the backward recomputes only the cheap parts (norms, projections, MLP), at the price of an
(S, H*D) tensor per layer.  Under a causal mask the cost of recomputing a query's attention
grows with its position, while the cost of storing its output does not; so store the output
of the *back* of the sequence and recompute only the *front*.

``split`` is the fraction of each rank's local tokens, counted from the back, whose attention
output (and lse) is kept: 0 is full checkpointing (only the block input is kept), 1 is
selective checkpointing++ (the whole attention output is kept).

What "front" means under context parallelism.  The front is the first ``m = n - round(split*n)``
of a rank's n local tokens, on every rank.  Within a shard tokens are in increasing global
position in every layout, so these are the rank's earliest tokens, the cheapest of its own to
recompute, and every rank keeps the same number of outputs (balanced memory).  Per layout:

* striped: local token i is global i*G + r, so the fronts of all ranks together are the global
  prefix of m*G tokens, and the recompute is causal attention over that prefix alone: its work
  is (1-split)^2 of the block's attention, balanced across ranks, and only the first m K/V rows
  of each shard travel the ring.
* zigzag: the front is a prefix of the rank's early chunk (split >= 1/2) or that chunk and a
  prefix of the late one.  The early chunk of rank r sees the early chunks of ranks < r, so
  these travel, and the recompute work grows about linearly in (1 - split), unevenly across
  ranks (rank G-1 most).
* contiguous: rank r's front sees all of ranks < r: work linear in (1 - split), unbalanced.

So striped gets the full benefit of the paper's quadratic saving; zigzag and contiguous get a
memory/compute trade-off that is linear.  Without a causal mask there is no asymmetry and any
split is a plain linear trade.

The wrapper is model-agnostic: the block is given as two callables.

    y = seq_checkpoint(x, pre_attn, post_attn, split=0.5, group=cp_group, causal=True,
                       layout="striped")

``pre_attn(x) -> (q, k, v)`` (norm, projections, RoPE; q (B, n, H, D), k/v (B, n, Hkv, D)) and
``post_attn(x, attn_out) -> y`` (output projection, residual, MLP) are run under no_grad in the
forward and again with autograd in the backward; the attention between them is BurstAttention
over ``group`` with the given arguments.  Gradients of parameters the callables use are
accumulated into their ``.grad`` during the backward (as torch.utils.checkpoint with
use_reentrant=True does), so use ``loss.backward()``, not ``torch.autograd.grad``.  The callables
must be deterministic (no dropout: RNG state is not replayed).
"""
from __future__ import annotations

import torch

from ..autograd import once_differentiable
from .call import AttnCall, MaskArgs
from .loops import run_attention
from .prefix import prefix_forward
from .prepare import prepare_call


def front_length(n: int, split: float) -> int:
    """Local tokens whose attention is recomputed: the first n - round(split * n)."""
    return n - int(round(split * n))


class _SeqCkpt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, _anchor, pre_attn, post_attn, call, split):
        dev = x.device.type
        ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        with torch.no_grad():
            q, k, v = pre_attn(x)
            # checked and planned here, where q/k/v exist, and still before any communication
            run = prepare_call(q, k, v, call)
            out, lse = run_attention(q, k.contiguous(), v.contiguous(), run)
            y = post_attn(x, out)
        m = front_length(q.shape[1], split)
        # clone: a slice would keep the whole output's storage alive
        ctx.save_for_backward(x, out[:, m:].clone(), lse[:, :, m:].clone())
        ctx.fns, ctx.run, ctx.m = (pre_attn, post_attn), run, m
        return y

    @staticmethod
    @once_differentiable("seq_checkpoint")
    def backward(ctx, dy):
        x, out_back, lse_back = ctx.saved_tensors
        pre_attn, post_attn = ctx.fns
        run = ctx.run
        enabled, dtype = ctx.autocast
        xd = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=enabled):
            q, k, v = pre_attn(xd)
            # inside enable_grad: a backward runs with grad mode off, and a copy made there
            # would cut k and v off from x
            k, v = k.contiguous(), v.contiguous()
        with torch.no_grad():
            out_front, lse_front = prefix_forward(q.detach(), k.detach(), v.detach(), run, ctx.m)
            out = torch.cat([out_front, out_back], dim=1)
            lse = torch.cat([lse_front, lse_back], dim=2)
        del out_front, lse_front
        with torch.enable_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=enabled):
            o, _ = run_attention(q, k, v, run, (out, lse))
            y = post_attn(xd, o)
        torch.autograd.backward(y, dy)
        return xd.grad if x.requires_grad else None, None, None, None, None, None


def seq_checkpoint(x, pre_attn, post_attn, *, split=0.5, group=None, causal=True, layout="contiguous",
                   softmax_scale=None, backward="auto", kernel=None):
    """``post_attn(x, burst_attn_func(*pre_attn(x), ...))`` with sequence-level selective
    checkpointing: the attention output of the back ``split`` of this rank's tokens is kept,
    the front is recomputed in the backward, everything else is recomputed from ``x``.

    See the module docstring for what "front" means under each layout.  ``split`` in [0, 1]:
    0 = full checkpointing, 1 = keep the whole attention output.  The remaining arguments are
    burst_attn_func's.  Every rank of ``group`` must use the same split.
    """
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not (callable(pre_attn) and callable(post_attn)):
        raise ValueError("pre_attn and post_attn must be callables")
    if isinstance(split, bool) or not isinstance(split, (int, float)) or not 0.0 <= split <= 1.0:
        raise ValueError(f"split must be a number in [0, 1] (0 = recompute all attention, 1 = store all), "
                         f"got {split!r}")
    call = AttnCall(group=group, layout=layout, softmax_scale=softmax_scale, backward=backward, kernel=kernel,
                    mask=MaskArgs(causal=causal))
    # an input that requires grad, so that the backward runs (and reaches the parameters) even
    # when x itself does not require grad
    anchor = torch.empty(0, device=x.device, requires_grad=True)
    return _SeqCkpt.apply(x, anchor, pre_attn, post_attn, call, float(split))
