"""How a decoder's attention sees the sequence (:class:`ContextParallel`): training, prefill and
generation describe it with this one object.

Under context parallelism each rank holds the tokens of its shard of the global sequence (any
layout of :mod:`burstengine.layout`) and attention runs through
:func:`burstengine.burst_attn_func` over the CP group.  Packed documents are passed as global
``cu_seqlens``, so attention never crosses a document boundary.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from ..attention import burst_attn_func
from ..comm.dist import LOCAL

# burst: BurstAttention over the group; sdpa: plain SDPA on this rank's whole sequences;
# torch-cp: plain SDPA on a shard that torch's context_parallel patches into its own ring
ATTENTIONS = ("burst", "sdpa", "torch-cp")


@dataclass(frozen=True)
class ContextParallel:
    """How attention sees the sequence: the kind of attention, the CP group of BurstAttention's
    ring, the layout of the shards, and BurstAttention's knobs.

    * ``attention="burst"`` (the default with a group): BurstAttention over ``group``;
      ``group=LOCAL``: its kernels on this rank's whole sequences (a one-rank ring, nothing
      communicated).
    * ``"sdpa"`` (the default without a group): plain SDPA on this rank's tokens, the whole
      sequence; a mask (a sliding window, packed documents) runs as BurstAttention on a one-rank
      ring, which takes both without building an n x n one.
    * ``"torch-cp"``: plain SDPA on a shard that torch's context_parallel patches into its own
      ring; it takes no mask, and a layer cannot run sequence-level checkpointing's own ring over
      the shard ("auto" plans "selective" instead)."""

    group: object = None
    layout: str = "contiguous"
    backward: str = "auto"
    kernel: str | None = None
    attention: str | None = None  # None: "burst" with a group, else "sdpa"

    def __post_init__(self):
        kind = self.attention or ("burst" if self.group is not None else "sdpa")
        if kind not in ATTENTIONS:
            raise ValueError(f"unknown attention {kind!r}; expected one of {list(ATTENTIONS)}")
        if (kind == "burst") != (self.group is not None):
            raise ValueError(f"attention {kind!r} " + ("needs a group (LOCAL: a one-rank ring)" if kind == "burst"
                                                       else f"takes no group, got {self.group!r}"))
        object.__setattr__(self, "attention", kind)

    @property
    def local(self) -> bool:
        """Attention sees only this rank's tokens: no group, or the one-rank ring."""
        return self.group is None or self.group is LOCAL

    @property
    def sharded_outside(self) -> bool:
        """The tokens are a shard that torch's context_parallel attends across (torch-cp)."""
        return self.attention == "torch-cp"


def context_parallel_attention(q, k, v, cp: ContextParallel, window: int = 0, docs: tuple | None = None,
                               scale: float | None = None):
    """Causal attention of this rank's (B, n, H, D) shard over the whole sequence, within a
    sliding ``window`` (0: none) and packed documents ``docs`` (global cu_seqlens, or None),
    scores scaled by ``scale`` (None: D ** -0.5)."""
    masked = bool(window) or docs is not None
    if masked and cp.sharded_outside:
        raise ValueError("torch's context_parallel (attention 'torch-cp') attends over the whole causal prefix: "
                         "a sliding window or packed documents need attention 'burst'")
    if cp.group is not None or masked:
        local = cp.local
        return burst_attn_func(q, k, v, group=LOCAL if local else cp.group, causal=True,
                               layout="contiguous" if local else cp.layout, backward=cp.backward, kernel=cp.kernel,
                               window=window or None, cu_seqlens=docs, softmax_scale=scale)
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if kh.shape[1] != qh.shape[1]:
        # torch-native CP's ring does not take enable_gqa: expand K/V as its users must
        g = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale).transpose(1, 2)
