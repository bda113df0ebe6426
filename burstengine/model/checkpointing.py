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
  burstengine/attention/seqckpt.py.  With no CP group the block's attention runs as BurstAttention
  on a one-rank ring (``LOCAL``), never through a ring of the whole job; torch's native CP
  (which patches SDPA) cannot be checkpointed this way.
* ``auto``: a policy per layer from a memory budget (:func:`plan_layers`): every layer starts at
  ``full``; layers keep their attention output (``sequence`` at split 1: the ring is never
  recomputed, the most expensive recompute at long sequence) while the kept activations fit,
  then keep everything (``none``) while they still fit.  The budget is the ``activation_memory_gib``
  config knob, or by default what the device has left after the parameters, gradients and AdamW
  states (:func:`default_budget`).
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..attention.seqckpt import seq_checkpoint
from ..comm.dist import LOCAL


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
    if docs is not None or block.window:
        # seq_checkpoint's ring takes no sparse mask: refuse rather than attend across documents
        what = "packed documents (cu_seqlens)" if docs is not None else f"a sliding window (model.window={block.window})"
        raise ValueError(f"checkpoint='sequence' does not support {what} yet; use 'full', 'selective' or 'auto'")
    cp = block.cp
    local = cp.group is None or cp.group is LOCAL
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
AUTO = "auto"  # not a function: Transformer resolves it into one of the above per layer


def activation_bytes(args, elem: int) -> dict[str, int]:
    """Bytes a layer keeps for backward per local token under each policy ``auto`` chooses from
    (activations of ``elem`` bytes; lse and norm statistics in float32).  ``none`` counts what
    autograd saves with model/fused.py's kernels: input, normed input, q/k/v before and after
    RoPE, attention output + lse, the residual, the second norm, and the MLP's three ffn-wide
    tensors."""
    d, a = args.dim, args.n_heads * args.head_dim
    kv, f, H = args.n_kv_heads * args.head_dim, args.ffn_dim, args.n_heads
    return {"full": d * elem,
            "sequence": (d + a) * elem + 4 * H,
            "none": (4 * d + 3 * a + 3 * kv + 3 * f) * elem + 4 * H + 8}


def plan_layers(n_layers: int, per_layer: dict[str, int], budget: int) -> list[str]:
    """The policy of each layer: as little recompute as fits in ``budget`` bytes of kept
    activations (``per_layer``: bytes one layer keeps under full / sequence / none).  A backward
    that recomputes a layer holds that layer's ``none`` activations on top of what is kept, so one
    such layer's worth is set aside while any layer still recomputes."""
    if per_layer["none"] * n_layers <= budget:
        return ["none"] * n_layers  # nothing recomputed, so no transient either
    plan = ["full"] * n_layers
    for policy in ("sequence", "none"):
        for i in range(n_layers):
            trial = plan[:i] + [policy] + plan[i + 1:]
            kept = sum(per_layer[p] for p in trial)
            transient = per_layer["none"] if any(p != "none" for p in trial) else 0
            if kept + transient > budget:
                break
            plan = trial
    return plan


def default_budget(local_params: int, device) -> int | None:
    """Bytes for kept activations on ``device``: 90% of its memory less the parameters' float32
    master copy, gradients and AdamW moments (16 bytes per local parameter) and 3 GiB for the
    gathered bf16 layers, the loss and the kernels' workspace.  None where the device's memory is
    not known (CPU): keep everything."""
    if getattr(device, "type", device) != "cuda" or not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return max(0, int(0.9 * total) - 16 * local_params - 3 * 2**30)


def check(name: str, split: float = 0.5) -> None:
    if name not in POLICIES and name != AUTO:
        raise ValueError(f"unknown checkpoint policy {name!r}; expected one of {sorted([*POLICIES, AUTO])}")
    if isinstance(split, bool) or not isinstance(split, (int, float)) or not 0.0 <= split <= 1.0:
        raise ValueError(f"checkpoint_split must be a number in [0, 1] (the fraction of each rank's tokens whose "
                         f"attention output is kept: 0 = recompute all, 1 = keep all), got {split!r}")
