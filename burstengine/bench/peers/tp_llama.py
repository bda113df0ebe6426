"""Megatron-style tensor-parallel LLaMA prefill: the peer of the BurstAttention paper's Tables 2-3.

Built from the weights of a full :class:`burstengine.model.Transformer`, each rank keeps its
slice: the query heads ``[r H/G, (r+1) H/G)`` with the kv heads they read (kv heads are
replicated when there are fewer than G), the matching columns of the output projection, and
``ffn/G`` of the MLP (gate/up by rows, down by columns).  Embedding, norms and the LM head are
replicated (the LM head runs on one token only, so sharding it would change nothing here).

* ``v3`` (Megatron-LM with sequence parallelism): activations between blocks are sharded by
  sequence (contiguous, S/G tokens per rank); each block all-gathers its normed input to the
  full sequence, computes its heads / MLP slice over all S tokens and reduce-scatters the
  partial output back to S/G tokens.
* ``v1``: activations are replicated (every rank holds all S tokens); the partial outputs of
  attention and MLP are all-reduced.

It computes exactly what the model computes (tests compare its logits to transformers').
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ...comm.dist import rank_of, world_of
from ...kernels import acc_dtype
from ...model.layers import apply_rope
from ...model.rope import rope_tables
from .peer_attention import sdpa

MODES = ("v1", "v3")
# torch 2.13 renamed the flat collectives; 2.11 (the GPU image) has only the old names
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _gather_seq(x, group):
    """(B, n, d) on each rank -> (B, G n, d), rank order."""
    G = dist.get_world_size(group)
    if G == 1:
        return x
    t = x.transpose(0, 1).contiguous()
    out = torch.empty((G * t.shape[0],) + t.shape[1:], dtype=t.dtype, device=t.device)
    _all_gather(out, t, group=group)
    return out.transpose(0, 1)


def _reduce_scatter_seq(x, group):
    """(B, S, d) partial sums -> this rank's (B, S/G, d) of their sum."""
    G = dist.get_world_size(group)
    if G == 1:
        return x
    t = x.transpose(0, 1).contiguous()
    out = torch.empty((t.shape[0] // G,) + t.shape[1:], dtype=t.dtype, device=t.device)
    _reduce_scatter(out, t, group=group)
    return out.transpose(0, 1)


def _all_reduce(x, group):
    if dist.get_world_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


class TPLlama:
    """This rank's tensor-parallel slice of a LLaMA :class:`Transformer` (which it does not keep)."""

    def __init__(self, model, group=None, mode: str = "v3", backend: str = "cudnn"):
        if mode not in MODES:
            raise ValueError(f"unknown TP mode {mode!r}; expected one of {MODES}")
        a = model.args
        G, r = world_of(group), rank_of(group)
        if a.n_heads % G or a.ffn_dim % G:
            raise ValueError(f"tensor parallelism over {G} ranks needs heads ({a.n_heads}) and ffn ({a.ffn_dim}) "
                             f"divisible by {G}")
        if a.n_kv_heads % G and G % a.n_kv_heads:
            raise ValueError(f"kv heads ({a.n_kv_heads}) must divide or be divisible by the TP size {G}")
        self.args, self.group, self.mode, self.backend, self.G, self.rank = a, group, mode, backend, G, r
        D, h, f = a.head_dim, a.n_heads // G, a.ffn_dim // G
        rep = a.n_heads // a.n_kv_heads
        # the kv heads my query heads read: whole groups (Hkv/G of them), or the one kv head all
        # my query heads share when there are fewer kv heads than ranks
        k0, k1 = (r * h) // rep, ((r + 1) * h - 1) // rep + 1
        self.heads, self.kv_heads = h, k1 - k0

        def cut(w, lo, hi, dim=0):
            return w.detach().narrow(dim, lo, hi - lo).clone()

        self.layers = []
        for b in model.layers:
            at, ff = b.attention, b.feed_forward
            self.layers.append(dict(
                attention_norm=b.attention_norm, ffn_norm=b.ffn_norm,
                wq=cut(at.wq.weight, r * h * D, (r + 1) * h * D), wk=cut(at.wk.weight, k0 * D, k1 * D),
                wv=cut(at.wv.weight, k0 * D, k1 * D), wo=cut(at.wo.weight, r * h * D, (r + 1) * h * D, 1),
                w1=cut(ff.w1.weight, r * f, (r + 1) * f), w3=cut(ff.w3.weight, r * f, (r + 1) * f),
                w2=cut(ff.w2.weight, r * f, (r + 1) * f, 1)))
        self.embed, self.norm = model.tok_embeddings, model.norm
        self.head = model.head_weight.detach()
        self.vocab_size = a.vocab_size
        p = model.tok_embeddings.weight
        self.device, self.dtype = p.device, p.dtype

    def _attention(self, L, x, cos, sin):
        B, S, _ = x.shape
        D = self.args.head_dim
        q = (x @ L["wq"].t()).view(B, S, self.heads, D)
        k = (x @ L["wk"].t()).view(B, S, self.kv_heads, D)
        v = (x @ L["wv"].t()).view(B, S, self.kv_heads, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = sdpa(q, k, v, True, self.backend)  # GQA without expanding (enable_gqa)
        return o.flatten(2) @ L["wo"].t()

    @staticmethod
    def _mlp(L, x):
        return (F.silu(x @ L["w1"].t()) * (x @ L["w3"].t())) @ L["w2"].t()

    @torch.no_grad()
    def next_token_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, vocab) float32 next-token logits of the whole prompt ``input_ids`` (B, S) (every
        rank passes the same ids), on every rank."""
        g, G, r = self.group, self.G, self.rank
        B, S = input_ids.shape
        if S % G:
            raise ValueError(f"sequence {S} is not divisible by the TP size {G}")
        ids = input_ids.to(self.device)
        acc = acc_dtype(self.dtype)  # as the model rotates
        cos, sin = (t.to(acc) for t in rope_tables(torch.arange(S, device=self.device), self.args.head_dim,
                                                   self.args.rope_theta))
        if self.mode == "v3":
            n = S // G
            x = self.embed(ids[:, r * n:(r + 1) * n])
            for L in self.layers:
                x = x + _reduce_scatter_seq(self._attention(L, _gather_seq(L["attention_norm"](x), g), cos, sin), g)
                x = x + _reduce_scatter_seq(self._mlp(L, _gather_seq(L["ffn_norm"](x), g)), g)
            owner = G - 1  # the last token is the last of the last rank's contiguous shard
        else:
            x = self.embed(ids)
            for L in self.layers:
                x = x + _all_reduce(self._attention(L, L["attention_norm"](x), cos, sin), g)
                x = x + _all_reduce(self._mlp(L, L["ffn_norm"](x)), g)
            owner = None
        if owner is None or r == owner:
            logits = (self.norm(x[:, -1:])[:, 0] @ self.head.to(x.dtype).t()).float()
        else:
            logits = torch.empty(B, self.vocab_size, dtype=torch.float32, device=self.device)
        if owner is not None and G > 1:
            src = dist.get_global_rank(g, owner) if g is not None else owner
            dist.broadcast(logits, src=src, group=g)
        return logits
