"""The double ring's schedule (schedule/order.py, run by comm/rings.py), enumerated without running attention.

The step plan is replayed symbolically: shards moved along the hops it posts must be where
``ring_source`` says at every step, every gradient partial must collect each of its shard's
contributions exactly once and end at the shard's owner, and every visible (query, key)
pair is computed exactly once.  One-node and one-rank-per-node shapes must be the plain ring.
"""
import itertools
from collections import Counter

import pytest
import torch

import burstengine as be
from burstengine.schedule import ring_source, step_work
from burstengine.comm import topology as topo
from burstengine.schedule import Topology, double_ring_steps, hop_peers, link_hops

from test_schedule import _coverage, _visible

SHAPES = [(1, 1), (1, 4), (4, 1), (2, 2), (2, 3), (3, 2), (2, 4), (4, 2), (3, 3)]


def _replay(nodes, m):
    """Run the plan on symbols: -> (held[step][rank], final gradient of each rank as a Counter of
    (contributing rank, step, source))."""
    G = nodes * m
    plan = double_ring_steps(nodes, m)
    held = list(range(G))
    seen = []
    data_pending, grad_pending = {}, {}
    done = [None] * G

    def shift(link, payload):
        out = [None] * G
        for r in range(G):
            to, _ = hop_peers(r, nodes, m, link)
            out[to] = payload[r]
        # every rank receives from the one its receive names
        for r in range(G):
            assert out[r] is not None
            _, frm = hop_peers(r, nodes, m, link)
            assert out[r] == payload[frm]
        return out

    for p in plan:
        seen.append(list(held))
        if p.data_inter:
            data_pending["inter"] = shift("inter", held)
        if p.data_intra:
            data_pending["intra"] = shift("intra", held)
        if p.grad_out:
            grad_pending[p.grad_out] = shift(p.grad_out, done)
        contrib = [Counter({(r, p.step, held[r]): 1}) for r in range(G)]
        for link in p.grad_in:
            arrived = grad_pending.pop(link)
            contrib = [c + a for c, a in zip(contrib, arrived)]
        done = contrib
        if p.next_from:
            held = data_pending.pop(p.next_from)
    assert not data_pending and not grad_pending, "transfers posted but never used"
    final = shift("home", done) if G > 1 else done
    return seen, final


@pytest.mark.parametrize("nodes,m", SHAPES)
def test_plan_moves_shards_where_ring_source_says(nodes, m):
    G = nodes * m
    seen, _ = _replay(nodes, m)
    for s, r in itertools.product(range(G), range(G)):
        assert seen[s][r] == ring_source(r, s, G, nodes=nodes), (s, r)
    for r in range(G):  # each rank meets every shard once
        assert sorted(seen[s][r] for s in range(G)) == list(range(G))
    for s in range(G):  # and each shard is at one rank per step
        assert sorted(seen[s]) == list(range(G))


@pytest.mark.parametrize("nodes,m", SHAPES)
def test_gradient_partials_sum_every_contribution_once_and_go_home(nodes, m):
    G = nodes * m
    _, final = _replay(nodes, m)
    for owner in range(G):
        got = final[owner]
        assert all(src == owner for (_, _, src) in got), f"rank {owner} got others' gradients: {got}"
        assert all(c == 1 for c in got.values())
        assert sorted(r for (r, _, _) in got) == list(range(G)), f"rank {owner}: contributions {got}"


@pytest.mark.parametrize("nodes,m", SHAPES)
def test_inter_hop_overlaps_a_whole_round(nodes, m):
    plan = double_ring_steps(nodes, m)
    for p in plan:
        if p.data_inter:  # posted at a round start, used only after the round's last step
            assert p.inner == 0
            used = [q for q in plan if q.next_from == "inter" and q.round == p.round]
            assert len(used) == 1 and used[0].inner == m - 1
        if "inter" in p.grad_in:  # posted a round earlier, added at the round's last step
            assert p.inner == m - 1
    # a one-node ring and a ring of one-rank nodes are the plain ring
    if nodes == 1 or m == 1:
        G = nodes * m
        link = "intra" if nodes == 1 else "inter"
        for p in plan:
            assert p.next_from == (link if p.step < G - 1 else None)
            assert p.grad_out == (link if p.step >= 1 else None)
            assert p.grad_in == ((link,) if p.step >= 1 else ())


@pytest.mark.parametrize("nodes,m", SHAPES)
def test_hop_counts(nodes, m):
    G = nodes * m
    h = link_hops(nodes, m)
    zero = {"intra": 0, "inter": 0}
    if G == 1:
        assert h == {"data": zero, "grad": zero, "home": zero}
        return
    # as the single ring: G - 1 partial hops and one home (in the inputs' dtype: counted apart)
    assert sum(h["data"].values()) == G - 1 and sum(h["grad"].values()) == G - 1
    assert h["home"] == {"intra": int(nodes == 1), "inter": int(nodes > 1)}
    assert h["data"]["inter"] == nodes - 1  # only one inter-node hop per round
    assert h["data"]["intra"] == nodes * (m - 1)
    assert h["grad"]["inter"] + h["home"]["inter"] == (nodes if nodes > 1 else 0)


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "burst_backward"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout", be.LAYOUTS)
@pytest.mark.parametrize("nodes,m", [(2, 2), (2, 3), (3, 2)])
def test_double_ring_computes_every_visible_pair_once(nodes, m, layout, causal, backward):
    world, n = nodes * m, 4
    cov = _coverage(layout, causal, world, n, backward, nodes=nodes)
    vis = _visible(n * world, causal)
    assert torch.equal(cov, vis.long())


@pytest.mark.parametrize("nodes,m", [(2, 2), (2, 4), (4, 2)])
def test_zigzag_stays_balanced_on_the_double_ring(nodes, m):
    G, n = nodes * m, 4
    for s, row in enumerate(step_work("zigzag", True, G, n, nodes)):
        assert len(set(row)) == 1, (s, row)


def test_topology_parse_and_errors(monkeypatch):
    assert Topology.parse("2x4") == Topology(2, 4) and str(Topology(2, 4)) == "2x4"
    assert Topology.parse(" 3 X 1 ").world == 3
    for bad in ("2x", "x4", "two by four", "2x0"):
        with pytest.raises(ValueError):
            Topology.parse(bad)
    with pytest.raises(ValueError, match="positive int"):
        Topology(0, 2)
    assert Topology(2, 2).link(1, 2) == "inter" and Topology(2, 2).link(2, 3) == "intra"
    # without torch.distributed a process is a one-rank, one-node group
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert topo.detect() == Topology(1, 1)
    with pytest.raises(ValueError, match="NODESxGPUS"):
        topo.resolve("a lot")
