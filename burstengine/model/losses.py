"""Hidden states -> loss: the step after the model, kept pluggable.

A loss is ``fn(hidden (N, dim), weight (vocab, dim), labels (N,), ignore_index) -> float32
scalar``, the *sum* of the cross-entropy of the tokens whose label is not ``ignore_index``.
The trainer divides by the number of such tokens over all ranks, so the loss it reports and
differentiates is the global mean whatever the sharding.  A fused LM head + cross-entropy
(BurstEngine Alg. 3) is one more entry in LOSSES.

* ``naive``: logits = hidden @ weight.T for every token at once (N x vocab stored for backward).
* ``chunked``: the same, a chunk of tokens at a time, each chunk's logits recomputed in
  backward, so at most one chunk's logits are alive: what lets 7B at 100K+ tokens per GPU run
  before a fused kernel exists.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

CHUNK_TOKENS = 8192


def naive(hidden, weight, labels, ignore_index: int = -100):
    logits = hidden @ weight.to(hidden.dtype).t()
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")


def chunked(hidden, weight, labels, ignore_index: int = -100, chunk: int = CHUNK_TOKENS):
    total = None
    for a in range(0, hidden.shape[0], chunk):
        part = checkpoint(naive, hidden[a:a + chunk], weight, labels[a:a + chunk], ignore_index,
                          use_reentrant=False, preserve_rng_state=False)
        total = part if total is None else total + part
    return total


LOSSES = {
    "naive": naive,
    "chunked": chunked,
}


def check(name: str) -> None:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; expected one of {sorted(LOSSES)}")
