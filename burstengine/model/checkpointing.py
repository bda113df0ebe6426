"""Activation checkpointing policies for a decoder block: what is kept for backward.

A policy is a function ``policy(block, x, cos, sin) -> y`` that runs the block's three stages
(``pre_attention`` -> ``attend`` -> ``post_attention``, see :class:`~burstengine.model.llama.Block`)
under whatever recomputation it wants.  Adding one is a function and a line in POLICIES.

* ``none``: keep everything autograd saves.
* ``full``: keep only the block input; the whole block, ring attention included, runs again in
  backward.
* ``selective``: never recompute attention (the ring, the expensive part at long sequence):
  its output (with the lse and its q, k, v, which its backward needs) is kept, and the norms,
  projections, RoPE and MLP around it are recomputed.  This is "selective checkpointing++" of
  the BurstEngine ablation; the sequence-level variant (keep the attention output of only the
  later part of the sequence) is another policy for this table.
"""
from __future__ import annotations

from torch.utils.checkpoint import checkpoint


def _ckpt(fn, *args):
    # no dropout anywhere in the model, so no RNG state to replay (saves a device sync on GPU)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


def no_checkpoint(block, x, cos, sin):
    q, k, v = block.pre_attention(x, cos, sin)
    return block.post_attention(x, block.attend(q, k, v))


def full(block, x, cos, sin):
    return _ckpt(no_checkpoint, block, x, cos, sin)


def selective(block, x, cos, sin):
    q, k, v = _ckpt(block.pre_attention, x, cos, sin)
    o = block.attend(q, k, v)
    return _ckpt(block.post_attention, x, o)


POLICIES = {
    "none": no_checkpoint,
    "full": full,
    "selective": selective,
}


def check(name: str) -> None:
    if name not in POLICIES:
        raise ValueError(f"unknown checkpoint policy {name!r}; expected one of {sorted(POLICIES)}")
