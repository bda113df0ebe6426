"""The ring schedule (burstengine/schedule/), enumerated without running attention.

A coverage map built from the tasks and the layout's global positions proves that the
forward (q home, kv travelling) and the burst backward (kv home, q travelling) each compute
every visible (query, key) pair exactly once and never an invisible one; the per-step work
counts show why zigzag and striped exist.
"""
import itertools

import pytest
import torch

import burstengine as be
from burstengine.masks import CAUSAL, FULL, MASKS, STRICT
from burstengine.schedule import block_tasks, ring_source, step_work

WORLDS = range(1, 9)
LOCALS = (2, 4, 6)


def _task_mask(t):
    """Boolean (nq, nk) visibility of one task, in its local block coordinates."""
    nq, nk = t.q1 - t.q0, t.k1 - t.k0
    full = torch.ones(nq, nk, dtype=torch.bool)
    if t.mask == FULL:
        return full
    assert nq == nk, f"{t.mask} task must be square: {t}"
    return full.tril(0 if t.mask == CAUSAL else -1)


def _coverage(layout, causal, world, n, backward=False, nodes=1):
    """How many times each global (query, key) pair is computed over all ranks and steps.

    forward: rank r holds its q, and at step s the kv of ring_source(r, s);
    burst backward: rank r holds its kv, and at step s the q side of ring_source(r, s, -1)
    (the q side travels the other way round the ring).  nodes > 1: the double ring's order."""
    S = n * world
    pos = [be.position_ids(S, layout, r, world) for r in range(world)]
    cov = torch.zeros(S, S, dtype=torch.int64)
    for s, r in itertools.product(range(world), range(world)):
        src = ring_source(r, s, world, -1 if backward else 1, nodes)
        qr, kr = (src, r) if backward else (r, src)
        for t in block_tasks(layout, causal, qr, kr, world, n):
            assert t.mask in MASKS
            assert 0 <= t.q0 < t.q1 <= n and 0 <= t.k0 < t.k1 <= n, t
            m = _task_mask(t)
            assert t.visible_pairs() == int(m.sum()), t
            qi = pos[qr][t.q0:t.q1]
            ki = pos[kr][t.k0:t.k1]
            cov[qi[:, None], ki[None, :]] += m.long()
    return cov


def _visible(S, causal):
    full = torch.ones(S, S, dtype=torch.bool)
    return full.tril() if causal else full


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "burst_backward"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", be.LAYOUTS)
@pytest.mark.parametrize("world", WORLDS)
def test_every_visible_pair_exactly_once(world, layout, causal, backward):
    for n in LOCALS:
        S = n * world
        cov = _coverage(layout, causal, world, n, backward)
        vis = _visible(S, causal)
        twice = (cov > 1).nonzero()
        assert twice.numel() == 0, f"n={n}: pairs computed more than once, e.g. {twice[:5].tolist()}"
        missed = (vis & (cov == 0)).nonzero()
        assert missed.numel() == 0, f"n={n}: visible pairs never computed, e.g. {missed[:5].tolist()}"
        leaked = (~vis & (cov > 0)).nonzero()
        assert leaked.numel() == 0, f"n={n}: invisible pairs computed, e.g. {leaked[:5].tolist()}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", be.LAYOUTS)
@pytest.mark.parametrize("world", WORLDS)
def test_step_work_sums_to_global_count(world, layout, causal):
    for n in LOCALS:
        S = n * world
        work = step_work(layout, causal, world, n)
        assert len(work) == world and all(len(row) == world for row in work)
        want = S * (S + 1) // 2 if causal else S * S
        assert sum(map(sum, work)) == want


@pytest.mark.parametrize("layout", be.LAYOUTS)
@pytest.mark.parametrize("world", WORLDS)
def test_full_attention_is_balanced_everywhere(world, layout):
    n = 4
    for row in step_work(layout, False, world, n):
        assert row == [n * n] * world


@pytest.mark.parametrize("world", WORLDS)
def test_zigzag_causal_identical_work_every_step(world):
    for n in LOCALS:
        work = step_work("zigzag", True, world, n)
        for s, row in enumerate(work):
            assert len(set(row)) == 1, f"n={n} step {s}: {row}"
        # step 0 is the causal diagonal block, every later step half a block
        assert work[0][0] == n * (n + 1) // 2
        assert all(row[0] == n * n // 2 for row in work[1:])


@pytest.mark.parametrize("world", WORLDS)
def test_striped_causal_balanced_within_the_diagonal(world):
    for n in LOCALS:
        work = step_work("striped", True, world, n)
        for s, row in enumerate(work):
            assert max(row) - min(row) <= n, f"n={n} step {s}: {row}"
        totals = [sum(work[s][r] for s in range(world)) for r in range(world)]
        assert max(totals) - min(totals) <= n * (world - 1)


@pytest.mark.parametrize("world", range(2, 9))
def test_contiguous_causal_is_imbalanced(world):
    """Why the other layouts exist: under a causal mask, contiguous rank 0 only ever does its
    diagonal block while rank G-1 does a full block at every step."""
    n = 4
    work = step_work("contiguous", True, world, n)
    for s in range(1, world):
        assert max(work[s]) - min(work[s]) == n * n  # some ranks do a whole block, others nothing
    totals = [sum(work[s][r] for s in range(world)) for r in range(world)]
    assert totals == [n * (n + 1) // 2 + r * n * n for r in range(world)]
    assert totals[-1] >= world * totals[0]  # the last rank does at least G times the first's work


def test_strict_mask_only_for_striped():
    for world, n in itertools.product(range(2, 6), (2, 4)):
        for layout, qr, kr in itertools.product(be.LAYOUTS, range(world), range(world)):
            kinds = {t.mask for t in block_tasks(layout, True, qr, kr, world, n)}
            if STRICT in kinds:
                assert layout == "striped" and kr > qr


def test_unknown_layout_raises():
    with pytest.raises(ValueError, match="unknown layout"):
        block_tasks("diagonal", True, 0, 1, 2, 4)
