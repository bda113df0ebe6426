"""Checking and planning one attention call, up to the rings its loops run on.

:func:`check_call` runs a call's two check stages in order: this rank's local checks
(attention/checks.py) and plan (attention/planning.py), then every rank's agreement on them
(attention/agreement.py: one small collective).  :func:`prepare_call` is what every
burst_attn_func call does first: check, plan, and build the plan's rings.
:func:`replan_call` rebuilds the same :class:`~burstengine.attention.loops.RingRun` from the
same call with no collective: the custom op's backward (attention/compiled.py) runs in a later
graph than its forward and cannot carry the Python plan across, but every input of the plan
(shapes, group, masks, environment) is the same then, so the plan is too, and the ranks already
agreed on it in the forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..comm import topology as topo
from ..comm.dist import group_info
from . import agreement, planning
from .call import AttnCall
from .checks import check_arguments, check_level, check_mask
from .loops import RingRun


@dataclass(frozen=True)
class Checked:
    """A call every rank agreed on: its ``plan`` (what the planner returned; None without
    one), the ``shared`` values the ranks compared, the P2P ``tag`` of its ring messages and the
    group's size ``world`` (LOCAL: 1)."""

    plan: planning.CallPlan | None
    shared: dict
    tag: int
    world: int


def check_call(q, k, v, call: AttnCall, planner: Callable[[int], tuple] | None = None) -> Checked:
    """Raise ValueError on every rank of ``call.group`` if any rank's call is bad or the ranks'
    calls disagree (attention/checks.py has the levels, attention/agreement.py the rule).

    ``planner(world) -> (CallPlan, shared)`` plans the call on a group of ``world`` ranks after the
    built-in checks pass, checking what they do not know (masks, topology...): a ValueError it
    raises is this rank's verdict; ``shared`` names the values every rank must agree on
    (agreement.agree), and the plan's ``backward`` is signed as the scheme the call runs.
    Without a planner the backward is signed as given."""
    _, world, backend = group_info(call.group)  # a group no collective can use raises here, at once
    plan, shared, error = None, {}, None
    level, timeout = "full", None
    try:
        level = check_level()
        timeout = planning.configured_timeout()
        check_arguments(q, k, v, call, world, backend)
        if planner is not None:
            plan, shared = planner(world)
            if len(shared) > agreement.SHARED_SLOTS:
                raise RuntimeError(f"the planner returned {len(shared)} shared values, at most "
                                   f"{agreement.SHARED_SLOTS} fit")
    except ValueError as e:
        error = str(e)
    except Exception as e:  # a check that crashed on this rank's odd input must not strand the others
        error = f"argument check failed: {type(e).__name__}: {e}"
    planned = plan.backward if plan is not None else call.backward
    tag = agreement.agree(q, k, v, call, world, backend, planned=planned, shared=shared, error=error, level=level,
                          timeout=timeout)
    return Checked(plan, shared, tag, world)


def plan_attention(q, k, call: AttnCall, world: int) -> tuple[planning.CallPlan, dict]:
    """A burst_attn_func call's plan and the values every rank must agree on beyond the built-in
    ones (checked on this rank: mask, topology, planned backward)."""
    pattern = check_mask(call.mask, call.layout, world, q.shape[1])
    topology = call.topology
    if topology is not None and not (isinstance(topology, str) and topology in ("auto", "single")):
        topo.resolve(topology, call.group)  # raises ValueError on a malformed one
    p = planning.plan_call(q, k, call, world, pattern)
    # every rank must pass the same mask and plan the same ring (its shape comes from the arguments
    # and the environment: BURST_TOPOLOGY, LOCAL_WORLD_SIZE, BURST_CLUSTER)
    return p, {"window": pattern.window, "cu_seqlens": pattern.cu_seqlens, "block_mask": pattern.block_mask,
               "topology (the planned ring, nodes x ranks per node)": f"{p.shape.nodes}x{p.shape.gpus_per_node}",
               "BURST_CLUSTER": planning.cluster_name()}


def prepare_call(q, k, v, call: AttnCall) -> RingRun:
    """Check (every rank, one small collective) and plan ``call`` on q, k, v, and build its
    rings: what :func:`~burstengine.attention.loops.run_attention` runs."""
    checked = check_call(q, k, v, call, lambda world: plan_attention(q, k, call, world))
    return RingRun.of(checked.plan.ring(call.group, checked.tag), checked.plan)


def replan_call(q, k, call: AttnCall) -> RingRun:
    """The RingRun :func:`prepare_call` built for ``call``, rebuilt without checks or
    communication (the call passed them once already)."""
    plan, _ = plan_attention(q, k, call, group_info(call.group)[1])
    return RingRun.of(plan.ring(call.group), plan)
