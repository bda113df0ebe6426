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

import torch

LAYOUTS = ("contiguous", "zigzag", "striped")


def _check(layout: str, world: int, seq_len: int | None = None, rank: int | None = None) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if rank is not None and not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside a world of size {world}")
    if seq_len is not None:
        unit = 2 * world if layout == "zigzag" else world
        if seq_len % unit:
            raise ValueError(
                f"sequence length {seq_len} is not divisible by {unit} "
                f"({'2 x ' if layout == 'zigzag' else ''}world size {world}) as layout {layout!r} requires"
            )


def position_ids(seq_len: int, layout: str, rank: int, world: int, device=None) -> torch.Tensor:
    """Global positions (int64, increasing) of the tokens that ``rank`` holds."""
    _check(layout, world, seq_len, rank)
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
    seq_len = x.shape[dim]
    _check(layout, world, seq_len, rank)
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
    world = len(shards)
    _check(layout, world)
    if world == 0:
        raise ValueError("unshard needs at least one shard")
    n = shards[0].shape[dim]
    if any(s.shape[dim] != n for s in shards):
        raise ValueError(f"shards differ in length along dim {dim}: {[s.shape[dim] for s in shards]}")
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
