"""The local checks of one burst_attn_func call: this rank's own arguments, before any
communication, and the levels that decide what else runs.

A check here looks at one rank's values only (types, shapes, dtypes, devices, layout, heads,
scale, backward, the mask arguments and, at level ``full``, NaN/inf in q, k, v) and raises a
one-line ValueError.  On a group that ValueError is not raised at once: it becomes this rank's
verdict, which the ranks then share (attention/agreement.py), so that a bad call raises on every
rank after exactly one small collective, never in the middle of the ring.
attention/prepare.py runs the two stages in order (check_call).

Levels (env ``BURST_CHECKS``, read by attention/planning.py, or ``with arg_checks(level):``),
the same on every rank:

* ``full`` (default): local checks, a NaN/inf scan of q, k, v (one ``aminmax`` pass, no
  temporaries; on a NCCL group its result rides in the signature, so it adds no host sync of
  its own) and the agreement.  Non-finite inputs raise instead of propagating.
* ``once``: as ``full`` for the first call of each distinct signature on a group (or on one
  rank); a later call with a remembered signature skips the all-gather and the scan (no
  collective, no host read).
  A rank whose call differs from the one the others repeat is not caught here: on gloo each
  call's ring messages carry a tag made from its signature and number (agreement.call_tag), so
  such ranks never exchange data and end in the ring's deadline (RankLost); NCCL ignores tags
  (docs/faults.md says what that leaves).  ``burstengine train`` uses it.
* ``agree``: no NaN/inf scan.  Non-finite inputs then propagate as IEEE arithmetic makes them:
  a NaN makes NaN every output row that sees it, an inf gives NaN or a key of weight 0 (a row
  whose every score is -inf comes out as zeros), and rows that cannot see the bad entry under
  the mask are unaffected.
* ``local``: no collective at all.  A bad argument on some ranks only leaves the others
  waiting in the ring (until ``BURST_TIMEOUT``), and ranks that disagree go undetected.

The levels ``full``, ``once`` and ``agree`` are in the signature, so ranks that mix them raise on
the first call; ``local`` never communicates and must be set on every rank or none.
Gradients (dout) are not checked.
"""
from __future__ import annotations

import math
import numbers
import operator
from contextlib import contextmanager

import torch

from ..layout import LAYOUTS
from ..masks import Pattern
from .call import AttnCall, MaskArgs
from .planning import LEVELS, checks_from_env

BACKWARDS = ("auto", "burst", "ring")
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DEVICES = ("cpu", "cuda", "meta")


_level_override: list[str] = []


def check_level() -> str:
    return _level_override[-1] if _level_override else checks_from_env()


@contextmanager
def arg_checks(level: str):
    """Run the block with burst_attn_func's checks at ``level`` ("full", "agree", "local"),
    overriding env BURST_CHECKS.  Every rank must use the same level: one that skips the
    agreement while another does it would leave the latter waiting."""
    if level not in LEVELS:
        raise ValueError(f"check level must be one of {LEVELS}, got {level!r}")
    _level_override.append(level)
    try:
        yield
    finally:
        _level_override.pop()


def backends(backend: str) -> dict[str, str]:
    """Device type -> backend of a group: "gloo", "nccl", or a mixed "cpu:gloo,cuda:nccl"."""
    if ":" in backend:
        return dict(part.split(":", 1) for part in backend.split(","))
    return {"cuda": backend} if backend == "nccl" else {"cpu": backend}


def check_arguments(q, k, v, call: AttnCall, world: int, backend: str) -> None:
    """This rank's q, k, v and the call's causal flag, layout, scale and backward, for a group of
    ``world`` ranks on ``backend`` (the masks: :func:`check_mask`); ValueError at the first fault."""
    causal, layout, softmax_scale, backward = call.mask.causal, call.layout, call.softmax_scale, call.backward
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq_local, heads, head_dim), got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {q.dtype}; expected one of {DTYPES}")
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
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if layout == "zigzag" and S % 2:
        raise ValueError(f"layout 'zigzag' needs an even number of local tokens (2 chunks per rank), got {S}")
    if not isinstance(backward, str) or backward not in BACKWARDS:
        raise ValueError(f"unknown backward {backward!r}; expected one of {BACKWARDS}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if softmax_scale is not None:
        scale = scale_value(softmax_scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"softmax_scale must be a positive finite number, got {scale!r}")
    if world > 1 and q.device.type not in backends(backend):
        if backend == "nccl":
            raise ValueError(f"the group uses NCCL but the tensors are on {q.device}; move them to CUDA")
        if backend == "gloo":
            raise ValueError(f"the group uses gloo but the tensors are on {q.device}; use NCCL for CUDA tensors")
        raise ValueError(f"the group ({backend}) has no backend for tensors on {q.device}")


def scale_value(softmax_scale) -> float:
    """``softmax_scale`` as a float: a real number of any type (int, float, numpy scalar) or a 0-d
    real tensor; ValueError naming the type otherwise (the range, positive and finite, is checked
    by the caller: docs/faults.md)."""
    if isinstance(softmax_scale, torch.Tensor):
        if softmax_scale.dim() != 0 or softmax_scale.is_complex() or softmax_scale.dtype == torch.bool:
            raise ValueError(f"softmax_scale must be a number or a 0-d real tensor, got a {softmax_scale.dtype} tensor "
                             f"of shape {tuple(softmax_scale.shape)}")
        return float(softmax_scale)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise ValueError(f"softmax_scale must be a number or a 0-d real tensor, got {type(softmax_scale).__name__} "
                         f"{softmax_scale!r}")
    return float(softmax_scale)


def nonfinite_mask(q, k, v) -> torch.Tensor:
    """int64 0-dim tensor on q's device: bit i set when tensor i of (q, k, v) holds NaN or inf.
    aminmax propagates NaN and reaches +-inf, in one pass and without a bool temporary."""
    bits = [(~torch.isfinite(torch.stack(torch.aminmax(t.detach())))).any().long() << i for i, t in enumerate((q, k, v))]
    return bits[0] | bits[1] | bits[2]


def nonfinite_text(mask: int) -> str:
    names = [n for i, n in enumerate("qkv") if mask >> i & 1]
    return f"{', '.join(names)} {'contains' if len(names) == 1 else 'contain'} NaN or inf"


def check_mask(mask: MaskArgs, layout: str, world: int, n: int) -> Pattern:
    """Check the mask arguments of a call over ``world`` ranks of ``n`` local tokens and return
    their masks.Pattern.

    Every value is global (the whole sequence of ``n * world`` tokens) and must be the same on
    every rank: the ring steps that run are derived from them."""
    causal, window, cu_seqlens, block_mask, block_size = (mask.causal, mask.window, mask.cu_seqlens, mask.block_mask,
                                                          mask.block_size)
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
                raise ValueError(f"cu_seqlens must be a sequence of ints, got {shorten(cu_seqlens)}") from None
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != S:
            raise ValueError(f"cu_seqlens must run from 0 to the global sequence length {S} "
                             f"({n} local tokens x {world} ranks), got {shorten(cu)}")
        if any(b < a for a, b in zip(cu[:-1], cu[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {shorten(cu)}")
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


def shorten(seq, k=6) -> str:
    """A long sequence as its first and last ``k`` items (for messages)."""
    try:
        seq = list(seq)
    except TypeError:
        return repr(seq)
    return str(seq) if len(seq) <= 2 * k else f"[{', '.join(map(str, seq[:k]))}, ..., {', '.join(map(str, seq[-k:]))}]"
