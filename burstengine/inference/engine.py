"""Distributed prefill: one forward pass over a prompt sharded across a context-parallel group.

Every rank holds its shard of the prompt under a layout (:mod:`burstengine.layout`) and runs
the whole model on it; attention is BurstAttention over the group.  Only the next-token logits
are computed: the global last token is the last local token of one rank (rank 0 under zigzag,
the last rank under contiguous and striped), which applies the LM head to that single row and
broadcasts the (batch, vocab) result, so the N x vocab logits never exist anywhere.
"""
from __future__ import annotations

import resource
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.dist import rank_of, world_of
from ..layout import position_ids as layout_positions
from ..layout import shard
from ..timing import reduce_max
from .models import PrefillModel, Sharding


@dataclass
class PrefillOutput:
    logits: torch.Tensor   # (batch, vocab) float32: the next-token logits, the same on every rank
    positions: torch.Tensor  # (n,) global positions of this rank's tokens
    kv: list | None        # per layer, this rank's (k, v) shards (batch, n, kv_heads, head_dim), after RoPE


def last_token_rank(layout: str, world: int) -> int:
    """The rank whose shard ends with the global last token (it is always a shard's last)."""
    return 0 if layout == "zigzag" else world - 1


def _world(group):
    return rank_of(group), world_of(group)


def check_prefill(seq: int, layout: str, world: int, batch: int = 1) -> str | None:
    """A message when this prompt cannot be sharded this way (checked before any collective)."""
    if seq < 1 or batch < 1:
        return f"the prompt must hold at least one token per sequence, got batch {batch} x {seq} tokens"
    try:
        layout_positions(seq, layout, 0, world)
    except ValueError as e:
        return f"{e} (prefill does not pad: give a prompt whose length the layout can split)"
    return None


def prefill(model: PrefillModel, input_ids: torch.Tensor, group=None, layout: str = "zigzag", keep_kv: bool = False,
            backward: str = "auto", kernel: str | None = None, attention: str = "burst") -> PrefillOutput:
    """Next-token logits of ``input_ids`` (batch, S), the whole prompt, identical on every rank
    of ``group`` (token ids are small; each rank keeps its shard).  With ``keep_kv`` the output
    also holds this rank's shard of every layer's keys and values (the prefill's KV cache).
    ``attention="sdpa"`` runs plain SDPA in our model instead of BurstAttention (what torch-native
    context parallelism patches; the benchmark's peer)."""
    rank, world = _world(group)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    msg = check_prefill(input_ids.shape[1], layout, world, input_ids.shape[0])
    if msg:
        raise ValueError(msg)
    S = input_ids.shape[1]
    dev = model.device
    ids = shard(input_ids, layout, rank, world).to(dev)
    pos = layout_positions(S, layout, rank, world, device=dev)
    how = Sharding(group=group, layout=layout, backward=backward, kernel=kernel, attention=attention)
    h, kv = model.hidden(ids, pos, how, keep_kv=keep_kv)
    owner = last_token_rank(layout, world)
    if rank == owner:
        logits = model.logits(h[:, -1])
    else:
        logits = torch.empty(ids.shape[0], model.vocab_size, dtype=torch.float32, device=dev)
    del h
    if world > 1:
        src = dist.get_global_rank(group, owner) if group is not None else owner
        dist.broadcast(logits, src=src, group=group)
    return PrefillOutput(logits=logits, positions=pos, kv=kv)


# --- measuring --------------------------------------------------------------------------------

def reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_bytes(device, group=None) -> tuple[int, str]:
    """The largest peak memory over the ranks, and what it measures: allocated device memory
    since the last :func:`reset_peak` on CUDA, the process's peak resident set on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        mine, what = torch.cuda.max_memory_allocated(device), "allocated"
    else:
        mine, what = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "peak RSS"
    return int(reduce_max([mine], device, group)[0]), what


