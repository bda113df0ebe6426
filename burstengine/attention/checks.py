"""Argument checks for burst_attn_func.  They look only at this rank's arguments and run
before any communication, so a bad call raises the same ValueError on every rank that makes
it instead of leaving the others waiting in the ring."""
from __future__ import annotations

import math
import operator

import torch
import torch.distributed as dist

from ..layout import LAYOUTS

BACKWARDS = ("auto", "burst", "ring")


def check_args(q, k, v, group, causal, layout, softmax_scale, backward) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq_local, heads, head_dim), got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    B, S, H, D = q.shape
    if k.shape[0] != B:
        raise ValueError(f"batch sizes differ: q has {B}, k/v have {k.shape[0]}")
    if k.shape[1] != S:
        raise ValueError(f"q has {S} local tokens but k/v have {k.shape[1]}: each rank must hold the same shard of q, k, v")
    if k.shape[3] != D:
        raise ValueError(f"head dims differ: q has {D}, k/v have {k.shape[3]}")
    Hkv = k.shape[2]
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"q heads ({H}) must be a multiple of k/v heads ({Hkv})")
    if min(B, S, H, D) < 1:
        raise ValueError(f"empty input: q has shape {tuple(q.shape)}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if layout == "zigzag" and S % 2:
        raise ValueError(f"layout 'zigzag' needs an even number of local tokens (2 chunks per rank), got {S}")
    if backward not in BACKWARDS:
        raise ValueError(f"unknown backward {backward!r}; expected one of {BACKWARDS}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale)
                                          and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number, got {softmax_scale!r}")
    if group is not None and not (dist.is_available() and dist.is_initialized()):
        raise ValueError("a process group was given but torch.distributed is not initialized")
    if dist.is_available() and dist.is_initialized():
        try:
            rank = dist.get_rank(group)
        except Exception as e:  # a group object from another run, or not a group at all
            raise ValueError(f"group is not a usable process group: {e}") from None
        if rank < 0:
            raise ValueError("this rank is not a member of the given process group")
        backend = str(dist.get_backend(group)).lower()
        if dist.get_world_size(group) > 1:
            if "nccl" in backend and q.device.type != "cuda":
                raise ValueError(f"the group uses NCCL but the tensors are on {q.device}; move them to CUDA")
            if backend == "gloo" and q.device.type != "cpu":
                raise ValueError(f"the group uses gloo but the tensors are on {q.device}; use NCCL for CUDA tensors")


def check_sparse(causal, layout, world, n, window, cu_seqlens, block_mask, block_size):
    """Check the sparse-mask arguments of burst_attn_func and return their schedule.Pattern.

    Every value is global (the whole sequence of ``n * world`` tokens) and must be the same on
    every rank: the ring steps that run are derived from them."""
    from .schedule import Pattern

    S = n * world
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int (keys each query sees), got {window!r}")
        if not causal:
            raise ValueError("window needs causal=True: a sliding window looks back at the W most recent keys")
    cu = None
    if cu_seqlens is not None:
        if isinstance(cu_seqlens, torch.Tensor):
            if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
                raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} "
                                 f"of shape {tuple(cu_seqlens.shape)}")
            cu = tuple(int(c) for c in cu_seqlens.tolist())
        else:
            try:
                if any(isinstance(c, bool) for c in cu_seqlens):
                    raise TypeError
                cu = tuple(operator.index(c) for c in cu_seqlens)
            except TypeError:
                raise ValueError(f"cu_seqlens must be a sequence of ints, got {_short(cu_seqlens)}") from None
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != S:
            raise ValueError(f"cu_seqlens must run from 0 to the global sequence length {S} "
                             f"({n} local tokens x {world} ranks), got {_short(cu)}")
        if any(b < a for a, b in zip(cu[:-1], cu[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {_short(cu)}")
    bm, bs = None, 0
    if block_mask is None:
        if block_size is not None:
            raise ValueError("block_size was given without a block_mask")
    else:
        if window is not None or cu is not None:
            raise ValueError("block_mask cannot be combined with window or cu_seqlens; fold them into the block mask")
        if not isinstance(block_mask, torch.Tensor) or block_mask.dtype != torch.bool or block_mask.dim() != 2 \
                or block_mask.shape[0] != block_mask.shape[1] or block_mask.shape[0] < 1:
            raise ValueError("block_mask must be a square 2-D bool tensor (blocks x blocks), got "
                             + (f"{block_mask.dtype} of shape {tuple(block_mask.shape)}"
                                if isinstance(block_mask, torch.Tensor) else type(block_mask).__name__))
        nb = block_mask.shape[0]
        if S % nb:
            raise ValueError(f"block_mask has {nb} blocks per side, which does not divide the global length {S}")
        bs = S // nb
        if block_size is not None and block_size != bs:
            raise ValueError(f"block_size {block_size!r} does not match block_mask: {nb} blocks of a {S}-token "
                             f"sequence are {bs} tokens each")
        if layout == "striped" and bs % world:
            raise ValueError(f"block size {bs} must be a multiple of the world size {world} under layout 'striped' "
                             "(each rank holds the same share of every block)")
        if layout == "contiguous" and n % bs:
            raise ValueError(f"block size {bs} must divide the local length {n} under layout 'contiguous'")
        if layout == "zigzag" and (n // 2) % bs:
            raise ValueError(f"block size {bs} must divide the zigzag chunk of {n // 2} tokens under layout 'zigzag'")
        bm = block_mask.detach().to("cpu")
    return Pattern(causal=causal, window=window, cu_seqlens=cu, block_mask=bm, block_size=bs)


def _short(seq, k=6):
    try:
        seq = list(seq)
    except TypeError:
        return repr(seq)
    return str(seq) if len(seq) <= 2 * k else f"[{', '.join(map(str, seq[:k]))}, ..., {', '.join(map(str, seq[-k:]))}]"
