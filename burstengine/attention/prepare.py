"""Checking and planning one burst_attn_func call, up to the rings its loops run on.

:func:`prepare_call` is what every call does first: check (every rank, one small collective;
attention/checks.py) and plan (attention/planning.py).  :func:`replan_call` rebuilds the same
:class:`~burstengine.attention.loops.RingRun` from the same arguments with no collective: the
custom op's backward (attention/compiled.py) runs in a later graph than its forward and cannot
carry the Python plan across, but every input of the plan (shapes, group, masks, environment) is
the same then, so the plan is too, and the ranks already agreed on it in the forward.
"""
from __future__ import annotations

from ..comm import topology as topo
from ..comm.dist import group_info
from . import planning
from .checks import PLANNED_BACKWARD, check_args, check_sparse
from .loops import RingRun


def _plan(q, k, group, world, causal, layout, softmax_scale, backward, kernel, window, cu_seqlens, block_mask,
          block_size, topology) -> tuple[planning.CallPlan, dict]:
    """The call's plan and the values every rank must agree on (the arguments checks.py does not
    know, checked on this rank: mask, topology, planned backward)."""
    pattern = check_sparse(causal, layout, world, q.shape[1], window, cu_seqlens, block_mask, block_size)
    if topology is not None and not (isinstance(topology, str) and topology in ("auto", "single")):
        topo.resolve(topology, group)  # raises ValueError on a malformed one
    p = planning.plan_call(q, k, group, world, pattern, layout, backward, topology, kernel, softmax_scale)
    # every rank must pass the same mask, plan the same ring (its shape comes from the arguments and
    # the environment: BURST_TOPOLOGY, LOCAL_WORLD_SIZE, BURST_CLUSTER) and the same backward
    return p, {"window": pattern.window, "cu_seqlens": pattern.cu_seqlens, "block_mask": pattern.block_mask,
               "topology (the planned ring, nodes x ranks per node)": f"{p.shape.nodes}x{p.shape.gpus_per_node}",
               "BURST_CLUSTER": planning.cluster_name(), PLANNED_BACKWARD: p.backward}


def prepare_call(q, k, v, *, group=None, causal=False, layout="contiguous", softmax_scale=None, backward="auto",
                 kernel=None, window=None, cu_seqlens=None, block_mask=None, block_size=None,
                 topology="auto") -> RingRun:
    """Check (every rank, one small collective) and plan a burst_attn_func call, and build its
    rings: what :func:`~burstengine.attention.loops.run_attention` runs.  Same arguments as
    :func:`~burstengine.attention.api.burst_attn_func`."""
    plans = []

    def plan(world):
        p, agreed = _plan(q, k, group, world, causal, layout, softmax_scale, backward, kernel, window, cu_seqlens,
                          block_mask, block_size, topology)
        plans.append(p)
        return agreed

    tag = {}
    check_args(q, k, v, group, causal, layout, softmax_scale, backward, extra=plan, out=tag)
    return RingRun.of(plans[0].ring(group, tag.get("tag", 0)), plans[0])


def replan_call(q, k, *, group=None, causal=False, layout="contiguous", softmax_scale=None, backward="auto",
                kernel=None, window=None, cu_seqlens=None, block_mask=None, block_size=None,
                topology="auto") -> RingRun:
    """The RingRun :func:`prepare_call` built for a call with these arguments, rebuilt without
    checks or communication (the call passed them once already)."""
    world = group_info(group)[1]
    plan, _ = _plan(q, k, group, world, causal, layout, softmax_scale, backward, kernel, window, cu_seqlens,
                    block_mask, block_size, topology)
    return RingRun.of(plan.ring(group), plan)
