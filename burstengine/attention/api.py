"""The public attention call: check -> plan -> run.

:func:`burst_attn_func` checks its arguments on every rank (attention/checks.py; the local stage
includes the call's plan, attention/planning.py, so the ranks agree on the planned backward),
builds the plan's rings and runs the loops (attention/loops.py).  :func:`prepare_call` is the
first two steps, for callers that run the loops themselves (attention/seqckpt.py).
"""
from __future__ import annotations

from ..comm import topology as topo
from . import planning
from .checks import PLANNED_BACKWARD, check_args, check_sparse
from .loops import RingRun, run_attention


def burst_attn_func(q, k, v, *, group=None, causal=False, layout="contiguous", softmax_scale=None,
                    backward="auto", return_lse=False, kernel=None, window=None, cu_seqlens=None,
                    block_mask=None, block_size=None, topology="auto"):
    """Exact attention over a sequence sharded across the ranks of ``group``.

    q: (batch, seq_local, heads, head_dim); k, v: (batch, seq_local, kv_heads, head_dim) with
    heads a multiple of kv_heads.  Each rank passes its shard under ``layout`` (see
    :func:`burstengine.shard`).  Returns this rank's output shard (and, with
    ``return_lse``, the float32 log-sum-exp of shape (batch, heads, seq_local)).

    group: the ring's ranks (None: the default group); ``burstengine.comm.topology.LOCAL``: this
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
    """
    run = prepare_call(q, k, v, group=group, causal=causal, layout=layout, softmax_scale=softmax_scale,
                       backward=backward, kernel=kernel, window=window, cu_seqlens=cu_seqlens, block_mask=block_mask,
                       block_size=block_size, topology=topology)
    out, lse = run_attention(q, k.contiguous(), v.contiguous(), run)
    return (out, lse) if return_lse else out


def prepare_call(q, k, v, *, group=None, causal=False, layout="contiguous", softmax_scale=None, backward="auto",
                 kernel=None, window=None, cu_seqlens=None, block_mask=None, block_size=None,
                 topology="auto") -> RingRun:
    """Check (every rank, one small collective) and plan a burst_attn_func call, and build its
    rings: what :func:`~burstengine.attention.loops.run_attention` runs.  Same arguments as
    :func:`burst_attn_func`."""
    plans = []

    def plan(world):
        """The arguments checks.py does not know, checked on this rank, and the call's plan:
        every rank must pass the same mask, plan the same ring (its shape comes from the
        arguments and the environment: BURST_TOPOLOGY, LOCAL_WORLD_SIZE, BURST_CLUSTER) and the
        same backward."""
        pattern = check_sparse(causal, layout, world, q.shape[1], window, cu_seqlens, block_mask, block_size)
        if topology is not None and not (isinstance(topology, str) and topology in ("auto", "single")):
            topo.resolve(topology, group)  # raises ValueError on a malformed one
        plans.append(planning.plan_call(q, k, group, world, pattern, layout, backward, topology, kernel, softmax_scale))
        p = plans[0]
        return {"window": pattern.window, "cu_seqlens": pattern.cu_seqlens, "block_mask": pattern.block_mask,
                "topology (the planned ring, nodes x ranks per node)": f"{p.shape.nodes}x{p.shape.gpus_per_node}",
                "BURST_CLUSTER": planning.cluster_name(), PLANNED_BACKWARD: p.backward}

    tag = {}
    check_args(q, k, v, group, causal, layout, softmax_scale, backward, extra=plan, out=tag)
    return RingRun.of(plans[0].ring(group, tag["tag"]), plans[0])
