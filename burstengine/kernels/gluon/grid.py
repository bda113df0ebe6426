"""How the Gluon backward (bwd.py) cuts a block over programs: pure arithmetic on shapes, no
Triton, so the CPU tests prove it by enumeration (tests/kernels/test_gluon_grid.py, which also
writes out the kernel's decode of a program's ids).  Probes change these constants to time
variants."""
from __future__ import annotations

from dataclasses import dataclass

import torch

# q rows a step (the kernel's BLOCK_M), per head dim: the head dims it takes.  128 rows at d=64
# (half the steps, barriers and lse/D loads a FLOP) spill: S and dP of 128 x 64 are 64 registers
# a thread each (ptxas: 1.3 KB stored, up to ~150 local loads a loop step; ptxas_gluon_bwd_d64.json)
Q_ROWS = {128: 64, 64: 64, 256: 64}
# Most steps (q tiles x q heads) a program walks when its dK, dV may be split: adding into float32
# dK, dV, a program takes as many of its kv head's q heads as keep it under this, and the programs
# of one kv tile add theirs atomically (FlashAttention-3's one q head a program).  On H200, one
# head a program at 64K-128K (probe_gluon_bwd_split_h200.json, backward_into): d=64 full blocks
# 1.03-1.08x the unsplit kernel, d=128 causal at 64K 1.03x, the rest within 1%.
MAX_STEPS = 1024
# q tiles a program walks on a full block of more, per head dim: the block's q tiles are cut into
# chunks of this many, one q head and one chunk a program (dK, dV added atomically into float32),
# so that the programs running at once (neighbouring kv tiles of one q head and chunk, the grid's
# order) share the chunk's Q, dO and dQ in L2 (32 MB at either head dim) however far apart they
# drift.  Walking a whole 128K block at d=128 they drift apart by more than L2 holds: Nsight counted
# 0.65-3.3 TB of DRAM traffic (read and written) a call, cuDNN's 0.06-0.10 (ncu_bwd_bytes_h200.json,
# ncu_bwd_l2_128k_h200.json; chunks of 256: 0.12 TB, ncu_bwd_chunk_128k_h200.json), paid in clock
# under the power limit (probe_bwd_power_h200.json): 0.90x cuDNN.  Chunks of 512 there: 1.10-1.13x
# the unchunked kernel, level with cuDNN (probe_gluon_bwd_chunk_*_h200.json); at d=64 chunks of 256
# lost 1-2% and 1,024 are level at 128K.  At d=256 (bwd_wide.py) 256 tiles are the same 32 MB.  0: no chunks
Q_CHUNK = {128: 512, 64: 1024, 256: 256}


def program_split(q, k, dk, dv, fresh: bool, diag: bool) -> tuple[int, int]:
    """(q heads, q tiles) a program takes of its kv head's group and of the block's q tiles.  All
    of both, but on a full block of more than Q_CHUNK q tiles one head and a chunk of Q_CHUNK; and
    when adding into float32 dK, dV, as many heads as keep the program under MAX_STEPS steps (a
    divisor of the group; one at least).  Fewer than all: dK, dV added atomically into float32."""
    group, q_tiles = q.shape[2] // k.shape[2], q.shape[1] // Q_ROWS[q.shape[-1]]
    chunk = Q_CHUNK[q.shape[-1]]
    if not diag and 0 < chunk < q_tiles:
        return 1, chunk
    if fresh or dk.dtype != torch.float32 or dv.dtype != torch.float32:
        return group, q_tiles
    return max([h for h in range(1, group + 1) if group % h == 0 and h * q_tiles <= MAX_STEPS] or [1]), q_tiles


BLOCK_N = 128  # kv rows a program (bwd.py's)
KV_ROWS = {128: BLOCK_N, 64: BLOCK_N, 256: 64}  # per head dim: bwd_wide.py's at d=256
STAGGER = True  # full blocks: each kv tile's programs start their q tiles apart (bwd.py; a probe flag)


@dataclass(frozen=True)
class Plan:
    """One backward_into launch: ``grid`` (kv tiles, batch x q heads / heads, chunks); a program
    takes ``heads`` q heads and ``chunk`` q tiles (0: a diagonal block, all its q tiles from the
    kv tile's own); ``dkv`` 0 stores dK/dV, 1 reads, adds and stores them, 2 adds them atomically
    into float32 (``temporaries``: into float32 buffers made for it, then stored or added);
    ``stagger``: q tiles between neighbouring kv tiles' first ones (full blocks)."""

    heads: int
    chunk: int
    dkv: int
    temporaries: bool
    stagger: int
    grid: tuple[int, int, int]


def plan(q, k, dk, dv, fresh: bool, diag: bool) -> Plan:
    """The launch of bwd.backward_into for these tensors (see :class:`Plan`)."""
    B, Sq, H, D = q.shape
    Sk, group = k.shape[1], H // k.shape[2]
    q_tiles = Sq // Q_ROWS[D]
    heads, chunk = program_split(q, k, dk, dv, fresh, diag)
    chunks = -(-q_tiles // chunk)
    split = heads < group or chunks > 1
    kv_rows = KV_ROWS[D]
    stagger = max(1, q_tiles // (Sk // kv_rows)) if STAGGER and not diag else 0
    return Plan(heads=heads, chunk=0 if diag else chunk, dkv=2 if split else 0 if fresh else 1,
                temporaries=split and not (dk.dtype == dv.dtype == torch.float32 and not fresh), stagger=stagger,
                grid=(Sk // kv_rows, B * H // heads, chunks))
