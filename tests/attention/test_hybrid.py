"""The head-context hybrid (Ulysses x Burst ring) against the float64 oracle, for every
factorisation of worlds 2-4, all layouts, both backward schemes, GQA split and repeated."""
import pytest
import torch

import burstengine as be
import topo_cases
from burstengine.attention.hybrid import hybrid_mesh, token_order

TOL = 1e-4


@pytest.mark.parametrize("world,ulysses,H,hkvs", [
    (4, 2, 4, (4, 2, 1)),   # 2 x 2 mesh; kv heads split, split, repeated
    (4, 4, 4, (4, 2)),      # pure Ulysses through the hybrid; kv heads split, repeated
    (2, 2, 4, (2,)),
    (3, 3, 6, (6, 3)),
    (4, 1, 4, (2,)),        # U = 1: the plain ring
])
def test_hybrid_matches_reference(pool, world, ulysses, H, hkvs):
    for rank, rows in enumerate(pool.run(topo_cases.hybrid_matrix, ulysses, H, hkvs, world, world=world)):
        for r in rows:
            where = f"U={ulysses} rank {rank} {r['layout']} causal={r['causal']} {r['backward']} hkv={r['hkv']}"
            assert max(r["errs"]) <= TOL, f"{where}: errors (out, lse, dq, dk, dv) {r['errs']}"
            assert (r["a2a"] > 0) == (ulysses > 1), where


def test_hybrid_without_lse(pool):
    for err, grads in pool.run(topo_cases.hybrid_no_lse, 2, world=4):
        assert err <= TOL and grads


@pytest.mark.parametrize("ulysses,H,Hkv,msg", [(3, 4, 4, "does not divide the group"), (2, 3, 3, "query heads"),
                                               (4, 12, 6, "neither split nor repeated"), (0, 4, 4, "positive int")])
def test_bad_hybrid_raises_on_every_rank(pool, ulysses, H, Hkv, msg):
    msgs = pool.run(topo_cases.bad_hybrid, ulysses, H, Hkv, world=4)
    assert all(m is not None and msg in m for m in msgs), msgs


@pytest.mark.parametrize("layout", be.LAYOUTS)
@pytest.mark.parametrize("world,ulysses", [(4, 2), (6, 2), (6, 3), (8, 4), (8, 2)])
def test_ulysses_groups_hold_a_ring_shard(layout, world, ulysses):
    """What an all-to-all gathers, sorted, is exactly a shard of the same layout over the ring."""
    S, R = 4 * world, world // ulysses
    u_blocks, r_blocks = hybrid_mesh(layout, world, ulysses)
    assert sorted(sum(u_blocks, [])) == list(range(world)) == sorted(sum(r_blocks, []))
    for ring_rank, members in enumerate(u_blocks):
        pos = torch.cat([be.position_ids(S, layout, m, world) for m in members])
        assert torch.equal(pos[token_order(S, layout, members, world)], be.position_ids(S, layout, ring_rank, R))
    if layout != "striped":  # head first: a Ulysses group is consecutive ranks (one node)
        assert all(b == list(range(b[0], b[0] + ulysses)) for b in u_blocks)
