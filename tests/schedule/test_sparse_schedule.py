"""The sparse schedule (windows, packed documents, block-sparse), enumerated without attention.

A coverage map built from the tasks of every rank at every step that runs, mapped to global
positions, must hit every visible pair of the dense mask (testing.sparse_mask, written from
the definitions) exactly once and no other pair, in the forward / ring backward (kv travels
r -> r+1) and the burst backward (q travels r -> r-1).  Steps not in run_steps must have no
work anywhere; the counts, FLOPs and the skipped steps are checked against closed forms, and
the striped block-sparse layout against the balance of BurstEngine Fig. 11.
"""
import itertools
import math

import pytest
import torch

import burstengine as be
from burstengine.masks import Pattern
from burstengine.schedule import (attention_flops, block_tasks, partial_rows, ring_source, run_steps, segments, sent_rows, step_work, travel_rows, visible_pairs)
from burstengine.masks import MaskSpec, visible_mask
from burstengine.testing import sparse_mask
from sparse_cases import random_block_mask

torch.set_num_threads(1)

WORLDS = (1, 2, 3, 4, 5)


def _dense(S, p: Pattern):
    return sparse_mask(S, p.causal, p.window, p.cu_seqlens, p.block_mask)


def _coverage(layout, p, world, n, direction):
    S = n * world
    pos = [be.position_ids(S, layout, r, world) for r in range(world)]
    cov = torch.zeros(S, S, dtype=torch.int64)
    run = run_steps(layout, p, world, n)
    assert run[0] == 0 and list(run) == sorted(set(run))
    for s, r in itertools.product(range(world), range(world)):
        src = ring_source(r, s, world, direction)
        qr, kr = (r, src) if direction == 1 else (src, r)
        tasks = block_tasks(layout, p, qr, kr, world, n)
        if s not in run:
            assert not tasks, f"step {s} does not run ({run}) but has work on rank {r}"
            continue
        for t in tasks:
            assert 0 <= t.q0 < t.q1 <= n and 0 <= t.k0 < t.k1 <= n, t
            m = visible_mask(t.mask, t.q1 - t.q0, t.k1 - t.k0, "cpu")
            m = torch.ones(t.q1 - t.q0, t.k1 - t.k0, dtype=torch.bool) if m is None else m
            assert t.visible_pairs() == int(m.sum()) > 0, t
            if not isinstance(t.mask, MaskSpec) or t.mask.block_mask is None:
                # trimmed to the bounding box: the first and last rows and keys each see something
                assert m[0].any() and m[-1].any() and m[:, 0].any() and m[:, -1].any(), t
            qi, ki = pos[qr][t.q0:t.q1], pos[kr][t.k0:t.k1]
            cov[qi[:, None], ki[None, :]] += m.long()
    return cov


def _patterns(n, world):
    S = n * world
    for W in (1, 3, n - 1, n, n + 1, 2 * n + 3, S + 5):
        if W >= 1:
            yield Pattern(causal=True, window=W)
    cross = tuple(sorted({c for c in (0, 1, 3, n + 1, S // 2 + 1, S - 2, S) if 0 <= c <= S}))
    yield Pattern(causal=True, cu_seqlens=cross)                                  # crossing shard boundaries
    yield Pattern(causal=True, cu_seqlens=tuple(range(0, S, 2)) + (S,))          # tiny documents
    yield Pattern(causal=True, cu_seqlens=(0, S))                                 # one document
    yield Pattern(causal=False, cu_seqlens=cross)                                 # bidirectional documents
    yield Pattern(causal=True, window=3, cu_seqlens=cross)                        # window inside documents
    yield Pattern(causal=True, cu_seqlens=(0, 2, 2, S))                           # an empty document


def _block_patterns(layout, n, world, seed):
    S = n * world
    sizes = {"striped": (world, 2 * world), "contiguous": (1, 2, n), "zigzag": (1, n // 2)}[layout]
    for bs, causal in itertools.product(sizes, (False, True)):
        if bs and S % bs == 0:
            yield Pattern(causal=causal, block_mask=random_block_mask(S // bs, seed + bs, 0.4, 1), block_size=bs)


@pytest.mark.parametrize("layout", be.LAYOUTS)
@pytest.mark.parametrize("world", WORLDS)
def test_every_visible_pair_exactly_once(world, layout):
    for n in (4, 6):
        S = n * world
        pats = list(_patterns(n, world)) + list(_block_patterns(layout, n, world, 7 * world + n))
        for p, direction in itertools.product(pats, (1, -1)):
            vis = _dense(S, p)
            cov = _coverage(layout, p, world, n, direction)
            where = f"n={n} {p} direction {direction}"
            assert not (cov > 1).any(), f"{where}: pairs computed twice, e.g. {(cov > 1).nonzero()[:4].tolist()}"
            assert not (vis & (cov == 0)).any(), f"{where}: missed, e.g. {(vis & (cov == 0)).nonzero()[:4].tolist()}"
            assert not (~vis & (cov > 0)).any(), f"{where}: invisible computed, e.g. {(~vis & (cov > 0)).nonzero()[:4].tolist()}"
            work = step_work(layout, p, world, n)
            assert sum(map(sum, work)) == int(vis.sum()) == visible_pairs(S, p), where


@pytest.mark.parametrize("layout", be.LAYOUTS)
@pytest.mark.parametrize("world", WORLDS)
def test_segments_are_the_layout(world, layout):
    n = 6
    pos = torch.cat([s.positions() for s in segments(layout, 2 % world, world, n)])
    assert torch.equal(pos, be.position_ids(n * world, layout, 2 % world, world))


@pytest.mark.parametrize("world", WORLDS)
def test_contiguous_window_runs_only_the_steps_it_needs(world):
    n = 8
    for W in range(1, n * world + 3):
        # the query at the start of a shard looks back W - 1 positions
        want = min(world - 1, (W - 2) // n + 1) if W >= 2 else 0
        p = Pattern(causal=True, window=W)
        assert run_steps("contiguous", p, world, n) == tuple(range(want + 1)), W
        assert want + 1 <= min(world, math.ceil(W / n) + 1)  # the bound the issue states
    # the first shard has no earlier one: its later steps are idle, the others' are not
    work = step_work("contiguous", Pattern(causal=True, window=n), world, n)
    for s in range(1, world):
        assert work[s][0] == 0 and (s > 1 or all(w > 0 for w in work[s][1:]))


@pytest.mark.parametrize("world", (2, 3, 4))
def test_documents_within_shards_need_no_ring(world):
    n = 8
    S = n * world
    inside = tuple(range(0, S + 1, n // 2))
    assert run_steps("contiguous", Pattern(causal=True, cu_seqlens=inside), world, n) == (0,)
    one_crossing = (0, n - 1, n + 1) + tuple(range(2 * n, S + 1, n))
    assert run_steps("contiguous", Pattern(causal=True, cu_seqlens=one_crossing), world, n) == (0, 1)
    # the same documents striped over the ranks do need the whole ring (balanced, but no skipping)
    assert run_steps("striped", Pattern(causal=True, cu_seqlens=inside), world, n) == tuple(range(world))


@pytest.mark.parametrize("world", (2, 3, 4, 8))
def test_striped_block_sparse_is_balanced(world):
    """BurstEngine Fig. 11: blocks a multiple of G tokens, striped: every rank holds the same
    share of every block, so every rank does the same work at every step (to within the
    diagonal blocks under causal)."""
    L = 3  # rows of each block on each rank
    nb = 8
    n, bs = nb * L, world * L
    for seed in range(3):
        bm = random_block_mask(nb, seed, 0.4, 1)
        for causal in (False, True):
            p = Pattern(causal=causal, block_mask=bm, block_size=bs)
            work = step_work("striped", p, world, n)
            ndiag = int(bm.diagonal().sum())
            for s, row in enumerate(work):
                assert max(row) - min(row) <= (L * ndiag if causal else 0), (causal, s, row)
            totals = [sum(work[s][r] for s in range(world)) for r in range(world)]
            assert max(totals) - min(totals) <= (L * ndiag * (world - 1) if causal else 0), totals


@pytest.mark.parametrize("world", (2, 4))
def test_flops_count_visible_pairs(world):
    n, B, H, D = 8, 2, 4, 16
    S = n * world
    for p in list(_patterns(n, world)) + [Pattern(causal=True), Pattern(causal=False)]:
        for layout in be.LAYOUTS:
            fwd = attention_flops(layout, p, world, n, B, H, D)
            both = attention_flops(layout, p, world, n, B, H, D, backward=True)
            assert sum(fwd) == 4 * B * H * D * visible_pairs(S, p)
            assert all(b == f * 7 // 2 for f, b in zip(fwd, both))
    # dense patterns: the count of docs/design.md ("FLOP conventions"), 4·B·S²·H·d, halved (plus the diagonal) for causal
    assert sum(attention_flops("zigzag", Pattern(causal=False), world, n, B, H, D)) == 4 * B * S * S * H * D
    assert visible_pairs(S, Pattern(causal=True)) == S * (S + 1) // 2


def test_pattern_equality_is_by_content():
    bm = torch.rand(4, 4) < 0.5
    a = Pattern(causal=True, block_mask=bm, block_size=2)
    b = Pattern(causal=True, block_mask=bm.clone(), block_size=2)
    c = Pattern(causal=True, block_mask=~bm, block_size=2)
    assert a == b and hash(a) == hash(b) and a != c
    assert Pattern(causal=True, cu_seqlens=(0, 4, 8)) == Pattern(causal=True, cu_seqlens=(0, 4, 8))


@pytest.mark.parametrize("world", (3, 4, 5))
def test_zigzag_window_jumps_over_idle_steps(world):
    """Under zigzag a short window needs the previous chunk (step 1) and, for the late chunk, the
    next rank's late chunk (step G-1): the steps between run nothing and are jumped over."""
    n = 8
    assert run_steps("zigzag", Pattern(causal=True, window=3), world, n) == (0, 1, world - 1)
    assert run_steps("zigzag", Pattern(causal=True), world, n) == tuple(range(world))


# --- what travels: the rows each hop carries ------------------------------------------------------

def _reads(layout, p, world, n, side):
    """reads[j][i]: the set of shard-j rows the holder at loop index i touches, straight from
    the tasks (not from schedule.read_rows)."""
    steps = run_steps(layout, p, world, n)
    out = []
    for j in range(world):
        row = []
        for s in steps:
            if side == "kv":
                tasks = block_tasks(layout, p, (j + s) % world, j, world, n)
                row.append({x for t in tasks for x in range(t.k0, t.k1)})
            else:
                tasks = block_tasks(layout, p, j, (j - s) % world, world, n)
                row.append({x for t in tasks for x in range(t.q0, t.q1)})
        out.append(row)
    return steps, out


def _width(rng):
    return rng[1] - rng[0]


def _tight(rng, rows):
    """rng is exactly the bounding box of the set rows ((0, 0) when empty)."""
    return rng == ((min(rows), max(rows) + 1) if rows else (0, 0))


@pytest.mark.parametrize("layout", be.LAYOUTS)
@pytest.mark.parametrize("world", (1, 2, 3, 4))
def test_travel_rows_hold_exactly_what_later_steps_read(world, layout):
    """Every hop carries the bounding box of the rows its step and every later one read (so
    nothing a task reads is missing), the ranges only shrink, and the gradient partial covers
    the rows the remote steps so far touched; sent_rows is what a rank sends walking the ring."""
    n = 8
    pats = list(_patterns(n, world)) + list(_block_patterns(layout, n, world, 11 * world))
    for p, side in itertools.product(pats, ("kv", "q")):
        steps, reads = _reads(layout, p, world, n, side)
        travel = travel_rows(layout, p, world, n, side)
        partial = partial_rows(layout, p, world, n, side)
        where = f"{layout} {p} {side}"
        for j in range(world):
            assert travel[j][0] == (0, n) and partial[j][0] == (0, 0), where
            for i in range(1, len(steps)):
                assert _tight(travel[j][i], set().union(*reads[j][i:])), (where, j, i, travel[j])
                assert _tight(partial[j][i], set().union(*reads[j][1:i + 1])), (where, j, i, partial[j])
                lo, hi = travel[j][i]
                plo, phi = travel[j][i - 1]
                assert hi == lo or plo <= lo <= hi <= phi, (where, j, travel[j])  # a part of what is held
        back = -1 if side == "kv" else 1
        for r, (data, grad) in enumerate(sent_rows(layout, p, world, n, side)):
            src = [(r + back * s) % world for s in steps]
            assert data == sum(_width(travel[src[i]][i + 1]) for i in range(len(steps) - 1)), where
            assert grad == (sum(_width(partial[src[i]][i]) for i in range(len(steps))) if world > 1 else 0), where


@pytest.mark.parametrize("world", (2, 3, 4))
def test_dense_patterns_travel_whole_shards(world):
    n = 8
    for layout, causal in itertools.product(be.LAYOUTS, (False, True)):
        p = Pattern(causal=causal)
        assert travel_rows(layout, p, world, n) == (((0, n),) * world,) * world
        assert partial_rows(layout, p, world, n, "q") is None
        assert sent_rows(layout, p, world, n, "q") == (((world - 1) * n, world * n),) * world


@pytest.mark.parametrize("world", (2, 3, 4, 5))
def test_contiguous_window_tail_shrinks_hop_by_hop(world):
    """Closed form: shard j's rows read at step s (by rank j+s, whose first query sits s*n
    positions later) are [max(0, s*n - W + 1), n); a hop carries what it and the later steps
    read, so W <= n sends the last W - 1 rows once and W = 2.5 n a tail that shrinks."""
    n = 8
    for W in (1, 2, 5, n, n + 3, 2 * n + n // 2, 3 * n + 1):
        p = Pattern(causal=True, window=W)
        steps = run_steps("contiguous", p, world, n)
        kv, q = travel_rows("contiguous", p, world, n), travel_rows("contiguous", p, world, n, "q")
        for j in range(world):
            for i, s in enumerate(steps[1:], 1):
                want = (max(0, s * n - W + 1), n) if j + s < world else (0, 0)
                assert kv[j][i] == want, (W, j, s, kv[j])
                # the Q side of shard j goes to rank j-s: its first W - 1 - (s-1)*n rows see it
                want_q = (0, min(n, W - 1 - (s - 1) * n)) if j - s >= 0 else (0, 0)
                assert q[j][i] == want_q, (W, j, s, q[j])
        if W <= n:
            assert all(kv[j][1:] == (((n - W + 1, n),) if W > 1 else ()) for j in range(world - 1))
    if world >= 4:
        W = 2 * n + n // 2  # the query at the start of shard 3 looks back into shard 0's last W - 1 - 2n rows
        assert [r[1] - r[0] for r in travel_rows("contiguous", Pattern(causal=True, window=W), world, n)[0]] == \
            [n, n, n, W - 1 - 2 * n]
