"""The ring and backward scheme of one burst_attn_func call, from the ``topology`` and
``backward`` arguments.  Every input is the same on every rank of the group (shapes, the group,
the environment torchrun gives all ranks), so every rank makes the same choice without
communicating; bad values raise ValueError before any communication."""
from __future__ import annotations

import warnings

from ..comm import topology as topo
from ..comm.topology import RingComm


def plan_call(q, k, group, pattern, layout: str, backward: str, topology) -> tuple[RingComm, str]:
    """(the ring to run on, the concrete backward scheme) for one call; ``pattern`` is the
    call's schedule.Pattern (or the causal flag)."""
    from .. import costmodel
    from .burst import _world
    from .schedule import as_pattern, ring_steps

    pattern = as_pattern(pattern)
    world = _world(group)  # LOCAL: a one-rank ring
    B, n, H, D = q.shape
    causal = pattern.causal
    shape_args = (B, n, H, k.shape[2], D, q.element_size(), causal, layout)
    mesh = None
    steps = ring_steps(layout, pattern, world, n)
    if len(steps) < world:
        # a sparse mask leaves steps with no work anywhere: the single ring skips them (the
        # double ring runs every step) and trims its messages, and the bytes it sends decide
        # the backward
        if topology not in (None, "auto", "single"):
            topo.resolve(topology, group)  # still reject a malformed topology
        labels = topo.detect(group) if world > 1 else topo.single(1)
        if backward == "auto":
            from .burst import choose_backward

            backward = choose_backward(B, n, H, k.shape[2], D, q.element_size(), world, layout=layout,
                                       mask=pattern)
        return RingComm(group, topo.single(world), labels, steps=steps), backward
    if topology is None or topology == "single":
        labels = topo.detect(group) if world > 1 else topo.single(1)
        shape = topo.single(world)
        backward = costmodel.choose_call(shape, *shape_args, backward, costmodel.env_cluster())[1]
    elif isinstance(topology, str) and topology == "auto":
        labels = topo.detect(group) if world > 1 else topo.single(1)
        if labels.nodes > 1 and labels.gpus_per_node > 1 and not topo.spans_world(group):
            # the double ring's sub-groups can only be made by the whole job (pass a DeviceMesh)
            _warn_once(f"topology='auto': {labels} nodes detected but the group is not the whole job, so the "
                       "double ring's sub-groups cannot be made here; running the single ring (pass "
                       "topology=<2-D DeviceMesh> to get the double ring)")
            shape = topo.single(world)
            backward = costmodel.choose_call(shape, *shape_args, backward, costmodel.env_cluster())[1]
        else:
            shape, backward = costmodel.choose_call(labels, *shape_args, backward, costmodel.env_cluster())
    else:
        shape = labels = topo.resolve(topology, group)
        mesh = topology if topo.is_mesh(topology) else None
        backward = costmodel.choose_call(shape, *shape_args, backward, costmodel.env_cluster())[1]
    # cheap to build: the double ring's sub-groups are made once and cached (topology.block_group)
    return RingComm(group, shape, labels, mesh=mesh), backward


_warned: set = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, stacklevel=3)
