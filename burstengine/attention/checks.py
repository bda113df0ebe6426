"""Argument checks for burst_attn_func.  They look only at this rank's arguments and run
before any communication, so a bad call raises the same ValueError on every rank that makes
it instead of leaving the others waiting in the ring."""
from __future__ import annotations

import math

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
