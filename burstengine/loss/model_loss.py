"""Hidden states -> loss: the step after the model, kept pluggable.

A loss is ``fn(hidden (N, dim), weight (vocab, dim), labels (N,), ignore_index) -> float32
scalar``, the *sum* of the cross-entropy of the tokens whose label is not ``ignore_index``.
The trainer divides by the number of such tokens over all ranks, so the loss it reports and
differentiates is the global mean whatever the sharding.  Under context parallelism each rank
passes its own tokens and sums only those: no loss needs a collective.

* ``naive``: logits = hidden @ weight.T for every token at once (N x vocab stored for backward).
* ``chunked``: the same, a chunk of tokens at a time, each chunk's logits recomputed in
  backward, so at most one chunk's logits are alive: what lets 7B at 100K+ tokens per GPU run
  before a fused kernel exists.
* ``fused``: :func:`burstengine.fused_linear_cross_entropy` (BurstEngine §3.3, Alg. 3): the
  logits are made a chunk at a time in one reused workspace and d(hidden), d(weight) are
  finished in the forward, so no N x vocab tensor is stored nor recomputed; the backward only
  scales them by the trainer's 1 / (global token count).  No host sync: the label-range check
  is off (a label outside the vocabulary makes the loss NaN instead of raising).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .fused_ce import fused_linear_cross_entropy

CHUNK_TOKENS = 8192
# tokens per chunk of the fused loss; None = its default (a 1 GiB logits workspace on CUDA)
FUSED_CHUNK_TOKENS: int | None = None


def naive(hidden, weight, labels, ignore_index: int = -100):
    logits = hidden @ weight.to(hidden.dtype).t()
    return F.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction="sum")


def chunked(hidden, weight, labels, ignore_index: int = -100, chunk: int | None = None):
    chunk = chunk or CHUNK_TOKENS
    total = None
    for a in range(0, hidden.shape[0], chunk):
        part = checkpoint(naive, hidden[a:a + chunk], weight, labels[a:a + chunk], ignore_index,
                          use_reentrant=False, preserve_rng_state=False)
        total = part if total is None else total + part
    return total


def fused(hidden, weight, labels, ignore_index: int = -100):
    # group=None: this rank's tokens alone; "sum": the trainer divides by the global count;
    # check_labels=False: no host sync in the step (a bad label shows as a NaN loss)
    return fused_linear_cross_entropy(hidden, weight.to(hidden.dtype), labels, ignore_index=ignore_index,
                                      reduction="sum", chunk_size=FUSED_CHUNK_TOKENS, check_labels=False)


LOSSES = {
    "naive": naive,
    "chunked": chunked,
    "fused": fused,
}


def check(name: str) -> None:
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; expected one of {sorted(LOSSES)}")
