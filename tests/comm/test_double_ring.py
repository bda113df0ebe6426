"""The topology-aware double ring against the float64 oracle and the single ring, on gloo
ranks grouped into emulated nodes; byte accounting split by link."""
import pytest

import topo_cases

TOL = 1e-4
# (world, shape): the real double ring (2x2), rings of one-rank nodes (all hops inter-node)
SHAPES = [(4, "2x2"), (4, "4x1"), (2, "2x1"), (3, "3x1")]


@pytest.mark.parametrize("world,shape", SHAPES)
def test_double_ring_matches_reference_and_single_ring(pool, world, shape):
    for rank, rows in enumerate(pool.run(topo_cases.double_ring_matrix, shape, world, world=world)):
        for r in rows:
            where = f"{shape} rank {rank} {r['layout']} causal={r['causal']} {r['backward']} hkv={r['hkv']}"
            assert r["err"] <= TOL, f"{where}: rel err {r['err']:.2e}"
            assert r["vs_single"] <= TOL, f"{where}: differs from the single ring by {r['vs_single']:.2e}"
            assert r["fwd"][0] == r["fwd"][1] and r["bwd"][0] == r["bwd"][1], f"{where}: bytes {r}"
            seen, want = r["links"]
            assert seen == want, f"{where}: bytes per link {seen} != {want}"
            assert r["split"][0] == r["split"][1], where


@pytest.mark.parametrize("world,shape", [(4, "2x2"), (3, "3x1")])
def test_double_ring_bf16_bytes_per_link(pool, world, shape):
    """Under bf16 the finished gradient goes home in bf16, the partials before it in float32:
    schedule.link_hops counts the home hop apart, so its per-link bytes are comm_stats' still."""
    import torch

    for rank, rows in enumerate(pool.run(topo_cases.double_ring_matrix, shape, world, dtype=torch.bfloat16,
                                         world=world)):
        for r in rows:
            where = f"{shape} rank {rank} {r['layout']} causal={r['causal']} {r['backward']} hkv={r['hkv']}"
            assert r["vs_single"] <= 2e-2, f"{where}: differs from the single ring by {r['vs_single']:.2e}"
            assert r["fwd"][0] == r["fwd"][1] and r["bwd"][0] == r["bwd"][1], f"{where}: bytes {r}"
            seen, want = r["links"]
            assert seen == want, f"{where}: bytes per link {seen} != {want}"


def test_one_node_topologies_are_the_single_ring_bitwise(pool):
    for rank, (same, stats) in enumerate(pool.run(topo_cases.one_node_is_the_single_ring, 3, world=4)):
        assert same, f"rank {rank}: a one-node topology changed the numbers"
        assert len(set(stats)) == 1 and stats[0][2] == 0, stats


def test_burst_topology_env_selects_the_double_ring(pool):
    res = pool.run(topo_cases.env_topology, "2x2", 9, world=4)
    for rank, r in enumerate(res):
        assert r["err"] <= TOL, (rank, r)
        assert r["inter"] > 0 and r["intra"] > r["inter"], (rank, r)
    # on the single ring only the ranks at a node's edge send inter-node, and all of it: in the
    # forward K/V travel r -> r+1 (ranks 1 and 3 cross), in the burst backward (MHA: auto picks
    # it) the Q side and its dQ travel r -> r-1 (ranks 0 and 2 cross)
    links = [r["single_links"] for r in res]
    assert [l["forward.inter"] > 0 for l in links] == [False, True, False, True], links
    assert [l["forward.intra"] > 0 for l in links] == [True, False, True, False], links
    assert [l["backward.inter"] > 0 for l in links] == [True, False, True, False], links
    assert [l["backward.intra"] > 0 for l in links] == [False, True, False, True], links


def test_device_mesh_topology(pool):
    for rank, (err, inter) in enumerate(pool.run(topo_cases.mesh_topology, 4, world=4)):
        assert err <= TOL and inter > 0, (rank, err, inter)


@pytest.mark.parametrize("topology,msg", [("3x2", "describes 6 ranks"), ("2 by 2", "NODESxGPUS"),
                                          (7, "topology must be")])
def test_bad_topology_raises_on_every_rank(pool, topology, msg):
    msgs = pool.run(topo_cases.bad_topology, topology, world=4)
    assert all(m is not None and msg in m for m in msgs), msgs
    assert len(set(msgs)) == 1
