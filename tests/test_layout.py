"""Sharding layouts (burstengine/layout.py), single process: no ring, no pool."""
import itertools

import pytest
import torch

import burstengine as be

WORLDS = (1, 2, 3, 4)


def _seq(world, chunks=3):
    # divisible by 2 * world, so every layout accepts it
    return 2 * world * chunks


@pytest.mark.parametrize("layout", be.LAYOUTS)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("dim", [1, 2, -1, -2])
def test_shard_unshard_roundtrip(layout, world, dim):
    S = _seq(world)
    shape = [2, 5, 3]
    shape[dim] = S
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(world))
    parts = [be.shard(x, layout, r, world, dim=dim) for r in range(world)]
    for p in parts:
        want = list(x.shape)
        want[dim] = S // world
        assert list(p.shape) == want
    # every element lands on exactly one rank
    assert sum(p.numel() for p in parts) == x.numel()
    assert torch.equal(be.unshard(parts, layout, dim=dim), x)


@pytest.mark.parametrize("layout", be.LAYOUTS)
@pytest.mark.parametrize("world", WORLDS)
def test_roundtrip_4d_attention_shapes(layout, world):
    # the shapes burst_attn_func sees: (B, S, H, D) along dim 1, lse (B, H, S) along dim 2
    S = _seq(world, 2)
    q = torch.randn(2, S, 3, 4)
    lse = torch.randn(2, 3, S)
    assert torch.equal(be.unshard([be.shard(q, layout, r, world) for r in range(world)], layout), q)
    assert torch.equal(be.unshard([be.shard(lse, layout, r, world, dim=2) for r in range(world)], layout, dim=2), lse)


@pytest.mark.parametrize("layout", be.LAYOUTS)
@pytest.mark.parametrize("world", WORLDS)
def test_position_ids_match_shard_of_arange(layout, world):
    S = _seq(world, 4)
    seen = []
    for r in range(world):
        pos = be.position_ids(S, layout, r, world)
        assert pos.dtype == torch.int64
        assert torch.equal(pos, be.shard(torch.arange(S), layout, r, world, dim=0))
        # tokens stay in increasing global order inside a rank
        assert bool((pos[1:] > pos[:-1]).all())
        seen.append(pos)
    assert torch.equal(torch.cat(seen).sort().values, torch.arange(S))


@pytest.mark.parametrize("world", WORLDS)
def test_zigzag_holds_chunks_i_and_mirror(world):
    c = 3
    S = 2 * world * c
    x = torch.arange(S)
    chunks = x.split(c)
    assert len(chunks) == 2 * world
    for r in range(world):
        mine = be.shard(x, "zigzag", r, world, dim=0)
        assert torch.equal(mine, torch.cat([chunks[r], chunks[2 * world - 1 - r]]))


@pytest.mark.parametrize("world", WORLDS)
def test_striped_token_t_on_rank_t_mod_world(world):
    S = 4 * world
    owner = {}
    for r in range(world):
        for t in be.shard(torch.arange(S), "striped", r, world, dim=0).tolist():
            owner[t] = r
    assert owner == {t: t % world for t in range(S)}


@pytest.mark.parametrize("world", WORLDS)
def test_contiguous_is_consecutive_blocks(world):
    n = 5
    x = torch.arange(n * world)
    for r in range(world):
        assert torch.equal(be.shard(x, "contiguous", r, world, dim=0), torch.arange(r * n, (r + 1) * n))


@pytest.mark.parametrize("layout,world,S", [
    ("contiguous", 3, 10), ("striped", 4, 6), ("zigzag", 3, 9),
    # zigzag needs 2 * world: these are divisible by world but not by 2 * world
    ("zigzag", 2, 6), ("zigzag", 4, 12),
])
def test_indivisible_sequence_is_a_clear_error(layout, world, S):
    x = torch.zeros(1, S)
    with pytest.raises(ValueError, match=f"sequence length {S} is not divisible"):
        be.shard(x, layout, 0, world)
    with pytest.raises(ValueError, match="not divisible"):
        be.position_ids(S, layout, 0, world)


def test_zigzag_error_names_twice_the_world():
    with pytest.raises(ValueError, match=r"divisible by 4 \(2 x world size 2\)"):
        be.position_ids(6, "zigzag", 0, 2)
    # the same length is fine for the other layouts
    for layout in ("contiguous", "striped"):
        assert be.position_ids(6, layout, 0, 2).numel() == 3


def test_unknown_layout():
    x = torch.zeros(1, 8)
    for call in (lambda: be.shard(x, "diagonal", 0, 2), lambda: be.position_ids(8, "diagonal", 0, 2),
                 lambda: be.unshard([x, x], "diagonal")):
        with pytest.raises(ValueError, match="unknown layout 'diagonal'"):
            call()


@pytest.mark.parametrize("layout", be.LAYOUTS)
@pytest.mark.parametrize("rank,world", [(-1, 2), (2, 2), (4, 4), (1, 1)])
def test_bad_rank(layout, rank, world):
    x = torch.zeros(1, 8 * world)
    with pytest.raises(ValueError, match=f"rank {rank} is outside a world of size {world}"):
        be.shard(x, layout, rank, world)
    with pytest.raises(ValueError, match="outside a world"):
        be.position_ids(8 * world, layout, rank, world)


@pytest.mark.parametrize("world", [0, -1])
def test_bad_world(world):
    with pytest.raises(ValueError, match="world size must be >= 1"):
        be.position_ids(8, "contiguous", 0, world)


def test_unshard_rejects_bad_shards():
    with pytest.raises(ValueError):
        be.unshard([], "contiguous")
    with pytest.raises(ValueError, match="differ in length"):
        be.unshard([torch.zeros(1, 4), torch.zeros(1, 3)], "striped")
    with pytest.raises(ValueError, match="even length"):
        be.unshard([torch.zeros(1, 3), torch.zeros(1, 3)], "zigzag")


def test_layouts_constant():
    assert set(be.LAYOUTS) == {"contiguous", "zigzag", "striped"}
    # every layout gives every rank S / world tokens
    for layout, world in itertools.product(be.LAYOUTS, WORLDS):
        S = _seq(world)
        assert {be.position_ids(S, layout, r, world).numel() for r in range(world)} == {S // world}
