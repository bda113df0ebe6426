"""Distributed prefill: one forward pass over a prompt sharded across a context-parallel group.

Every rank holds its shard of the prompt under a layout (:mod:`burstengine.layout`) and runs
the whole model on it; attention is BurstAttention over the group.  A prompt of any length
runs: one the layout cannot split evenly is padded at the end to the next length it can
(:func:`padded_length`); under the causal mask no real token sees a pad token, and the pad
rows are dropped from what is returned.  Only the next-token logits are computed: the rank
holding a sequence's last real token applies the final norm and the LM head to that single row,
and one sum over the ranks gives every rank the (batch, vocab) result, so the N x vocab logits
never exist anywhere.  Generation (:mod:`.generate`) runs this prefill, with a KV sink into its
cache and each prompt's own length.
"""
from __future__ import annotations

import resource
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm.dist import initialized, rank_of, world_of
from ..kernels import acc_dtype
from ..layout import position_ids as layout_positions
from ..layout import shard
from ..model import ContextParallel
from ..model.context_parallel import LOCAL
from ..timing import reduce_max
from .models import PrefillModel


@dataclass
class PrefillOutput:
    logits: torch.Tensor   # (batch, vocab) float32 (float64 for a float64 model): the next-token logits, the same
    #                        on every rank
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


def context_parallel(attention: str, group=None, layout: str = "zigzag", backward: str = "auto",
                     kernel: str | None = None) -> ContextParallel:
    """How a prefill's attention sees the prompt.  ``attention="burst"``: BurstAttention over
    ``group`` (None: the default group when one is initialised, so that in a job, even of one
    rank, "burst" means BurstAttention's kernels; else this process alone, where the model runs
    plain SDPA on its whole prompt).  ``"sdpa"``: plain SDPA on this rank's tokens: the whole
    prompt on one rank, else a shard that torch's context_parallel patches into its own ring
    (the benchmark's peer).  A kernel named outside a job (``kernel="fp8"``, not "auto") runs
    on the whole prompt as a one-rank ring (LOCAL), rather than being dropped for SDPA."""
    if attention == "burst":
        if group is None and initialized():
            group = dist.group.WORLD
        elif group is None and kernel not in (None, "auto"):
            group = LOCAL
        return ContextParallel(group=group, layout=layout, backward=backward, kernel=kernel)
    if attention == "sdpa":
        return ContextParallel(layout=layout, attention="sdpa" if world_of(group) == 1 else "torch-cp")
    raise ValueError(f"unknown attention {attention!r}; expected 'burst' or 'sdpa'")


def check_lengths(lengths, batch: int, seq: int) -> str | None:
    """A message when ``lengths`` is not one length in [1, seq] per sequence of the batch."""
    if lengths is None:
        return None
    ok = len(lengths) == batch and all(isinstance(n, int) and 1 <= n <= seq for n in lengths)
    return None if ok else (f"lengths must hold one length in [1, {seq}] per sequence of the batch of {batch}, "
                            f"got {list(lengths)}")


def prefill(model: PrefillModel, input_ids: torch.Tensor, group=None, layout: str = "zigzag", keep_kv: bool = False,
            backward: str = "auto", kernel: str | None = None, attention: str = "burst", *, lengths=None,
            kv_sink=None, chunk: int | None = None) -> PrefillOutput:
    """Next-token logits of ``input_ids`` (batch, S), the whole prompt, identical on every rank
    of ``group`` (token ids are small; each rank keeps its shard).  With ``keep_kv`` the output
    also holds this rank's shard of every layer's keys and values (the prefill's KV cache).
    ``attention="sdpa"`` runs plain SDPA in our model instead of BurstAttention (what torch-native
    context parallelism patches; the benchmark's peer).

    ``lengths``: each sequence's own length, for a batch of prompts padded at the end to S: the
    logits of sequence b come from its token at ``lengths[b] - 1`` (default: the last token of
    every sequence).  ``kv_sink(layer, k, v)``: receives every layer's keys (after RoPE) and
    values of this rank's shard as they are made, (batch, n, kv_heads, head_dim), the rows that
    pad the prompt to a length the layout shards included (generation fills its cache from
    them).  ``chunk``: token rows per piece of the model's token-wise work (norms, projections,
    MLP), so a long prompt's intermediates never exist whole (None: pieces of
    ``model.layers.CHUNK`` tokens over the batch when the shard holds more; 0: the whole shard at
    once).

    A model that holds only its tensor-parallel slices over ``group`` (``load_model(...,
    tp_group=group)``) runs each layer with its weights gathered from the ranks' slices, and
    its LM head by vocabulary slices."""
    rank, world = _world(group)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    B, real = input_ids.shape
    msg = check_prefill(real, layout, world, B) or check_lengths(lengths, B, real) or model.refuses(attention)
    split = model.model.tp if model.sliced else None
    if split is not None and (split.rank, split.world) != (rank, world):
        msg = (f"the model holds the tensor-parallel slice of rank {split.rank} of {split.world}; this prefill is "
               f"rank {rank} of {world}")
    if msg:
        raise ValueError(msg)
    cp = context_parallel(attention, group, layout, backward, kernel)
    S = padded_length(real, layout, world)
    if S > real:  # pad at the end: causal attention keeps pad tokens out of every real token's view
        input_ids = torch.cat([input_ids, input_ids.new_zeros(B, S - real)], dim=1)
    dev = model.device
    ids = shard(input_ids, layout, rank, world).to(dev)
    pos = layout_positions(S, layout, rank, world)  # this rank's global positions, on the host
    # each sequence's last token: its row on the rank that holds it, zeros elsewhere, and one
    # sum (x + 0 = x exactly) gives every rank the logits
    rows = [(b, int(i)) for b, n in enumerate(lengths or [real] * B) for i in torch.nonzero(pos == n - 1).flatten()]
    at = tuple(torch.tensor([r[j] for r in rows], dtype=torch.int64, device=dev) for j in (0, 1))
    kv = [None] * model.n_layers if keep_kv else None
    sink = kv_sink
    if keep_kv:
        def sink(i, k, v):
            kv[i] = (k, v)
            if kv_sink is not None:
                kv_sink(i, k, v)
    pos = pos.to(dev)
    h = model.hidden(ids, pos, cp, rows=at, kv_sink=sink, chunk=chunk)
    if model.sliced:  # the LM head is split by vocabulary: every rank needs the rows
        last = h.new_zeros(B, h.shape[-1])
        if rows:
            last[at[0]] = h
        if world > 1:
            dist.all_reduce(last, group=group)
        logits = model.logits(last)
    else:
        logits = torch.zeros(B, model.vocab_size, dtype=acc_dtype(model.dtype), device=dev)
        if rows:
            logits[at[0]] = model.logits(h)
        if world > 1:
            dist.all_reduce(logits, group=group)
    del h
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


