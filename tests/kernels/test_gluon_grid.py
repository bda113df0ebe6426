"""kernels/gluon/grid.py: how the Gluon backward cuts a block over programs, by enumeration (pure
arithmetic on shapes: meta tensors, no Triton)."""
import itertools

import pytest
import torch

from burstengine.kernels.gluon import grid


def split(D, group, q_tiles, fresh, diag, dtype):
    q = torch.empty(1, q_tiles * grid.Q_ROWS[D], 8 * group, D, device="meta")
    k = torch.empty(1, 128, 8, D, device="meta", dtype=torch.bfloat16)
    dk = torch.empty(k.shape, device="meta", dtype=dtype)
    return grid.program_split(q, k, dk, dk, fresh, diag)


@pytest.mark.parametrize("D", sorted(grid.Q_ROWS))
def test_program_split_by_enumeration(D):
    chunk_max = grid.Q_CHUNK[D]
    tiles = sorted({1, 2, 7, 64, 129, 255, 256, 257, 511, 512, 513, 1023, 1024, 1025, 2048, 4099}
                   | {chunk_max - 1, chunk_max, chunk_max + 1, 2 * chunk_max + 3})
    for group, q_tiles, fresh, diag, dtype in itertools.product((1, 2, 3, 4, 8), tiles, (False, True), (False, True),
                                                                (torch.float32, torch.bfloat16)):
        heads, chunk = split(D, group, q_tiles, fresh, diag, dtype)
        where = (group, q_tiles, fresh, diag, dtype)
        assert group % heads == 0 and 1 <= chunk <= q_tiles, where
        if not diag and q_tiles > chunk_max:
            # no program walks more of a full block than a chunk: what keeps the tiles in L2
            assert (heads, chunk) == (1, chunk_max), where
            continue
        assert chunk == q_tiles, where  # diagonal blocks and short ones: one chunk
        if fresh or dtype != torch.float32:
            # stored, or added into gradients that atomics cannot take: every head, no atomics
            assert heads == group, where
        else:
            # the most heads (a divisor) under MAX_STEPS steps, one at least
            fits = [h for h in range(1, group + 1) if group % h == 0 and h * q_tiles <= grid.MAX_STEPS]
            assert heads == (max(fits) if fits else 1), where


def test_program_split_follows_the_constants(monkeypatch):
    # the probes time variants by changing these; a chunk of 0 turns chunks off
    monkeypatch.setitem(grid.Q_CHUNK, 128, 0)
    assert split(128, 4, 4096, True, False, torch.bfloat16) == (4, 4096)
    monkeypatch.setitem(grid.Q_CHUNK, 128, 100)
    assert split(128, 4, 272, False, False, torch.float32) == (1, 100)
    monkeypatch.setattr(grid, "MAX_STEPS", 1 << 30)
    assert split(128, 4, 272, False, True, torch.float32) == (4, 272)
