"""The public attention call: check -> plan -> run.

:func:`burst_attn_func` gathers its arguments into one AttnCall (attention/call.py), checks
it on every rank (attention/checks.py locally, then attention/agreement.py; the local stage
includes the call's plan, attention/planning.py, so the ranks agree on the planned backward),
builds the plan's rings and runs the loops (attention/loops.py).  :func:`prepare_call` is the
first two steps, for callers that run the loops themselves (attention/prepare.py,
attention/sequence_recompute.py).  Under torch.compile the call goes through a custom op instead
(attention/compiled.py), which takes the AttnCall encoded.
"""
from __future__ import annotations

import torch

from .call import AttnCall, MaskArgs
from .compiled import compiled_call
from .loops import run_attention
from .prepare import prepare_call  # re-exported: callers that run the loops themselves


def burst_attn_func(q, k, v, *, group=None, causal=False, layout="contiguous", softmax_scale=None,
                    backward="auto", return_lse=False, kernel=None, window=None, cu_seqlens=None,
                    block_mask=None, block_size=None, topology="auto"):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    q: (batch, seq_local, heads, head_dim); k, v: (batch, seq_local, kv_heads, head_dim) with
    heads a multiple of kv_heads.  Each rank passes its shard under ``layout`` (see
    :func:`burstengine.shard`).  Returns this rank's output shard (and, with
    ``return_lse``, the float32 log-sum-exp of shape (batch, heads, seq_local)).

    group: the ring's ranks (None: the default group); ``burstengine.comm.dist.LOCAL``: this
    rank alone inside any job (attention of its own tokens, nothing communicated).

    backward: "burst" moves Q, dO, D, lse and dQ; "ring" moves K, V, dK, dV; "auto" lets the
    cost model pick (the one that sends fewer bytes unless BURST_CLUSTER gives link figures;
    attention/planning.py).
    kernel: "auto", "reference", "flash", "cudnn", "triton" (or env BURST_KERNEL).

    topology: the ring to run on.  "auto" (default): one node -> the single ring; several
    nodes (LOCAL_WORLD_SIZE, or BURST_TOPOLOGY="NxM") -> the topology-aware double ring, unless
    the cost model with BURST_CLUSTER's figures predicts the single ring faster.  None or
    "single": always the single ring.  A :class:`~burstengine.Topology`, "NxM" or a 2-D
    DeviceMesh (inter-node, intra-node): the double ring of that shape.

    Sparse masks (positions are global; every rank must pass the same values):

    * ``window=W`` (needs ``causal=True``): each query sees the W most recent keys, itself included.
    * ``cu_seqlens``: packed documents, boundaries 0 = c_0 <= c_1 <= ... <= c_m = global length
      (list, tuple or 1-D integer tensor); nothing is visible across documents, attention
      within one is causal when ``causal`` (bidirectional otherwise).  Combines with ``window``.
    * ``block_mask``: boolean (S/bs, S/bs) matrix over the global sequence cut into blocks of
      ``block_size`` = bs tokens (inferred from its shape); block (i, j) on lets block i see
      block j.  Combines with ``causal`` only.  Under "striped" (the balanced layout, BurstEngine
      Fig. 11) bs must be a multiple of the world size; under "contiguous" bs must divide the
      local length, under "zigzag" half of it.

    Block pairs with nothing visible are not computed, and ring steps no rank needs are not run,
    neither compute nor transfer (e.g. "contiguous" with a window of W <= local length runs 2 of
    the G steps; see schedule.run_steps); a call that skips steps runs on the single ring.  On
    the single ring each hop carries only the rows later steps read (W <= local length: the
    last W - 1 rows of K/V; see schedule.travel_rows).
    Rows with no visible key get a zero output, lse = -inf and zero gradients.

    Under torch.compile the call is the custom op ``burstengine::burst_attn`` (same checks, plan
    and loops, run inside the compiled graph; attention/compiled.py), so ``fullgraph=True``
    traces through it; ``topology`` must then be "auto", "single", "NxM", a Topology or None.
    """
    call = AttnCall(group=group, layout=layout, softmax_scale=softmax_scale, backward=backward, kernel=kernel,
                    topology=topology, mask=MaskArgs(causal=causal, window=window, cu_seqlens=cu_seqlens,
                                                     block_mask=block_mask, block_size=block_size))
    if torch.compiler.is_compiling():
        out, lse = compiled_call(q, k, v, call)
    else:
        run = prepare_call(q, k, v, call)  # checked first: q, k, v may not even be tensors
        out, lse = run_attention(q, k.contiguous(), v.contiguous(), run)
    return (out, lse) if return_lse else out

