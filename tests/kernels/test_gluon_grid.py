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


def _kernel_tiles(p, B, Sq, H, group, D):
    """bwd_kernel's decode of its program ids, written out (keep in step with bwd.py): for each
    program, (batch, q head, kv tile, q tile, masked) per step, the steps in its order."""
    block_m, n_all = grid.Q_ROWS[D], Sq // grid.Q_ROWS[D]
    n_hp = H // p.heads
    for pid_n in range(p.grid[0]):
        for pid1 in range(p.grid[1]):
            for pid2 in range(p.grid[2]):
                b = pid1 // n_hp
                h0 = (pid1 - b * n_hp) * p.heads
                k_pos0 = pid_n * grid.KV_ROWS[D]
                diag = p.chunk == 0
                q_t0 = k_pos0 // block_m if diag else pid2 * p.chunk
                n_q = n_all - q_t0 if diag else min(n_all - q_t0, p.chunk)
                n_mask = grid.KV_ROWS[D] // block_m if diag else 0
                shift = (pid_n * p.stagger) % n_q
                steps = []
                for lo, hi in ((0, n_mask), (n_mask, n_q)):
                    for g in range(p.heads):
                        for t in range(lo, hi):
                            u = t + shift
                            assert 0 <= u < 2 * n_q  # the kernel's _wrap takes u mod n_q so
                            steps.append((b, h0 + g, pid_n, q_t0 + (u - n_q if u >= n_q else u), lo == 0 and hi > 0))
                yield (pid_n, pid1, pid2), steps


@pytest.mark.parametrize("D", sorted(grid.Q_ROWS))
def test_every_tile_pair_once(D, monkeypatch):
    """Every (batch, q head, kv tile, q tile) pair a block holds is one program's step exactly once
    (a diagonal block's: those at or below its diagonal, the two crossing it masked); dK/dV are
    added atomically iff more than one program holds a kv tile's rows."""
    monkeypatch.setitem(grid.Q_CHUNK, D, 5)  # small blocks, several chunks, the last short
    monkeypatch.setattr(grid, "MAX_STEPS", 12)
    rows = grid.Q_ROWS[D]
    for B, Sq, Sk, H, Hkv, diag, fresh, dtype in itertools.product(
            (1, 2), (256, 768, 1152), (256, 640), (4, 6), (1, 2, 4), (False, True), (False, True),
            (torch.float32, torch.bfloat16)):
        if diag and Sq != Sk or H % Hkv:
            continue
        q = torch.empty(B, Sq, H, D, device="meta")
        k = torch.empty(B, Sk, Hkv, D, device="meta")
        dk = torch.empty(k.shape, device="meta", dtype=dtype)
        p = grid.plan(q, k, dk, dk, fresh, diag)
        where = (B, Sq, Sk, H, Hkv, diag, fresh, dtype, p)
        seen, holders = {}, {}
        for ids, steps in _kernel_tiles(p, B, Sq, H, H // Hkv, D):
            for b, h, n, t, masked in steps:
                key = (b, h, n, t)
                assert key not in seen, where
                seen[key] = masked
                holders.setdefault((b, h // (H // Hkv), n), set()).add(ids)
        kv_rows = grid.KV_ROWS[D]
        want = {(b, h, n, t) for b in range(B) for h in range(H) for n in range(Sk // kv_rows)
                for t in range(Sq // rows) if not diag or (t + 1) * rows > n * kv_rows}
        assert set(seen) == want, where
        if diag:
            # the masked steps: the q tiles that cross the kv tile's diagonal
            assert {k_ for k_, m in seen.items() if m} == {k_ for k_ in want if k_[3] * rows < (k_[2] + 1) * kv_rows}
        shared = any(len(v) > 1 for v in holders.values())
        assert (p.dkv == 2) == shared, where
        assert p.temporaries == (shared and not (dtype == torch.float32 and not fresh)), where
        assert (p.stagger == 0) == (diag or not grid.STAGGER), where
