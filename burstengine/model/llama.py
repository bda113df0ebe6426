"""A LLaMA-style decoder whose attention is BurstAttention.

RMSNorm, rotary position embeddings (optionally scaled: :mod:`.rope`), SwiGLU MLP, grouped-query
attention; the variations of the Llama 2/3, Qwen2/3 and Mistral families are options of
:class:`ModelArgs` (q/k/v biases, per-head q/k RMSNorm, a head width that is not dim / heads,
tied embeddings, a sliding window).  Packed documents are passed as global ``cu_seqlens``, so
attention never crosses a document boundary.  Under
context parallelism each rank holds the tokens of its shard of the global sequence (any layout
of :mod:`burstengine.layout`), so RoPE is computed from the *global* positions those tokens
have, and attention runs through :func:`burstengine.burst_attn_func` over the CP group.

The model ends at the final norm: turning hidden states into a loss is a separate, pluggable
step (:mod:`burstengine.model.losses`) that the root ``forward`` calls with the LM head's weight,
so that a fused LM head + cross-entropy never has to materialise the logits.  How a block keeps
its activations for backward is another pluggable step (:mod:`burstengine.model.checkpointing`).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention import burst_attn_func
from ..comm.dist import LOCAL
from ..kernels import acc_dtype
from . import checkpointing, fused, losses, offload, pointwise
from .rope import RopeScaling, rope_tables

from .families import ARCHS  # ModelArgs.arch's values: the registry's families
_ZERO_MEANS_UNSET = ("head_size", "window", "max_position_embeddings")


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    vocab_size: int = 32000
    ffn_dim: int = 11008
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    # the variations of pretrained families (model/hf.py reads them from a config.json)
    arch: str = "llama"              # the HF family the weights are written back as: llama, qwen2, qwen3, mistral
    head_size: int = 0               # width of one head; 0 = dim / n_heads (Qwen3 sets it apart)
    qkv_bias: bool = False           # biases on the q, k, v projections (Qwen2)
    qk_norm: bool = False            # RMSNorm over each head of q and k before RoPE (Qwen3)
    window: int = 0                  # sliding window: each query sees the W most recent keys, itself included
                                     # (Mistral's sliding_window = W); 0 = the whole causal prefix
    max_position_embeddings: int = 0  # the context the weights were trained for (config.json); 0 = unknown
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)  # context extension (see model/rope.py)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        """The inverse of dataclasses.asdict (a checkpoint's meta.json); fields it lacks (an older
        checkpoint) keep their defaults."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if isinstance(kw.get("rope_scaling"), dict):
            kw["rope_scaling"] = RopeScaling(**kw["rope_scaling"])
        return cls(**kw)

    def validate(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            least = 0 if f.name in _ZERO_MEANS_UNSET else 1
            if f.type in ("int", int) and v < least:
                raise ValueError(f"model.{f.name} must be >= {least}, got {v}")
        if self.arch not in ARCHS:
            raise ValueError(f"model.arch must be one of {list(ARCHS)}, got {self.arch!r}")
        if not self.head_size and self.dim % self.n_heads:
            raise ValueError(f"model.dim ({self.dim}) must be a multiple of model.n_heads ({self.n_heads}) "
                             f"(or set model.head_size)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head dim = {self.head_dim} must be even for RoPE")
        self.rope_scaling.validate(self.max_position_embeddings)

    def num_params(self, embedding: bool = True) -> int:
        d, L, V, f = self.dim, self.n_layers, self.vocab_size, self.ffn_dim
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        block = d * q * 2 + d * kv * 2 + 3 * d * f + 2 * d
        block += (q + 2 * kv) * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        head = 0 if self.tie_embeddings else V * d
        return L * block + d + head + (V * d if embedding else 0)

    def flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Training FLOPs per token (forward + backward), as docs/design.md ("FLOP conventions") defines them for MFU:
        6 x (non-embedding params + LM head) + 6 (causal; 12 full) x n_layers x dim x seq."""
        dense = self.num_params(embedding=False) + (self.vocab_size * self.dim if self.tie_embeddings else 0)
        return 6.0 * dense + (6.0 if causal else 12.0) * self.n_layers * self.dim * seq_len


# shapes of the BurstEngine paper (§4.1) and of LLaMA-3 8B
PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=352,
                      rope_theta=10000.0),
    # Llama-3.2-3B's shapes
    "llama-3b": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, ffn_dim=8192,
                          rope_theta=500000.0, tie_embeddings=True),
    "llama-7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000, ffn_dim=11008),
    "llama-8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336,
                          rope_theta=500000.0),
    "llama-14b": ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=120000, ffn_dim=13824),
}


@dataclass
class ContextParallel:
    """How attention sees the sequence: the CP group of the BurstAttention ring, the layout of
    the shards, and BurstAttention's knobs.  ``group=LOCAL``: BurstAttention's kernels on this
    rank's whole sequences (a one-rank ring, nothing communicated).  With no group, attention is
    plain SDPA on this rank's tokens: a whole sequence, or a shard inside torch's
    context_parallel, which patches SDPA into its own ring."""

    group: object = None
    layout: str = "contiguous"
    backward: str = "auto"
    kernel: str | None = None
    # the tokens are a shard that torch's context_parallel attends across (torch-cp): a layer
    # cannot run sequence-level checkpointing's own ring over them, "auto" plans "selective" instead
    sharded_outside: bool = False

    @property
    def local(self) -> bool:
        """Attention sees only this rank's tokens: no group, or the one-rank ring."""
        return self.group is None or self.group is LOCAL


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


def context_parallel_attention(q, k, v, cp: ContextParallel, window: int = 0, docs: tuple | None = None):
    """Causal attention of this rank's (B, n, H, D) shard over the whole sequence, within a
    sliding ``window`` (0: none) and packed documents ``docs`` (global cu_seqlens, or None).

    A mask with no CP group runs as BurstAttention on a one-rank ring (``LOCAL``), which takes
    both masks without building an n x n one."""
    if cp.group is not None or window or docs is not None:
        local = cp.local
        return burst_attn_func(q, k, v, group=LOCAL if local else cp.group, causal=True,
                               layout="contiguous" if local else cp.layout, backward=cp.backward, kernel=cp.kernel,
                               window=window or None, cu_seqlens=docs)
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if kh.shape[1] != qh.shape[1]:
        # torch-native CP's ring does not take enable_gqa: expand K/V as its users must
        g = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2)


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
    what to keep: ``pre_attention`` (norm, q/k/v, RoPE), ``attend`` (the ring),
    ``post_attention`` (output projection, residual, MLP, residual).  ``lean=True`` (the
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

    def pre_attention(self, x, cos, sin, lean: bool = False):
        att = self.attention
        if lean:
            return att.heads(*pointwise.norm_linears(x, self.attention_norm, att.wq, att.wk, att.wv), cos, sin)
        return att.qkv(self.attention_norm(x), cos, sin)

    def attend(self, q, k, v, docs=None):
        return context_parallel_attention(q, k, v, self.cp, self.window, docs)

    def post_attention(self, x, o, lean: bool = False):
        h = x + self.attention.wo(o.flatten(2))
        if lean:
            ff = self.feed_forward
            g, u = pointwise.norm_linears(h, self.ffn_norm, ff.w1, ff.w3)
            return h + pointwise.swiglu_linear(g, u, ff.w2)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, x, cos, sin, docs=None):
        return checkpointing.POLICIES[self.policy](self, x, cos, sin, docs)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, checkpoint: str = "none", loss: str = "naive", checkpoint_split: float = 0.5,
                 activation_budget: int | None = None, offload_budget: int | None = 0):
        super().__init__()
        args.validate()
        checkpointing.check(checkpoint, checkpoint_split)
        losses.check(loss)
        self.args = args
        self.loss_name = loss
        # checkpoint="auto": per-layer policies planned from this budget (bytes; None: the device's
        # default) when the local token count is first seen (checkpointing.plan_layers)
        self.auto_checkpoint = checkpoint == checkpointing.AUTO
        self.activation_budget = activation_budget
        # host bytes the "offload" layers of an auto plan may keep (0, the default: no layer is
        # offloaded; None: the host's default, checkpointing.default_host_budget)
        self.offload_budget = offload_budget
        self.offloader = None  # made at the first forward with an "offload" layer
        self._planned_for = None
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, "full" if self.auto_checkpoint else checkpoint, checkpoint_split)
                                    for _ in range(args.n_layers))
        for i, b in enumerate(self.layers):
            b.index = i
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.cp = ContextParallel()

    def set_context_parallel(self, cp: ContextParallel) -> None:
        self.cp = cp
        for b in self.layers:
            b.cp = cp

    @property
    def head_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, cu_seqlens=None) -> torch.Tensor:
        """Final-norm hidden states (B, n, dim) of this rank's tokens (B, n) at global
        ``positions`` (n,).  ``cu_seqlens``: packed documents, the GLOBAL boundaries
        0 = c_0 < ... < c_m = global length (the same on every CP rank; positions then restart
        per document, as the batch provides them); attention never crosses a boundary."""
        a = self.args
        docs = _docs(cu_seqlens)
        seq_len = 0
        if a.rope_scaling.type == "dynamic":  # the global length, the same on every rank
            if docs is not None:
                seq_len = max(e - s for s, e in zip(docs[:-1], docs[1:]))
            else:
                import torch.distributed as dist

                world = 1 if self.cp.local else dist.get_world_size(self.cp.group)
                seq_len = tokens.shape[1] * world
        h = self.tok_embeddings(tokens)
        if self.auto_checkpoint and self._planned_for != (h.shape[:2], docs is not None):
            self.plan_checkpointing(h.shape[0] * h.shape[1], h.element_size(), h.device, sparse=docs is not None)
            self._planned_for = (h.shape[:2], docs is not None)
        cos, sin = self.rope(positions, acc_dtype(h), seq_len)
        off = self._offloader(h.device)
        for b in self.layers:
            below = off.newest() if off else None  # an offloaded layer below: copy it back from this one's backward
            h = b(h, cos, sin, docs)
            if below is not None:
                off.follow(below, h)
        return self.norm(h)

    def _offloader(self, device):
        """The Offloader of this model's "offload" layers (one side stream and its host buffers), or None."""
        if not any(b.policy == "offload" for b in self.layers):
            return None
        if self.offloader is None:
            self.offloader = offload.Offloader(device)
        for b in self.layers:
            b.offloader = self.offloader
        return self.offloader

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, seq_len: int = 0):
        """cos, sin (n, head_dim) in ``dtype`` for global ``positions`` (n,) under the model's RoPE
        settings; ``seq_len``: the global sequence length (only dynamic scaling reads it)."""
        a = self.args
        return tuple(t.to(dtype) for t in rope_tables(positions, a.head_dim, a.rope_theta, a.rope_scaling,
                                                      a.max_position_embeddings, seq_len))

    def forward(self, tokens, positions, labels=None, ignore_index: int = -100, predict: bool = False,
                cu_seqlens=None):
        """With ``labels`` (B, n): the float32 *sum* of the losses of this rank's labelled tokens
        (the caller divides by the global count).  With ``predict`` too: the argmax prediction
        (B, n) at labelled positions, ``ignore_index`` elsewhere.  Without labels: the hidden
        states.  The LM head runs here, inside the root module, so a sharded head weight is
        gathered for it.  ``cu_seqlens``: see :meth:`hidden`."""
        h = self.hidden(tokens, positions, cu_seqlens)
        if labels is None:
            return h
        if predict:
            keep = labels != ignore_index
            hk = h[keep]
            preds = torch.full_like(labels, ignore_index)
            preds[keep] = (hk @ self.head_weight.to(hk.dtype).t()).argmax(-1)
            return preds
        return losses.LOSSES[self.loss_name](h.flatten(0, 1), self.head_weight, labels.flatten(), ignore_index)

    def plan_checkpointing(self, tokens: int, elem: int, device, sparse: bool = False) -> list[str]:
        """Set each layer's policy for ``tokens`` local tokens of ``elem``-byte activations from
        the activation budget (checkpoint="auto"); returns the plan.  ``sparse`` (packed documents,
        or a model with a sliding window): the layers that keep their attention output use
        ``selective``, since sequence-level checkpointing's ring takes no sparse mask."""
        from torch.distributed.tensor import DTensor

        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in self.parameters())
        budget = self.activation_budget
        if budget is None:
            budget = checkpointing.default_budget(local, device)
        per_token = checkpointing.activation_bytes(self.args, elem)
        no_ring = sparse or self.args.window or self.cp.sharded_outside
        if no_ring:  # "selective" keeps the roped q, k, v as well
            a = self.args
            per_token["sequence"] += (a.n_heads + 2 * a.n_kv_heads) * a.head_dim * elem
        per_layer = {k: v * tokens for k, v in per_token.items()}
        transient = {k: v * tokens for k, v in checkpointing.transient_bytes(self.args, elem).items()}
        host = self.offload_budget
        if host is None:
            host = checkpointing.default_host_budget(device)
        plan = (["none"] * len(self.layers) if budget is None
                else checkpointing.plan_layers(len(self.layers), per_layer, budget, transient,
                                               checkpointing.host_bytes(self.args, elem) * tokens, host))
        if no_ring:
            plan = ["selective" if p == "sequence" else p for p in plan]
        for b, p in zip(self.layers, plan):
            b.policy = p
            if p == "sequence":
                b.checkpoint_split = 1.0
        self.checkpoint_plan = plan
        return plan

    # --- initialisation -----------------------------------------------------------------------

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Deterministic initialisation that does not depend on how parameters are sharded:
        each full parameter is drawn from a generator seeded by (seed, its name), on the
        parameter's device, and this rank keeps its shard.  Linear and embedding weights
        ~ N(0, 0.02); output projections of attention and MLP scaled by 1/sqrt(2 n_layers)."""
        from torch.distributed.tensor import DTensor, distribute_tensor  # only for DTensor (FSDP-sharded) weights

        for name, p in self.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            dev = local.device
            if name.endswith("norm.weight"):
                full = torch.ones(p.shape, device=dev, dtype=torch.float32)
            elif name.endswith(".bias"):
                full = torch.zeros(p.shape, device=dev, dtype=torch.float32)
            else:
                std = 0.02
                if name.endswith("wo.weight") or name.endswith("w2.weight"):
                    std /= math.sqrt(2 * self.args.n_layers)
                g = torch.Generator(device=dev)
                g.manual_seed(_param_seed(seed, name))
                full = torch.empty(p.shape, device=dev, dtype=torch.float32).normal_(0.0, std, generator=g)
            if isinstance(p, DTensor):
                full = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
            local.copy_(full.to(local.dtype))


def _docs(cu_seqlens) -> tuple | None:
    """Global document boundaries as a tuple of ints (one host read of a tensor), or None."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        return tuple(int(c) for c in cu_seqlens.tolist())
    return tuple(int(c) for c in cu_seqlens)


def _param_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)
