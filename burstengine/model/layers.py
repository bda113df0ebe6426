"""The layers of the decoder: RMSNorm, grouped-query attention's projections and rotary position
embeddings (optionally scaled: :mod:`.rope`; q/k/v biases and per-head q/k RMSNorm as
:class:`~.args.ModelArgs` says), the gated MLP (SwiGLU, or Gemma's GeGLU), and the decoder layer
(:class:`Block`) that joins them around attention (Gemma: with sandwich norms, a window and a
RoPE of its own per layer).  How a block keeps its activations for backward is a pluggable step
(:mod:`burstengine.model.recompute`); what a run of the decoder does besides training's
forward (a KV sink, a decode step's cache, chunked token-wise work) reaches the block as
:class:`Hooks` (:mod:`.decoder`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from . import fused, pointwise, recompute, tiled
from .args import ModelArgs
from .context_parallel import ContextParallel, context_parallel_attention
from .projection import linear, project


@dataclass(frozen=True)
class Hooks:
    """What one run of the decoder loop does besides training's forward, per layer.

    ``kv_sink(layer, k, v)``: receives each layer's roped keys and values (B, n, kv_heads,
    head_dim) as they are made, before the layer attends (prefill fills a cache; a decode step
    writes its token's slot).  ``attend(layer, q, k, v) -> o``: replaces context-parallel
    attention (a decode step's attention over the cache and the merge over ranks).  ``chunk``:
    run the token-wise parts of each layer (norms, projections, RoPE, MLP) this many tokens at a
    time, so a long prompt's MLP intermediates never exist whole; attention always sees the
    whole shard.

    Tensor parallelism (:mod:`.tensor_parallel`): ``reduce(x)`` sums a row-parallel projection's
    partial outputs over the ranks (after wo and after w2, before each residual add);
    ``block(layer_module) -> module`` runs a layer as another module (a prefill of a model that
    owns only its slices: the layer at full width, its weights gathered); ``raw_qkv``: the layer
    hands ``attend`` its q, k, v as the projections make them, neither q/k-normed nor roped (a
    decode step's tensor-parallel gather does both after it, in the kernel that unpacks the
    heads: inference/step.py)."""

    kv_sink: Callable | None = None
    attend: Callable | None = None
    chunk: int | None = None
    reduce: Callable | None = None
    block: Callable | None = None
    raw_qkv: bool = False


NO_HOOKS = Hooks()
# tokens (over the batch) per piece of a long shard's token-wise work in inference by default: an
# 8B model's MLP intermediates are then ~1.4 GB whatever the prompt (a 1M-token prompt on 2 ranks
# holds 512K tokens per rank: 44 GB whole), and the matmuls are long enough to run at full speed
CHUNK = 16384


def _whole(x):
    """A projection's output that is already whole (no tensor parallelism)."""
    return x


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


def _rows(t: torch.Tensor, a: int, z: int) -> torch.Tensor:
    """Token rows [a, z) of ``t`` (B, n, ...).  With one sequence, as a view with the strides of a
    tensor of that shape (the batch dim's stride is then z - a rows, not n): a compiled fused op
    guards on strides, and the slice of a longer shard would compile it again."""
    return t[0, a:z][None] if t.shape[0] == 1 else t[:, a:z]


class RMSNorm(nn.Module):
    """x / rms(x) scaled by ``weight``, or by 1 + ``weight`` (``plus_one``: Gemma's, whose weights
    are stored as HF stores them)."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False):
        super().__init__()
        self.eps = eps
        self.plus_one = plus_one
        self.weight = nn.Parameter(torch.zeros(dim) if plus_one else torch.ones(dim))

    def forward(self, x):
        # normalise in fp32 whatever the activation dtype (one kernel on GPUs: model/fused.py)
        return fused.rms_norm(x, self.weight, self.eps, self.plus_one)


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
        self.q_norm = RMSNorm(a.head_dim, a.norm_eps, a.norm_plus_one) if a.qk_norm else None
        self.k_norm = RMSNorm(a.head_dim, a.norm_eps, a.norm_plus_one) if a.qk_norm else None

    def qkv(self, x, cos, sin, raw: bool = False):
        """Roped q, k and v (B, n, heads, head_dim) of the normed input ``x`` (B, n, dim): one
        matmul where :func:`pack` laid wq, wk, wv back to back.  ``raw``: neither q/k-normed nor
        roped (:class:`Hooks`' ``raw_qkv``)."""
        w = packed(self.wq, self.wk, self.wv)
        if w is None:
            q, k, v = project(self.wq, x), project(self.wk, x), project(self.wv, x)
        else:
            q, k, v = linear(x, *w).split([self.wq.out_features, self.wk.out_features, self.wv.out_features], dim=-1)
        return self.heads(q, k, v, cos, sin, raw)

    def heads(self, q, k, v, cos, sin, raw: bool = False):
        """The projections q, k, v (B, n, width) as heads, q and k normed (qk_norm) and roped
        (not with ``raw``)."""
        B, n, _ = q.shape
        q = q.view(B, n, self.n_heads, self.head_dim)
        k = k.view(B, n, self.n_kv_heads, self.head_dim)
        v = v.view(B, n, self.n_kv_heads, self.head_dim)
        if raw:
            return q, k, v
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class FeedForward(nn.Module):
    """w2(act(w1 x) * w3 x): SwiGLU (``activation`` silu) or GeGLU (gelu_tanh)."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.activation = a.activation

    def forward(self, x):
        w = packed(self.w1, self.w3)
        if w is None:
            return project(self.w2, fused.GATES[self.activation](project(self.w1, x), project(self.w3, x)))
        gate, up = linear(x, *w).chunk(2, dim=-1)
        return project(self.w2, fused.GATES[self.activation](gate, up))


# --- projections that read one weight (inference) --------------------------------------------------
#
# A decode step multiplies one row per sequence by every weight: it is a read of the weights, and
# each matmul is a launch (cuBLAS's split-K adds a reduction kernel) over a few MB.  q, k and v read
# the same input, as do the MLP's gate and up; with their weights back to back in one tensor each
# pair or triple is one matmul over a longer weight (one launch instead of three or two, and a
# longer read).  The modules keep their own parameters (names, shapes, loading, tensor-parallel
# slicing unchanged): :func:`pack` only moves them into one storage, and :func:`packed` finds them
# there at each call, so a model whose parameters were moved apart again (``.to(dtype)``, FSDP)
# simply runs the separate matmuls.

def pack(*linears: nn.Linear) -> None:
    """Move the weights (and biases) of ``linears``, which read the same input, back to back into
    one new tensor each, the parameters becoming views of it.  Only the layout changes: each
    parameter keeps its ``requires_grad`` (a model trained after load_model trains these too; with
    gradients :func:`packed` refuses and the separate matmuls run)."""
    for leaf in ("weight", "bias"):
        ps = [getattr(m, leaf) for m in linears]
        if any(p is None for p in ps):
            continue
        whole = torch.cat([p.detach() for p in ps])
        at = 0
        for m, p in zip(linears, ps):
            setattr(m, leaf, nn.Parameter(whole[at:at + p.shape[0]], requires_grad=p.requires_grad))
            at += p.shape[0]


def adjacent(ts):
    """One view over tensors ``ts`` (same trailing shape) that lie back to back in one storage,
    in order, else None."""
    if any(type(t) not in (torch.Tensor, nn.Parameter) for t in ts):  # DTensors (FSDP): never packed
        return None
    first = ts[0]
    at, rows = first.data_ptr(), 0
    # one storage, not only adjacent addresses: the allocator may place separate tensors back to back
    store = first.untyped_storage().data_ptr()
    for t in ts:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.device != first.device
                or t.shape[1:] != first.shape[1:] or t.data_ptr() != at
                or t.untyped_storage().data_ptr() != store):
            return None
        at += t.numel() * t.element_size()
        rows += t.shape[0]
    # the contiguous strides of the whole, not first.stride(): a one-row view is contiguous
    # whatever its row stride (X[0:1, :K] of a wider X), and that stride would step past the rows
    shape, stride = (rows,) + tuple(first.shape[1:]), [1]
    for n in reversed(shape[1:]):
        stride.insert(0, stride[0] * n)
    return first.as_strided(shape, stride)


def packed(*linears):
    """(weight, bias) of ``linears`` as one projection, where :func:`pack` laid them out so, no
    gradient is being recorded and nothing is compiling; else None."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling() or any(type(m) is not nn.Linear for m in linears):
        return None
    w = adjacent([m.weight for m in linears])
    if w is None:
        return None
    if all(m.bias is None for m in linears):
        return w, None
    b = adjacent([m.bias for m in linears]) if all(m.bias is not None for m in linears) else None
    return None if b is None else (w, b)


def pack_model(model: nn.Module) -> None:
    """:func:`pack` every layer's q/k/v and gate/up projections (an inference model's)."""
    for b in model.layers:
        if all(type(m) is nn.Linear for m in (b.attention.wq, b.attention.wk, b.attention.wv)):
            pack(b.attention.wq, b.attention.wk, b.attention.wv)
        if all(type(m) is nn.Linear for m in (b.feed_forward.w1, b.feed_forward.w3)):
            pack(b.feed_forward.w1, b.feed_forward.w3)


class Block(nn.Module):
    """Decoder layer ``layer``, written as three stages so that checkpointing policies can choose
    what to keep: ``pre_attention`` (norm, q/k/v, RoPE), ``attend`` (the ring, or the run's
    hook: :class:`Hooks`), ``post_attention`` (output projection, residual, MLP, residual; with
    ``sandwich_norm`` the attention's and the MLP's outputs normed before their residuals).
    ``lean=True`` (the ``pointwise`` policy): the same arithmetic, with each input norm and the
    projections it feeds, and the MLP's gate and ``w2``, as one autograd Function that recomputes
    the pointwise part in backward instead of keeping it (:mod:`.pointwise`)."""

    def __init__(self, a: ModelArgs, policy: str = "none", checkpoint_split: float = 0.5, layer: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps, a.norm_plus_one)
        self.attention = Attention(a)
        self.attention_out_norm = RMSNorm(a.dim, a.norm_eps, a.norm_plus_one) if a.sandwich_norm else None
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps, a.norm_plus_one)
        self.feed_forward = FeedForward(a)
        self.ffn_out_norm = RMSNorm(a.dim, a.norm_eps, a.norm_plus_one) if a.sandwich_norm else None
        self.policy = policy
        self.checkpoint_split = checkpoint_split  # the "sequence" policy's: attention outputs kept
        self.window = a.layer_window(layer)
        self.rope_index = int(a.local_rope(layer))  # which of the decoder's RoPE tables it reads (0: global)
        self.softmax_scale = a.softmax_scale
        self.cp = ContextParallel()
        self.index = layer  # its place in the model, and the model's Offloader: the "offload" policy's
        self.offloader = None
        self.hooks = NO_HOOKS  # the decoder loop's, for the length of one run
        self.random = False  # it draws random numbers (LoRA dropout): recomputing policies replay the RNG
        self.mlp_chunk = 0  # > 0: the MLP half runs this many tokens at a time (model/tiled.py)

    def pre_attention(self, x, cos, sin, lean: bool = False):
        """The roped q, k, v (B, n, heads, head_dim) of the block input ``x`` (B, n, dim)."""
        if self.hooks.chunk:
            return _by_rows(lambda a, z: self._qkv(_rows(x, a, z), cos[a:z], sin[a:z], lean), x.shape[1],
                            self.hooks.chunk)
        return self._qkv(x, cos, sin, lean)

    def _qkv(self, x, cos, sin, lean):
        att = self.attention
        if lean:
            return att.heads(*pointwise.norm_linears(x, self.attention_norm, att.wq, att.wk, att.wv), cos, sin,
                             self.hooks.raw_qkv)
        return att.qkv(self.attention_norm(x), cos, sin, self.hooks.raw_qkv)

    def attend(self, q, k, v, docs=None):
        """Attention over the sequence: context-parallel attention (``self.cp``), or the run's
        hook in its place (:class:`Hooks`); the run's KV sink sees k and v first."""
        hooks = self.hooks
        if hooks.kv_sink is not None:
            hooks.kv_sink(self.index, k, v)
        if hooks.attend is not None:
            return hooks.attend(self.index, q, k, v)
        return context_parallel_attention(q, k, v, self.cp, self.window, docs, self.softmax_scale)

    def post_attention(self, x, o, lean: bool = False):
        """The block output from its input ``x`` and the attention output ``o`` (B, n, heads, head_dim)."""
        if self.hooks.chunk:
            return _by_rows(lambda a, z: (self._residuals(_rows(x, a, z), _rows(o, a, z), lean),), x.shape[1],
                            self.hooks.chunk)[0]
        return self._residuals(x, o, lean)

    def _residuals(self, x, o, lean):
        # one name for each step, so that without autograd (prefill) no step outlives the next;
        # a sliced model (tensor parallelism) sums its ranks' partial projections before the norms
        reduce = self.hooks.reduce or _whole
        h = reduce(project(self.attention.wo, o.flatten(2)))
        if self.attention_out_norm is not None:
            h = self.attention_out_norm(h)
        h = x + h
        if self.mlp_chunk:
            f = tiled.mlp(h, self._mlp, self.mlp_chunk, self._mlp_params(), self.random)
        elif lean:
            ff = self.feed_forward
            g, u = pointwise.norm_linears(h, self.ffn_norm, ff.w1, ff.w3)
            f = pointwise.gate_linear(g, u, ff.w2, ff.activation)
        else:
            f = self._mlp(h)
        f = reduce(f)
        if self.ffn_out_norm is not None:
            f = self.ffn_out_norm(f)
        return h + f

    def _mlp(self, h):
        return self.feed_forward(self.ffn_norm(h))

    def _mlp_params(self):
        return [*self.ffn_norm.parameters(), *self.feed_forward.parameters()]

    def forward(self, x, cos, sin, docs=None):
        return recompute.POLICIES[self.policy](self, x, cos, sin, docs)
