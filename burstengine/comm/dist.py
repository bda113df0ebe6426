"""Whether torch.distributed is up, and a group's size and this rank's place in it: the one
place that asks, so that every caller treats "not initialised" and ``LOCAL`` alike."""
from __future__ import annotations

import torch.distributed as dist

LOCAL = "local"  # the group of a one-rank ring or block, whatever the job: nothing is communicated


def initialized() -> bool:
    """torch.distributed is available and its default group is initialised."""
    return dist.is_available() and dist.is_initialized()


def world_of(group=None) -> int:
    """Ranks in ``group`` (None: the default group); 1 for ``LOCAL`` or without torch.distributed."""
    if group is LOCAL or not initialized():
        return 1
    return dist.get_world_size(group)


def rank_of(group=None) -> int:
    """This rank's index in ``group``; 0 for ``LOCAL`` or without torch.distributed."""
    if group is LOCAL or not initialized():
        return 0
    return dist.get_rank(group)


def group_info(group):
    """(rank, world, backend) of this rank in ``group`` (backend None without a group); raises
    ValueError at once if the group is unusable: given while torch.distributed is not
    initialised, not a process group, or this rank not a member (every rank that passes it
    fails alike, and no collective is possible over it)."""
    if group is LOCAL:  # a one-rank ring inside any job (or none): nothing to agree on
        return 0, 1, None
    if group is not None and not initialized():
        raise ValueError("a process group was given but torch.distributed is not initialized")
    if not initialized():
        return 0, 1, None
    try:
        rank = dist.get_rank(group)
    except Exception as e:  # a group object from another run, or not a group at all
        raise ValueError(f"group is not a usable process group: {e}") from None
    if rank < 0:
        raise ValueError("this rank is not a member of the given process group")
    return rank, dist.get_world_size(group), str(dist.get_backend(group)).lower()
