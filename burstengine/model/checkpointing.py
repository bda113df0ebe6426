"""Activation checkpointing policies for a decoder block: what is kept for backward.

A policy is a function ``policy(block, x, cos, sin, docs) -> y`` that runs the block's three stages
(``pre_attention`` -> ``attend`` -> ``post_attention``, see :class:`~burstengine.model.llama.Block`)
under whatever recomputation it wants.  Adding one is a function and a line in POLICIES.

* ``none``: keep everything autograd saves.
* ``full``: keep only the block input; the whole block, ring attention included, runs again in
  backward.
* ``selective``: never recompute attention (the ring, the expensive part at long sequence):
  its output (with the lse and its q, k, v, which its backward needs) is kept, and the norms,
  projections, RoPE and MLP around it are recomputed.
* ``sequence``: sequence-level selective checkpointing (BurstEngine §3.2,
  :func:`burstengine.seq_checkpoint`): keep the block input and the attention output (and lse)
  of the last ``block.checkpoint_split`` of this rank's tokens; the backward recomputes the
  attention of the front (the cheapest queries under the causal mask, with a forward-only ring
  that sends only the key rows they see), then q/k/v and the rest of the block from the input.
  Split 0 is ``full`` (attention recomputed whole), split 1 is selective checkpointing++ in its
  lean form: the attention output is kept but not its q/k/v, which are re-projected from the
  input (``selective`` keeps those too).  What "front" means under zigzag and striped:
  burstengine/train/seqckpt.py.  With no CP group the block's attention runs as BurstAttention
  on a one-rank ring (``LOCAL``), never through a ring of the whole job; torch's native CP
  (which patches SDPA) cannot be checkpointed this way.
"""
from __future__ import annotations

from torch.utils.checkpoint import checkpoint

from ..comm.topology import LOCAL


def _ckpt(fn, *args):
    # no dropout anywhere in the model, so no RNG state to replay (saves a device sync on GPU)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


def no_checkpoint(block, x, cos, sin, docs=None):
    q, k, v = block.pre_attention(x, cos, sin)
    return block.post_attention(x, block.attend(q, k, v, docs))


def full(block, x, cos, sin, docs=None):
    return _ckpt(no_checkpoint, block, x, cos, sin, docs)


def selective(block, x, cos, sin, docs=None):
    q, k, v = _ckpt(block.pre_attention, x, cos, sin)
    o = block.attend(q, k, v, docs)
    return _ckpt(block.post_attention, x, o)


def sequence(block, x, cos, sin, docs=None):
    from ..train.seqckpt import seq_checkpoint  # train/ imports the model: import at call time

    if docs is not None or block.window:
        # seq_checkpoint's ring takes no sparse mask: refuse rather than attend across documents
        what = "packed documents (cu_seqlens)" if docs is not None else f"a sliding window (model.window={block.window})"
        raise ValueError(f"checkpoint='sequence' does not support {what} yet; use checkpoint='full' or 'selective'")
    cp = block.cp
    local = cp.group is None
    return seq_checkpoint(x, lambda t: block.pre_attention(t, cos, sin), block.post_attention,
                          split=block.checkpoint_split, group=LOCAL if local else cp.group, causal=True,
                          # on one rank every layout is the identity: contiguous has the fewest blocks
                          layout="contiguous" if local else cp.layout, backward=cp.backward, kernel=cp.kernel)


POLICIES = {
    "none": no_checkpoint,
    "full": full,
    "selective": selective,
    "sequence": sequence,
}


def check(name: str, split: float = 0.5) -> None:
    if name not in POLICIES:
        raise ValueError(f"unknown checkpoint policy {name!r}; expected one of {sorted(POLICIES)}")
    if isinstance(split, bool) or not isinstance(split, (int, float)) or not 0.0 <= split <= 1.0:
        raise ValueError(f"checkpoint_split must be a number in [0, 1] (the fraction of each rank's tokens whose "
                         f"attention output is kept: 0 = recompute all, 1 = keep all), got {split!r}")
