"""Activation checkpointing policies for a decoder block: what is kept for backward.

A policy is a function ``policy(block, x, cos, sin, docs) -> y`` that runs the block's three stages
(``pre_attention`` -> ``attend`` -> ``post_attention``, see :class:`~burstengine.model.layers.Block`)
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
  burstengine/attention/sequence_recompute.py.  With no CP group the block's attention runs as BurstAttention
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
  The output norms of ``sandwich_norm`` (Gemma) feed no projection: they run under autograd and
  keep their inputs, whose matmuls are never run again.
* ``offload``: ``pointwise``, with what the layer saves kept in pinned host memory from its
  forward to its backward (:mod:`burstengine.model.offload`): copies on a side stream, overlapped
  with the next layers' forward and, coming back, with the backward of the layer above.  Nothing
  is recomputed and the layer keeps nothing on the device between the passes; it costs host
  memory and PCIe bandwidth, which the layers' compute hides at long sequences.
* ``full-offload``: ``full``, with the block input kept in pinned host memory from the forward
  to the backward, copied as ``offload``'s are: the layer keeps nothing on the device.  For
  length: at 512K tokens per GPU the block inputs alone of an 8B model's 32 layers take 128 GiB.
* ``auto``: a policy per layer from a memory budget (:func:`plan_layers`): the fewest layers that
  recompute attention with their input on the host (``full-offload``), then on the device
  (``full``), then the fewest that recompute projections (``sequence`` at split 1: the attention
  output kept), then the fewest that copy to the host (``offload``), then the fewest that
  recompute pointwise ops (``pointwise``); the rest keep everything (``none``).  The device
  budget is the ``activation_memory_gib`` config knob, or by default what the device has left
  after the parameters, gradients and AdamW states (:func:`default_budget`); the host budget
  ``offload_memory_gib``, or by default half the host's memory shared by its GPUs
  (:func:`default_host_budget`).  ``full-offload`` is planned only where even every layer
  ``full`` would not fit the device; ``offload`` (for speed) only with ``activation_offload``.
"""
from __future__ import annotations

import os

import torch
from torch.utils.checkpoint import checkpoint

from ..attention.sequence_recompute import seq_checkpoint
from ..comm.dist import LOCAL
from .offload import Offloader


def _ckpt(fn, *args, rng: bool = False):
    # the RNG state is replayed only for a block that draws (LoRA dropout): it costs a device sync on GPU
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=rng)


def no_checkpoint(block, x, cos, sin, docs=None):
    # q, k, v are let go before post_attention (no local names them): without autograd keeping
    # them (prefill, decode), a long prompt's MLP runs without them
    o = block.attend(*block.pre_attention(x, cos, sin), docs)
    return block.post_attention(x, o)


def full(block, x, cos, sin, docs=None):
    return _ckpt(no_checkpoint, block, x, cos, sin, docs, rng=block.random)


def selective(block, x, cos, sin, docs=None):
    q, k, v = _ckpt(block.pre_attention, x, cos, sin, rng=block.random)
    o = block.attend(q, k, v, docs)
    return _ckpt(block.post_attention, x, o, rng=block.random)


def _anchored(block, x, cos, sin, docs, anchor):
    return no_checkpoint(block, x, cos, sin, docs)


def full_offload(block, x, cos, sin, docs=None):
    # full, with the block input in host memory until the backward (model/offload.py): the layer
    # keeps nothing on the device.  torch's reentrant checkpoint keeps its inputs as saved tensors,
    # which the offloader's hooks move to the host; the anchor (an input that needs a gradient)
    # makes its backward run, and reach the parameters, when x needs none (LoRA's first layer)
    if block.offloader is None:
        block.offloader = Offloader(x.device)
    anchor = torch.empty(0, device=x.device, requires_grad=True)
    with block.offloader.layer(block.index, keep=(*block.parameters(), cos, sin, anchor)):
        return checkpoint(_anchored, block, x, cos, sin, docs, anchor, use_reentrant=True,
                          preserve_rng_state=block.random)


def recompute_pointwise(block, x, cos, sin, docs=None):
    q, k, v = block.pre_attention(x, cos, sin, lean=True)
    return block.post_attention(x, block.attend(q, k, v, docs), lean=True)


def offload(block, x, cos, sin, docs=None):
    # pointwise, with what the layer saves in host memory until its backward (model/offload.py)
    if block.offloader is None:  # a block run on its own: its own side stream and buffers
        block.offloader = Offloader(x.device)
    with block.offloader.layer(block.index, keep=(*block.parameters(), cos, sin)):
        return recompute_pointwise(block, x, cos, sin, docs)


def sequence(block, x, cos, sin, docs=None):
    if docs is not None or block.window:
        # seq_checkpoint's ring takes no sparse mask: refuse rather than attend across documents
        what = "packed documents (cu_seqlens)" if docs is not None else f"a sliding window (model.window={block.window})"
        raise ValueError(f"checkpoint='sequence' does not support {what} yet; use 'full', 'selective' or 'auto'")
    cp = block.cp
    if cp.sharded_outside:  # a local ring over torch-cp's shard would attend within the shard only
        raise ValueError("checkpoint='sequence' cannot run under torch's context_parallel (attention='torch-cp'); "
                         "use 'full', 'selective' or 'auto'")
    local = cp.local
    return seq_checkpoint(x, lambda t: block.pre_attention(t, cos, sin), block.post_attention,
                          split=block.checkpoint_split, group=LOCAL if local else cp.group, causal=True,
                          # on one rank every layout is the identity: contiguous has the fewest blocks
                          layout="contiguous" if local else cp.layout, softmax_scale=block.softmax_scale,
                          backward=cp.backward, kernel=cp.kernel)


POLICIES = {
    "none": no_checkpoint,
    "full": full,
    "selective": selective,
    "sequence": sequence,
    "pointwise": recompute_pointwise,
    "offload": offload,
    "full-offload": full_offload,
}
AUTO = "auto"  # not a function: Transformer resolves it into one of the above per layer


def activation_bytes(args, elem: int, tiled: bool = False) -> dict[str, int]:
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
    * ``offload``, ``full-offload``: nothing on the device (:func:`host_bytes`).

    ``tiled`` (the tiled MLP, :mod:`.tiled`): the MLP half keeps only its input h, which the
    layer keeps anyway: ``pointwise`` 2d + 2a + 2kv, ``none`` 3d + 2a + 2kv (and one 1/rms).

    d = dim, a = heads x head_dim, kv = kv heads x head_dim, f = ffn_dim.  With ``qk_norm``,
    ``pointwise`` and ``none`` also keep q and k before their norms and the norms' 1/rms per head
    (``full`` and ``sequence`` recompute them); with ``sandwich_norm``, the inputs of the two output
    norms (the projections wo and w2 make them) and their 1/rms: 2d + 8 bytes more.  GeGLU keeps
    what SwiGLU keeps.  Eager ops (CPU, ``fused_ops=false``) keep more: each RMSNorm its float32
    normalised input, the gate act(gate) too."""
    d, a = args.dim, args.n_heads * args.head_dim
    kv, f, H = args.n_kv_heads * args.head_dim, args.ffn_dim, args.n_heads
    qk_pre_norm = ((a + kv) * elem + 4 * (H + args.n_kv_heads)) * bool(args.qk_norm)
    mlp_kept = 0 if tiled else f  # the MLP's own: the normed h, gate, up, product (none) / gate, up (pointwise)
    out_norms = (2 * d * elem + 8) * bool(args.sandwich_norm)  # Gemma's output norms' inputs, outside any tile
    return {"full": d * elem,
            "sequence": (d + a) * elem + 4 * H,
            "offload": 0,
            "full-offload": 0,
            "pointwise": (2 * d + 2 * a + 2 * kv + 2 * mlp_kept) * elem + 4 * H + qk_pre_norm + out_norms,
            "none": ((3 if tiled else 4) * d + 2 * a + 2 * kv + 3 * mlp_kept) * elem + 4 * H + (4 if tiled else 8)
                    + qk_pre_norm + out_norms}


def host_bytes(args, elem: int, tiled: bool = False) -> dict[str, int]:
    """Host bytes per local token a host layer keeps: ``offload`` what ``pointwise`` keeps on the
    device, ``full-offload`` the block input."""
    return {"offload": activation_bytes(args, elem, tiled)["pointwise"], "full-offload": args.dim * elem}


def transient_bytes(args, elem: int, tiled: bool = False) -> dict[str, int]:
    """Bytes per local token that one layer's backward holds beyond what the layer keeps
    (:func:`activation_bytes`) and beyond a ``none`` layer's backward, under each policy ``auto``
    chooses from.  A layer that recomputes its projections (``full``, ``sequence``) rebuilds its
    ``none`` activations; ``full-offload`` too, beside its input and the next layer's coming back.
    A ``pointwise`` layer's SwiGLU Function holds the rebuilt silu(gate) * up beside its gradient
    and the gradients of gate and up, where ``none`` has already released its kept product (w2's
    backward runs first): 2f more, and its norm Functions 2d by the same count, so 2 max(d, f)
    (counted from what each Function holds, not from a committed measurement); with the tiled MLP
    only the norm's 2d.  ``none`` rebuilds nothing.  The tiled MLP's chunk adds a constant
    (:func:`.tiled.chunk_bytes`), not per token."""
    kept = activation_bytes(args, elem, tiled)
    pointwise = 2 * (args.dim if tiled else max(args.dim, args.ffn_dim)) * elem
    return {"full": kept["none"], "sequence": kept["none"], "pointwise": pointwise, "none": 0,
            # its own activations back on the device, the next layer's on their way, pointwise's transient
            "offload": 2 * kept["pointwise"] + pointwise,
            "full-offload": kept["none"] + 2 * args.dim * elem}


def head_bytes(args, elem: int) -> int:
    """Bytes per local token the backward holds as it starts, above every layer's kept bytes: the
    final norm's input and output (kept for the loss) and the hidden states' gradient.  A layer's
    backward transient below this never sets the peak: the planner counts it as at least this."""
    return 3 * args.dim * elem


# auto's policies, most recompute / copying first
LADDER = ("full-offload", "full", "sequence", "offload", "pointwise", "none")
ORDER = ("full-offload", "offload", "none", "pointwise", "sequence", "full")  # where a plan puts them, first layer first
HOST = ("full-offload", "offload")  # policies that keep nothing on the device between forward and backward


def recompute_rank(plan) -> tuple[int, ...]:
    """How much a plan recomputes or copies, most expensive first (compare lexicographically):
    its layers of each policy of :data:`LADDER` but ``none``."""
    return tuple(plan.count(p) for p in LADDER[:-1])


def plan_cost(plan, tiled: bool) -> tuple[int, ...]:
    """How much a plan recomputes, most expensive first (compare lexicographically), where plans
    differ in the tiled MLP too: its layers that recompute attention (``full-offload``, ``full``),
    then those that run their projections again (``sequence``, ``selective``), then the tiled MLP
    (every layer's MLP forward once more, its backward rebuilding each chunk, which
    :func:`recompute_rank` does not see), then its ``offload`` and ``pointwise`` layers.

    Why the tiled MLP ranks between: below a re-projected layer, since untiled plans that re-project
    layers at the card's edge thrashed the allocator (7B at 128K over 2 ranks: 12 ``sequence``
    layers untiled, 10 retries, 20.60 s a step against 19.39 s tiled,
    ``train_llama-7b_2gpu_128k_{plan2,tiled}.json``, though their matmul FLOPs favour the untiled
    plan); above ``offload`` and ``pointwise``, which recompute no matmul (3B at 128K over 2 ranks:
    untiled with 3 ``offload`` and 24 ``pointwise`` layers 11.37 s, ``..._3b_2gpu_128k_plan2.json``)."""
    return (plan.count("full-offload"), plan.count("full"), plan.count("sequence") + plan.count("selective"),
            int(tiled), plan.count("offload"), plan.count("pointwise"))


def plan_bytes(plan, per_layer: dict[str, int], transient: dict[str, int]) -> int:
    """Peak device bytes of a plan in this model: layers run backward one at a time, each holding
    its kept bytes (``per_layer``) and, while its backward runs, a transient (:func:`transient_bytes`).
    Host layers (:data:`HOST`) keep nothing on the device and come first (:data:`ORDER`), so their
    backward runs after every other layer's has freed its activations; the rest peak at their kept
    bytes plus the largest transient among them."""
    rest = [p for p in plan if p not in HOST]
    peak = sum(per_layer[p] for p in rest) + max((transient[p] for p in rest), default=0)
    return max([peak] + [transient[p] for p in set(plan) if p in HOST])


def plan_layers(n_layers: int, per_layer: dict[str, int], budget: int, transient: dict[str, int],
                host_per_layer: dict[str, int] | None = None, host_budget: int = 0,
                allowed=LADDER) -> list[str]:
    """The policy of each layer (one of ``allowed``, a subset of :data:`LADDER`, in :data:`ORDER`):
    as little recompute as fits in ``budget`` device bytes (:func:`plan_bytes`) and ``host_budget``
    host bytes (``host_per_layer[p]`` per layer of host policy ``p``; a host policy without an
    entry is not planned).

    The plan is ranked by its most expensive work (:func:`recompute_rank`): the fewest layers that
    recompute attention with their input on the host (``full-offload``), then on the device
    (``full``), then the fewest that recompute projections (``sequence``), then the fewest that
    copy their activations to the host and back (``offload``), then the fewest that recompute
    pointwise ops (``pointwise``); the rest keep everything (``none``).  Layers are alike, so a
    plan is its counts, chosen in that order, each the smallest that some completion still fits:
    under a cap on the transient (each policy's in turn; the policies whose transient exceeds it
    are left out), the completion that needs the least device memory puts every layer the host
    budget takes on the host policies (those that keep least host memory first), which keep
    nothing on the device, and the rest on the allowed policy that keeps least.  If nothing fits,
    every layer is ``full``."""
    host_per_layer = host_per_layer or {}
    on_host = {p: host_per_layer[p] for p in HOST
               if p in allowed and host_per_layer.get(p, 0) > 0 and transient[p] <= budget}
    by_host_bytes = sorted(on_host, key=on_host.get)
    rank = [p for p in LADDER[:-1] if p in allowed]  # what to minimise, in order; "none" takes the rest

    def search(cap):
        device = [p for p in LADDER if p in allowed and p not in HOST and transient[p] <= cap]
        room = budget - cap

        def fits(fixed, left, free):
            host = sum(on_host[p] * c for p, c in fixed.items() if p in HOST)
            if host > host_budget:
                return False
            for p in by_host_bytes:
                if p in free and left:
                    take = min(left, (host_budget - host) // on_host[p])
                    left -= take
                    host += take * on_host[p]
            kept = sum(per_layer[p] * c for p, c in fixed.items() if p not in HOST)
            on_device = kept > 0 or any(c for p, c in fixed.items() if p not in HOST)
            if left:
                cheapest = min((p for p in device if p in free), key=lambda p: per_layer[p], default=None)
                if cheapest is None:
                    return False
                kept += left * per_layer[cheapest]
                on_device = True
            return kept <= room if on_device else True

        fixed, left = {}, n_layers
        for i, policy in enumerate(rank):
            free = set(rank[i + 1:]) | {"none"}
            if policy in HOST:
                if policy not in on_host:
                    continue
                top = min(left, host_budget // on_host[policy])
            elif policy not in device:
                continue
            else:
                top = left
            for c in range(top + 1):
                if fits({**fixed, policy: c}, left - c, free):
                    fixed[policy], left = c, left - c
                    break
            else:
                return None
        if not fits(fixed, left, {"none"}):  # the rest keep everything
            return None
        fixed["none"] = left
        return fixed

    caps = sorted({transient[p] for p in allowed if p not in HOST})
    plans = [c for c in (search(cap) for cap in caps) if c is not None]
    if not plans:
        return ["full"] * n_layers
    best = min(plans, key=lambda c: tuple(c.get(p, 0) for p in LADDER[:-1]))
    return [p for p in ORDER for _ in range(best.get(p, 0))]


def state_bytes(params, on_host: bool = False) -> int:
    """Device bytes of this rank's shards of ``params`` and what training keeps for them: a
    trainable parameter its master copy, gradient and two AdamW moments (16 bytes in float32), a
    frozen one (LoRA's base) itself.  ``on_host`` (FSDP2's CPU offload): all of it on the host, 0."""
    from torch.distributed.tensor import DTensor

    if on_host:
        return 0
    total = 0
    for p in params:
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size() * (4 if p.requires_grad else 1)
    return total


WORKSPACE = 3 * 2**30  # the gathered bf16 layers, the loss and the kernels' workspace


def default_budget(state: int, device) -> int | None:
    """Bytes for kept activations on ``device``: 90% of its memory less ``state`` (the device
    bytes of the parameters, gradients and optimizer states: :func:`state_bytes`) and
    :data:`WORKSPACE`.  None where the device's memory is not known (CPU): keep everything."""
    if getattr(device, "type", device) != "cuda" or not torch.cuda.is_available():
        return None
    return max(0, usable_bytes(device) - state - WORKSPACE)


def usable_bytes(device) -> int:
    """The device memory a plan may fill: 90% of the device's."""
    return int(0.9 * torch.cuda.get_device_properties(device).total_memory)


def default_host_budget(device) -> int:
    """Host bytes the ``offload`` layers may keep: half of the host's memory shared by its GPUs.
    From the total, not what is free now, so that alike ranks plan alike (the trainer also takes
    the smallest over its ranks).  0 off CUDA: nothing to offload from."""
    if getattr(device, "type", device) != "cuda" or not torch.cuda.is_available():
        return 0
    return int(0.5 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / max(1, torch.cuda.device_count()))


def check(name: str, split: float = 0.5) -> None:
    if name not in POLICIES and name != AUTO:
        raise ValueError(f"unknown checkpoint policy {name!r}; expected one of {sorted([*POLICIES, AUTO])}")
    if isinstance(split, bool) or not isinstance(split, (int, float)) or not 0.0 <= split <= 1.0:
        raise ValueError(f"checkpoint_split must be a number in [0, 1] (the fraction of each rank's tokens whose "
                         f"attention output is kept: 0 = recompute all, 1 = keep all), got {split!r}")
