"""Distributed prefill: one forward pass over a prompt sharded across a context-parallel group.

Every rank holds its shard of the prompt under a layout (:mod:`burstengine.layout`) and runs
the whole model on it; attention is BurstAttention over the group.  A prompt of any length
runs: one the layout cannot split evenly is padded at the end to the next length it can
(:func:`padded_length`); under the causal mask no real token sees a pad token, and the pad
rows are dropped from what is returned.  Only the next-token logits are computed: the rank
holding the last real token applies the LM head to that single row and broadcasts the
(batch, vocab) result, so the N x vocab logits never exist anywhere.
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
    """The rank whose shard ends with the global last token of an unpadded sequence (it is
    always a shard's last)."""
    return 0 if layout == "zigzag" else world - 1


def padded_length(seq: int, layout: str, world: int) -> int:
    """The shortest length >= ``seq`` that ``layout`` shards over ``world`` ranks."""
    for s in range(seq, seq + 2 * world + 1):
        try:
            layout_positions(s, layout, 0, world)
            return s
        except ValueError:
            continue
    raise ValueError(f"no length in [{seq}, {seq + 2 * world}] shards under layout {layout!r} on {world} ranks")


def holder(pos: int, seq: int, layout: str, world: int) -> tuple[int, int]:
    """(rank, local row) of global position ``pos`` in a ``seq``-token sequence."""
    for r in range(world):
        hit = torch.nonzero(layout_positions(seq, layout, r, world) == pos).flatten()
        if len(hit):
            return r, int(hit[0])
    raise ValueError(f"position {pos} is not in a {seq}-token sequence")


def _world(group):
    return rank_of(group), world_of(group)


def check_prefill(seq: int, layout: str, world: int, batch: int = 1) -> str | None:
    """A message when this prompt cannot be sharded this way (checked before any collective)."""
    if seq < 1 or batch < 1:
        return f"the prompt must hold at least one token per sequence, got batch {batch} x {seq} tokens"
    try:
        padded_length(seq, layout, world)
    except ValueError as e:
        return str(e)
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
    real = input_ids.shape[1]
    S = padded_length(real, layout, world)
    if S > real:  # pad at the end: causal attention keeps pad tokens out of every real token's view
        input_ids = torch.cat([input_ids, input_ids.new_zeros(input_ids.shape[0], S - real)], dim=1)
    dev = model.device
    ids = shard(input_ids, layout, rank, world).to(dev)
    pos = layout_positions(S, layout, rank, world, device=dev)
    how = Sharding(group=group, layout=layout, backward=backward, kernel=kernel, attention=attention)
    h, kv = model.hidden(ids, pos, how, keep_kv=keep_kv)
    owner, row = holder(real - 1, S, layout, world)
    if rank == owner:
        logits = model.logits(h[:, row])
    else:
        logits = torch.empty(ids.shape[0], model.vocab_size, dtype=torch.float32, device=dev)
    del h
    if world > 1:
        src = dist.get_global_rank(group, owner) if group is not None else owner
        dist.broadcast(logits, src=src, group=group)
    if S > real:  # what the caller keeps holds real tokens only
        keep = pos < real
        pos = pos[keep]
        if kv is not None:
            kv = [(k[:, keep], v[:, keep]) for k, v in kv]
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


