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
* ``pointwise``: keep every matmul's output and the attention output (and lse), recompute only
  the pointwise ops in backward: the two RMSNorms (from the kept block input and residual) and
  SwiGLU's silu(gate) * up (from the kept gate and up), each norm with the projections it feeds
  and SwiGLU with ``w2`` as one autograd Function (:mod:`burstengine.model.pointwise`).  No matmul
  and no attention runs again, and the layer keeps ~2/3 of ``none``'s activations (what the
  normed inputs and the gate's product took): the step between keeping everything and
  re-projecting, for a budget that almost fits ``none``, at the cost of three pointwise kernels
  per layer in backward.  Any attention (packed documents, windows, torch's CP) works under it.
* ``auto``: a policy per layer from a memory budget (:func:`plan_layers`): every layer starts at
  ``full``; layers keep their attention output (``sequence`` at split 1: the ring is never
  recomputed, the most expensive recompute at long sequence) while the kept activations fit,
  then their projections (``pointwise``), then everything (``none``) while they still fit; a
  uniform ``pointwise`` or ``none`` plan that fits is taken as it is.  The budget is the
  ``activation_memory_gib`` config knob, or by default what the device has left after the
  parameters, gradients and AdamW states (:func:`default_budget`).
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


def recompute_pointwise(block, x, cos, sin, docs=None):
    q, k, v = block.pre_attention(x, cos, sin, lean=True)
    return block.post_attention(x, block.attend(q, k, v, docs), lean=True)


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
    "pointwise": recompute_pointwise,
}
AUTO = "auto"  # not a function: Transformer resolves it into one of the above per layer


def activation_bytes(args, elem: int) -> dict[str, int]:
    """Bytes a layer keeps for backward per local token under each policy ``auto`` chooses from
    (activations of ``elem`` bytes; lse and norm statistics in float32), with model/fused.py's
    kernels (compiled RMSNorm keeps its input and a float32 1/rms per row, RoPE only cos/sin,
    SwiGLU its two inputs) and BurstAttention (q, k, v, output, lse).

    * ``full``: the block input (d).
    * ``sequence``: the block input and the attention output + lse (d + a).
    * ``pointwise``: the block input x and the residual h (inputs of the two norm + projection
      Functions), the roped q, k, v and the attention output + lse, the gate and up projections
      (inputs of the SwiGLU + w2 Function): 2d + 2a + 2kv + 2f.
    * ``none``: x, the normed x, the roped q, k, v, the attention output + lse, h, the normed h,
      gate, up and silu(gate) * up, and the two norms' 1/rms: 4d + 2a + 2kv + 3f (q and k before
      RoPE are not kept: fused RoPE keeps only cos/sin).

    d = dim, a = heads x head_dim, kv = kv heads x head_dim, f = ffn_dim.  With ``qk_norm``,
    ``pointwise`` and ``none`` also keep q and k before their norms and the norms' 1/rms per head
    (``full`` and ``sequence`` recompute them).  Eager ops (CPU, ``fused_ops=false``) keep more: each
    RMSNorm its float32 normalised input, SwiGLU silu(gate) too."""
    d, a = args.dim, args.n_heads * args.head_dim
    kv, f, H = args.n_kv_heads * args.head_dim, args.ffn_dim, args.n_heads
    qk_pre_norm = ((a + kv) * elem + 4 * (H + args.n_kv_heads)) * bool(args.qk_norm)
    return {"full": d * elem,
            "sequence": (d + a) * elem + 4 * H,
            "pointwise": (2 * d + 2 * a + 2 * kv + 2 * f) * elem + 4 * H + qk_pre_norm,
            "none": (4 * d + 2 * a + 2 * kv + 3 * f) * elem + 4 * H + 8 + qk_pre_norm}


def transient_bytes(args, elem: int) -> dict[str, int]:
    """Bytes per local token that one layer's backward holds beyond what the layer keeps
    (:func:`activation_bytes`) and beyond a ``none`` layer's backward, under each policy ``auto``
    chooses from.  A layer that recomputes its projections (``full``, ``sequence``) rebuilds its
    ``none`` activations.  A ``pointwise`` layer's SwiGLU Function holds the rebuilt
    silu(gate) * up beside its gradient and the gradients of gate and up, where ``none`` has
    already released its kept product (w2's backward runs first): 2f more, and its norm Functions
    2d by the same count, so 2 max(d, f) (counted from what each Function holds, not from a
    committed measurement).  ``none`` rebuilds nothing."""
    recompute = activation_bytes(args, elem)["none"]
    return {"full": recompute, "sequence": recompute, "pointwise": 2 * max(args.dim, args.ffn_dim) * elem, "none": 0}


LADDER = ("full", "sequence", "pointwise", "none")  # auto's policies, least kept (most recomputed) first


def plan_layers(n_layers: int, per_layer: dict[str, int], budget: int, transient: dict[str, int]) -> list[str]:
    """The policy of each layer (one of :data:`LADDER`): as little recompute as fits in ``budget``
    bytes.  ``per_layer``: bytes one layer keeps under each policy; ``transient``: bytes one
    layer's backward holds on top of them (:func:`transient_bytes`).  Layers run backward one at
    a time, so a plan needs its kept bytes plus the largest transient of its layers.

    Recompute is ranked by its most expensive part: the fewest layers that recompute attention
    (``full``), then the fewest that recompute projections (``sequence``), then the fewest that
    recompute pointwise ops.  The plan starts from the most-kept uniform plan that fits (all
    ``none``, all ``pointwise`` or all ``sequence``; else all ``full``) and makes passes up the
    ladder from there: each pass moves the layers, in order, one step further while the plan still
    fits.  The uniform start matters: a ``full`` or ``sequence`` layer's transient (a whole layer's
    activations) is held until the last such layer is gone, so an all-``pointwise`` plan can fit
    where no plan between it and all-``sequence`` does.  With ``kept`` growing up the ladder this is
    the least recompute in that ranking; if nothing fits, every layer is ``full``."""
    def fits(plan):
        return sum(per_layer[p] for p in plan) + max(transient[p] for p in plan) <= budget

    start = next((p for p in reversed(LADDER[1:]) if fits([p] * n_layers)), LADDER[0])
    plan = [start] * n_layers
    for policy in LADDER[LADDER.index(start) + 1:]:
        for i in range(n_layers):
            trial = plan[:i] + [policy] + plan[i + 1:]
            if not fits(trial):
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
