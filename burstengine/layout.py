"""How a global sequence is split across the ranks of a context-parallel group.

Three layouts, all of which give every rank ``S / world`` tokens:

* ``contiguous``: rank r holds tokens [r*S/G, (r+1)*S/G).  Simple, but under a causal mask
  rank 0 has almost nothing to do and rank G-1 almost everything.
* ``zigzag``: the sequence is cut into 2G chunks; rank r holds chunks r and 2G-1-r, so every
  rank owns one "early" and one "late" chunk and causal work is balanced.
* ``striped``: token t lives on rank t mod G (Striped Attention).  Causal work is balanced
  to within the diagonal.

Within a rank, tokens are always kept in increasing global position, which is what lets the
attention schedule describe every block pair with a handful of mask kinds.
"""
from __future__ import annotations

import operator

import torch

LAYOUTS = ("contiguous", "zigzag", "striped")


def _int(name: str, value) -> int:
    # ints only (numpy / 0-dim tensor ints too); a float or bool rank is a bug in the caller
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def _check(layout: str, world: int, seq_len: int | None = None, rank: int | None = None) -> None:
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    world = _int("world size", world)
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if rank is not None:
        rank = _int("rank", rank)
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is outside a world of size {world}")
    if seq_len is not None:
        seq_len = _int("sequence length", seq_len)
        if seq_len < 1:
            raise ValueError(f"sequence length must be >= 1 (an empty sequence cannot be sharded), got {seq_len}")
        unit = 2 * world if layout == "zigzag" else world
        if seq_len % unit:
            raise ValueError(
                f"sequence length {seq_len} is not divisible by {unit} "
                f"({'2 x ' if layout == 'zigzag' else ''}world size {world}) as layout {layout!r} requires"
            )


def _dim(x: torch.Tensor, dim) -> int:
    dim = _int("dim", dim)
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor with {x.dim()} dimensions")
    return dim % x.dim()


def _tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"{name} must have a sequence dimension, got a 0-d tensor")
    return x


def position_ids(seq_len: int, layout: str, rank: int, world: int, device=None) -> torch.Tensor:
    """Global positions (int64, increasing) of the tokens that ``rank`` holds."""
    _check(layout, world, _int("sequence length", seq_len), rank)
    seq_len, rank, world = int(seq_len), int(rank), int(world)
    try:
        device = None if device is None else torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"bad device {device!r}: {e}") from None
    n = seq_len // world
    if layout == "contiguous":
        return torch.arange(rank * n, (rank + 1) * n, device=device)
    if layout == "striped":
        return torch.arange(rank, seq_len, world, device=device)
    c = n // 2
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    last = torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c, device=device)
    return torch.cat([first, last])


def shard(x: torch.Tensor, layout: str, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """The part of the global tensor ``x`` that ``rank`` holds, along ``dim``."""
    dim = _dim(_tensor("x", x), dim)
    seq_len = x.shape[dim]
    _check(layout, world, seq_len, rank)
    rank, world = int(rank), int(world)
    n = seq_len // world
    if layout == "contiguous":
        return x.narrow(dim, rank * n, n)
    if layout == "striped":
        idx = torch.arange(rank, seq_len, world, device=x.device)
        return x.index_select(dim, idx)
    c = n // 2
    return torch.cat([x.narrow(dim, rank * c, c), x.narrow(dim, (2 * world - 1 - rank) * c, c)], dim=dim)


def unshard(shards: list[torch.Tensor] | tuple[torch.Tensor, ...], layout: str, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard`: the global tensor from every rank's shard, in rank order."""
    if not isinstance(shards, (list, tuple)):
        raise ValueError(f"shards must be a list or tuple of tensors (one per rank), got {type(shards).__name__}")
    world = len(shards)
    if world == 0:
        raise ValueError("unshard needs at least one shard")
    _check(layout, world)
    for r, s in enumerate(shards):
        _tensor(f"shard {r}", s)
    dim = _dim(shards[0], dim)
    n = shards[0].shape[dim]
    if any(s.shape[dim] != n for s in shards):
        raise ValueError(f"shards differ in length along dim {dim}: {[s.shape[dim] for s in shards]}")
    if n == 0:
        raise ValueError(f"shards are empty along dim {dim}")
    first = shards[0]
    for r, s in enumerate(shards):
        if s.shape != first.shape:
            raise ValueError(f"shard {r} has shape {tuple(s.shape)} but shard 0 has {tuple(first.shape)}")
        if s.dtype != first.dtype or s.device != first.device:
            raise ValueError(f"shard {r} is {s.dtype} on {s.device} but shard 0 is {first.dtype} on {first.device}")
    if layout == "contiguous":
        return torch.cat(list(shards), dim=dim)
    if layout == "striped":
        # (..., n, ...) per rank -> interleave: global index i*G + r
        stacked = torch.stack(list(shards), dim=dim + 1 if dim >= 0 else dim)
        return stacked.flatten(dim, dim + 1) if dim >= 0 else stacked.flatten(dim - 1, dim)
    if n % 2:
        raise ValueError(f"zigzag shards must have even length, got {n}")
    c = n // 2
    chunks = [None] * (2 * world)
    for r, s in enumerate(shards):
        chunks[r] = s.narrow(dim, 0, c)
        chunks[2 * world - 1 - r] = s.narrow(dim, c, c)
    return torch.cat(chunks, dim=dim)
