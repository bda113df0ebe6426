"""The layers of the decoder: RMSNorm, grouped-query attention's projections and rotary position
embeddings (optionally scaled: :mod:`.rope`; q/k/v biases and per-head q/k RMSNorm as
:class:`~.args.ModelArgs` says), the SwiGLU MLP, and the decoder layer (:class:`Block`) that
joins them around attention.  How a block keeps its activations for backward is a pluggable step
(:mod:`burstengine.model.checkpointing`); what a run of the decoder does besides training's
forward (a KV sink, a decode step's cache, chunked token-wise work) reaches the block as
:class:`Hooks` (:mod:`.decoder`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from . import checkpointing, fused, pointwise, tiled
from .args import ModelArgs
from .context_parallel import ContextParallel, context_parallel_attention


@dataclass(frozen=True)
class Hooks:
    """What one run of the decoder loop does besides training's forward, per layer.

    ``kv_sink(layer, k, v)``: receives each layer's roped keys and values (B, n, kv_heads,
    head_dim) as they are made, before the layer attends (prefill fills a cache; a decode step
    writes its token's slot).  ``attend(layer, q, k, v) -> o``: replaces context-parallel
    attention (a decode step's attention over the cache and the merge over ranks).  ``chunk``:
    run the token-wise parts of each layer (norms, projections, RoPE, MLP) this many tokens at a
    time, so a long prompt's MLP intermediates never exist whole; attention always sees the
    whole shard."""

    kv_sink: Callable | None = None
    attend: Callable | None = None
    chunk: int | None = None


NO_HOOKS = Hooks()


def _by_rows(fn, n: int, chunk: int | None):
    """The tuple of tensors ``fn(a, z)`` gives for token rows [a, z) (dim 1), for all n rows:
    in one call, or ``chunk`` rows at a time into preallocated outputs."""
    if not chunk or n <= chunk:
        return fn(0, n)
    outs = None
    for a in range(0, n, chunk):
        z = min(n, a + chunk)
        part = fn(a, z)
        if outs is None:
            outs = tuple(t.new_empty((t.shape[0], n) + tuple(t.shape[2:])) for t in part)
        for o, t in zip(outs, part):
            o[:, a:z] = t
    return outs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in fp32 whatever the activation dtype (one kernel on GPUs: model/fused.py)
        return fused.rms_norm(x, self.weight, self.eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, n, H, D) rotated by half-split pairs (the HF LLaMA convention), in fp32."""
    return fused.rope(x, cos, sin)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = a.n_heads, a.n_kv_heads, a.head_dim
        self.wq = nn.Linear(a.dim, a.n_heads * a.head_dim, bias=a.qkv_bias)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * a.head_dim, bias=a.qkv_bias)
        self.wo = nn.Linear(a.n_heads * a.head_dim, a.dim, bias=False)
        self.q_norm = RMSNorm(a.head_dim, a.norm_eps) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.norm_eps) if a.qk_norm else None

    def qkv(self, x, cos, sin):
        """Roped q, k and v (B, n, heads, head_dim) of the normed input ``x`` (B, n, dim)."""
        return self.heads(self.wq(x), self.wk(x), self.wv(x), cos, sin)

    def heads(self, q, k, v, cos, sin):
        """The projections q, k, v (B, n, width) as heads, q and k normed (qk_norm) and roped."""
        B, n, _ = q.shape
        q = q.view(B, n, self.n_heads, self.head_dim)
        k = k.view(B, n, self.n_kv_heads, self.head_dim)
        v = v.view(B, n, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(fused.swiglu(self.w1(x), self.w3(x)))


class Block(nn.Module):
    """One decoder layer, written as three stages so that checkpointing policies can choose
    what to keep: ``pre_attention`` (norm, q/k/v, RoPE), ``attend`` (the ring, or the run's
    hook: :class:`Hooks`), ``post_attention`` (output projection, residual, MLP, residual).  ``lean=True`` (the
    ``pointwise`` policy): the same arithmetic, with each norm and the projections it feeds, and
    SwiGLU's gate and ``w2``, as one autograd Function that recomputes the pointwise part in
    backward instead of keeping it (:mod:`.pointwise`)."""

    def __init__(self, a: ModelArgs, policy: str = "none", checkpoint_split: float = 0.5):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = FeedForward(a)
        self.policy = policy
        self.checkpoint_split = checkpoint_split  # the "sequence" policy's: attention outputs kept
        self.window = a.window
        self.cp = ContextParallel()
        self.index = 0  # its place in the model, and the model's Offloader: the "offload" policy's
        self.offloader = None
        self.hooks = NO_HOOKS  # the decoder loop's, for the length of one run
        self.random = False  # it draws random numbers (LoRA dropout): recomputing policies replay the RNG
        self.mlp_chunk = 0  # > 0: the MLP half runs this many tokens at a time (model/tiled.py)

    def pre_attention(self, x, cos, sin, lean: bool = False):
        """The roped q, k, v (B, n, heads, head_dim) of the block input ``x`` (B, n, dim)."""
        if self.hooks.chunk:
            return _by_rows(lambda a, z: self._qkv(x[:, a:z], cos[a:z], sin[a:z], lean), x.shape[1], self.hooks.chunk)
        return self._qkv(x, cos, sin, lean)

    def _qkv(self, x, cos, sin, lean):
        att = self.attention
        if lean:
            return att.heads(*pointwise.norm_linears(x, self.attention_norm, att.wq, att.wk, att.wv), cos, sin)
        return att.qkv(self.attention_norm(x), cos, sin)

    def attend(self, q, k, v, docs=None):
        """Attention over the sequence: context-parallel attention (``self.cp``), or the run's
        hook in its place (:class:`Hooks`); the run's KV sink sees k and v first."""
        hooks = self.hooks
        if hooks.kv_sink is not None:
            hooks.kv_sink(self.index, k, v)
        if hooks.attend is not None:
            return hooks.attend(self.index, q, k, v)
        return context_parallel_attention(q, k, v, self.cp, self.window, docs)

    def post_attention(self, x, o, lean: bool = False):
        """The block output from its input ``x`` and the attention output ``o`` (B, n, heads, head_dim)."""
        if self.hooks.chunk:
            return _by_rows(lambda a, z: (self._residuals(x[:, a:z], o[:, a:z], lean),), x.shape[1],
                            self.hooks.chunk)[0]
        return self._residuals(x, o, lean)

    def _residuals(self, x, o, lean):
        h = x + self.attention.wo(o.flatten(2))
        if self.mlp_chunk:
            return h + tiled.mlp(h, self._mlp, self.mlp_chunk, self._mlp_params(), self.random)
        if lean:
            ff = self.feed_forward
            g, u = pointwise.norm_linears(h, self.ffn_norm, ff.w1, ff.w3)
            return h + pointwise.swiglu_linear(g, u, ff.w2)
        return h + self._mlp(h)

    def _mlp(self, h):
        return self.feed_forward(self.ffn_norm(h))

    def _mlp_params(self):
        return [*self.ffn_norm.parameters(), *self.feed_forward.parameters()]

    def forward(self, x, cos, sin, docs=None):
        return checkpointing.POLICIES[self.policy](self, x, cos, sin, docs)
