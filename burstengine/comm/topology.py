"""Nodes and process groups: how a group's ranks sit on nodes, and the sub-groups made from them
(BurstEngine §3.1).

Ranks are grouped into ``nodes`` nodes of ``gpus_per_node`` ranks, node-major (group rank =
node * gpus_per_node + local), as torchrun numbers them (schedule/order.py's :class:`Topology`).
The grouping comes from, first match wins: an explicit ``Topology`` (or "NxM" string, or a 2-D
DeviceMesh), the ``BURST_TOPOLOGY`` environment variable ("2x4": 2 nodes of 4 ranks; this is how
2 nodes x 2 GPUs are emulated on one host, or 2 x 2 gloo processes on a CPU), then
``LOCAL_WORLD_SIZE`` (set by torchrun); with none of them the group is one node.  The
environment is read by attention/planning.py and handed to :func:`detect`.

The rings that run on these groups (the single ring and the topology-aware double ring) are
comm/rings.py's.
"""
from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..schedule.order import Topology, node_blocks, single  # node_blocks: callers make groups of its blocks
from . import fault
from .dist import LOCAL, world_of

ENV = "BURST_TOPOLOGY"  # read by attention/planning.py, passed to detect() as ``spec``


def detect(group=None, spec: str | None = None, local_world_size: str | int | None = None) -> Topology:
    """The node grouping of ``group`` from ``spec`` (BURST_TOPOLOGY's value), else
    ``local_world_size`` (LOCAL_WORLD_SIZE's), else one node.

    Uses only the environment (read by the caller, attention/planning.py) and group
    membership, which torchrun gives every rank alike, so all ranks of the group reach the same
    answer without communicating."""
    world = world_of(group)
    if spec:
        topo = Topology.parse(spec)
        if topo.world != world:
            raise ValueError(f"{ENV}={spec!r} describes {topo.world} ranks but the group has {world}")
        return topo
    lws = local_world_size
    if not lws or world == 1:
        return single(world)
    lws = int(lws)
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    nodes = [r // lws for r in ranks]
    # the group's ranks must fill its nodes in equal, contiguous, node-major blocks
    per = nodes.count(nodes[0])
    if world % per or any(nodes[i] != nodes[(i // per) * per] for i in range(world)) or \
            len(set(nodes)) != world // per:
        return single(world)
    return Topology(world // per, per)


def resolve(topology, group=None) -> Topology:
    """A Topology from the ``topology=`` argument forms (Topology, "NxM", 2-D DeviceMesh)."""
    world = world_of(group)
    if isinstance(topology, Topology):
        topo = topology
    elif isinstance(topology, str):
        topo = Topology.parse(topology)
    elif is_mesh(topology):
        if topology.ndim != 2:
            raise ValueError(f"a DeviceMesh topology must be 2-D (inter-node, intra-node), got {topology.ndim}-D")
        topo = Topology(*map(int, topology.shape))
        if world > 1 and topology.mesh.flatten().tolist() != dist.get_process_group_ranks(group or dist.group.WORLD):
            raise ValueError("the DeviceMesh's ranks, node-major, must be the group's ranks in order")
    else:
        raise ValueError(f"topology must be None, 'auto', 'single', a Topology, 'NxM' or a 2-D DeviceMesh; "
                         f"got {topology!r}")
    if topo.world != world:
        raise ValueError(f"topology {topo} describes {topo.world} ranks but the group has {world}")
    return topo


def is_mesh(x) -> bool:
    return isinstance(x, DeviceMesh)


# --- process groups ---------------------------------------------------------------------------

_GROUPS: dict = {}


def _group_key(group):
    return dist.get_process_group_ranks(group or dist.group.WORLD)


def spans_world(group) -> bool:
    """Whether ``group`` is the whole job in rank order (then its sub-groups can be made here)."""
    return _group_key(group) == list(range(dist.get_world_size()))


def block_group(group, blocks: list[list[int]], timeout: float | None = None, options_for=None):
    """The process group of this rank's block, for ``blocks`` a partition of ``group``'s ranks
    (group ranks, each block in increasing order).  A block that is the whole group is
    ``group`` itself; a one-rank block is ``LOCAL`` (nothing to communicate).

    Other blocks are made with ``dist.new_group``, which every rank of the default group must
    enter: they are made once (and cached) when ``group`` spans the whole job, all blocks in
    the same order on every rank (:func:`make_groups`: bounded by ``timeout``, BURST_TIMEOUT's
    seconds, and a rank that does not arrive is named in a RankLost).  For a smaller group make
    the groups up front (a DeviceMesh passed as ``topology``).

    The cache is per parent group: sub-groups made under ``group`` are returned only for calls
    on that same ``group``.  ``options_for(block)`` (global ranks -> backend options, or None
    for the default) sets how the groups are made, the first time; a later call that names
    other options for groups already made is refused (those would silently be the old ones)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = next(b for b in blocks if rank in b)
    if list(mine) == list(range(world)):
        return group
    if len(mine) == 1:
        return LOCAL
    ranks = _group_key(group)
    # keyed by the default group too: a re-initialised job must not reuse groups of the last one;
    # and by the parent, so groups made with other options (under another parent) stay apart
    key = (id(dist.distributed_c10d._get_default_group()), (group or dist.group.WORLD).group_name, tuple(ranks),
           tuple(map(tuple, blocks)))
    if key not in _GROUPS:
        if not spans_world(group):
            raise ValueError(
                f"a double ring or hybrid over a process group of {world} of the job's {dist.get_world_size()} ranks "
                "needs sub-groups that only the whole job can make: run it on the whole job's group, or, for the "
                "double ring, pass topology= a 2-D DeviceMesh (init_device_mesh(..., (nodes, gpus_per_node))) "
                "made up front")
        _GROUPS[key] = (make_groups([[ranks[r] for r in b] for b in blocks], timeout, options_for), options_for)
    made, made_with = _GROUPS[key]
    if options_for is not None and options_for is not made_with:
        raise ValueError(f"the sub-groups {blocks} of this group were already made with other options")
    return made[tuple(ranks[r] for r in mine)]


_MADE: list = [0]  # sets of sub-groups this process has made (one store key per set)


def make_groups(blocks: list[list[int]], timeout: float | None = None, options_for=None) -> dict:
    """{tuple(block): group} for ``blocks`` of global ranks, made by every rank of the job;
    ``options_for(block)``: the backend options of that block's group (``new_group``'s
    ``pg_options``; None, or a None answer: the default).

    ``dist.new_group`` waits for every rank of the job with no deadline a caller can set on
    its barrier, so a rank that died just before (the first call that uses the double ring)
    used to hold the others there for the whole process-group timeout.  So the ranks first
    check in through the c10d store and wait at most ``timeout`` seconds (None: the store's
    own timeout) for each other: a rank that never comes is named in a RankLost; then the
    groups are made with the same deadline (a rank that dies in the moment between ends in a
    RankLost naming the sub-group)."""
    me, world = dist.get_rank(), dist.get_world_size()
    store = fault.store()
    deadline = timeout if timeout is not None else (store.timeout.total_seconds() if store is not None else None)
    what = f"creating the sub-groups {blocks} (the double ring's or hybrid's)"
    n = _MADE[0]
    _MADE[0] += 1
    if store is not None:
        fault.check_in(store, f"groups/{n}", me, range(world), deadline, what)
    kwargs = {"timeout": timedelta(seconds=deadline)} if deadline else {}
    made = {}
    for b in blocks:
        op = fault.Op(f"{what}: the group of ranks {b}", group_ranks=tuple(b), deadline=deadline)
        opts = options_for(b) if options_for is not None else None
        made[tuple(b)] = fault.post(lambda: dist.new_group(b, pg_options=opts, **kwargs), op)
    return made
