"""Sequence-level selective checkpointing: same values and gradients as no checkpointing, what it
stores, what its recompute computes and sends."""
import pytest
import torch

import burstengine as be
import sequence_recompute_cases
from burstengine.attention.prefix import prefix_kv_rows, prefix_tasks
from burstengine.schedule import ring_source

SPLITS = (0.0, 0.25, 0.5, 0.75, 1.0)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_matches_no_checkpointing(pool, world, layout):
    for rank, res in enumerate(pool.run(sequence_recompute_cases.against_plain, world * 7, layout, SPLITS, world=world)):
        for split, err in res.items():
            assert err <= 1e-12, f"world {world} rank {rank} {layout} split {split}: rel err {err:.2e}"


def test_non_causal_matches(pool):
    for res in pool.run(sequence_recompute_cases.against_plain, 3, "zigzag", (0.0, 0.5), False, world=3):
        assert max(res.values()) <= 1e-12, res


def _saved_bytes(split, n=12):
    blk = sequence_recompute_cases.Block()
    x = torch.randn(2, n, 24, dtype=torch.float64, requires_grad=True)
    sizes = []

    def pack(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = be.seq_checkpoint(x, blk.pre_attn, blk.post_attn, split=split, causal=True)
    y.sum().backward()
    return sum(sizes), x.numel() * 8


@pytest.mark.parametrize("split", SPLITS)
def test_stores_only_the_back(split):
    n, B, H, D = 12, 2, 4, 8
    saved, x_bytes = _saved_bytes(split, n)
    kept = round(split * n)
    # block input always; attention output (B, kept, H, D) and its lse (B, H, kept) for the back
    assert saved == x_bytes + B * kept * H * D * 8 + B * H * kept * 8


@pytest.mark.parametrize("world", [2, 3, 4])
def test_prefix_schedule(world):
    n = 8
    for m in range(n + 1):
        # striped: the fronts of all ranks are the global prefix of m * G tokens
        work = sum(t.visible_pairs() for r in range(world) for s in range(world)
                   for t in prefix_tasks("striped", True, r, ring_source(r, s, world), world, n, m))
        assert work == m * world * (m * world + 1) // 2
        assert prefix_kv_rows("striped", True, world, n, m) == m
        # zigzag: the early chunk of every lower rank travels whole while the front is in it
        assert prefix_kv_rows("zigzag", True, world, n, m) == (0 if m == 0 else n // 2 if m <= n // 2 else n)
        assert prefix_kv_rows("contiguous", True, world, n, m) == (n if m else 0)
        assert prefix_kv_rows("striped", False, world, n, m) == (n if m else 0)
        # every cut task keeps only query rows of the front
        for layout in be.LAYOUTS:
            for r in range(world):
                for s in range(world):
                    assert all(t.q1 <= m for t in prefix_tasks(layout, True, r, s, world, n, m))


def test_recompute_sends_only_the_prefix(pool):
    world, n, split = 4, 16, 0.75
    m = n - round(split * n)
    for by in pool.run(sequence_recompute_cases.recompute_bytes, "striped", split, n, world=world):
        # k and v rows [0, m) of (1, n, Hkv=2, D=8) float32, G-1 hops
        assert by["backward.k_recompute"] == by["backward.v_recompute"] == (world - 1) * m * 2 * 8 * 4
    for by in pool.run(sequence_recompute_cases.recompute_bytes, "striped", 1.0, n, world=world):
        assert "backward.k_recompute" not in by  # split 1: nothing recomputed, nothing sent


@pytest.mark.parametrize("case,match", [("split", "split must be"), ("odd_zigzag", "even number")])
def test_bad_input_raises_on_every_rank(pool, case, match):
    msgs = pool.run(sequence_recompute_cases.bad_split_or_shape, case, world=2)
    assert all(m is not None and match in m for m in msgs), msgs


def test_parameters_get_gradients_when_the_input_needs_none():
    blk = sequence_recompute_cases.Block()
    x = torch.randn(1, 10, 24, dtype=torch.float64)  # e.g. the first block over frozen embeddings
    blk.post_attn(x, be.burst_attn_func(*blk.pre_attn(x), causal=True)).sum().backward()
    ref = blk.grads()
    be.seq_checkpoint(x, blk.pre_attn, blk.post_attn, split=0.5).sum().backward()
    for a, b in zip(blk.grads(), ref):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
