"""burstengine bench topo runs end to end on gloo at a tiny size: calibration, every scheme
measured, every prediction made, a record the cost model can load back as a cluster."""
import json
import math

import topo_cases
from burstengine import costmodel as cm


def test_topo_bench_tiny_on_gloo(pool, tmp_path):
    out = pool.run(topo_cases.bench_tiny, str(tmp_path), world=4)
    assert out[1:] == [None, None, None]
    rec = json.load(open(out[0]["path"]))
    assert rec["world"] == 4 and rec["topology"] == "2x2" and rec["commit"] and rec["command"]
    assert {"world", "intra", "inter", "a2a"} <= set(rec["calibration"]["links"])
    labels = {r["label"] for r in rec["rows"]}
    assert labels == {"burst", "ring", "burst_double", "ring_double", "ulysses", "hybrid:U=2", "hybrid:U=4"}
    assert len(rec["rows"]) == 2 * len(labels)
    for r in rec["rows"]:
        assert r["measured_s"] > 0 and math.isfinite(r["predicted_s"]) and r["predicted_s"] > 0, r
        assert r["prediction"]["compute_s"] > 0
    cluster = cm.load_cluster(out[0]["path"])  # usable as BURST_CLUSTER / plan --cluster
    assert cluster.world == 4 and len(cluster.kernel_times) > 0
    assert "largest |error|" in out[0]["table"]


def test_inter_ctas_refused_on_gloo_before_any_rank(capsys):
    from burstengine.bench.peers import topo as tb

    assert tb.main(["--device", "cpu", "--world", "4", "--inter-ctas", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--inter-ctas" in err[0] and "--device cuda" in err[0], err


def test_which_blocks_span_nodes():
    from burstengine.bench.peers import topo as tb
    from burstengine.schedule import Topology

    shape = Topology(2, 2)
    assert not shape.spans([0, 1]) and not shape.spans([3]) and shape.spans([1, 2]) and shape.spans(range(4))
    assert Topology(3, 2).spans([4, 5]) is False and Topology(3, 2).spans([0, 2, 4])
    slow = tb.crossing(shape, lambda: "slow")
    assert [slow(b) for b in ([0, 1], [2, 3], [0, 2], [1, 3], [0, 1, 2, 3])] == [None, None, "slow", "slow", "slow"]
    # the double ring's intra / inter blocks, then each hybrid degree's Ulysses / ring blocks
    assert tb.partitions(shape, "zigzag", [2, 4]) == [
        [[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 1, 2, 3]], [[0], [1], [2], [3]]]
    # striped puts the hybrid's Ulysses groups across nodes and its ring inside them
    assert tb.partitions(shape, "striped", [2])[2:] == [[[0, 2], [1, 3]], [[0, 1], [2, 3]]]


def test_hybrid_predicted_on_the_links_its_groups_use():
    from burstengine.bench.peers import topo as tb
    from burstengine.schedule import Topology

    links = {k: cm.Link(g, 1.0) for k, g in (("intra", 100.0), ("inter", 5.0), ("a2a", 4.0), ("a2a_intra", 90.0))}
    single = cm.Cluster(1, 4, links["inter"], links["inter"])
    shape = Topology(2, 2)
    zig = tb.hybrid_cluster(single, shape, "zigzag", 2, links)  # a2a in a node, ring across
    assert (zig.intra.gbps, zig.a2a_intra.gbps) == (5.0, 90.0) and zig.nodes == 1
    striped = tb.hybrid_cluster(single, shape, "striped", 2, links)  # a2a across, ring in a node
    assert (striped.intra.gbps, striped.a2a_intra.gbps) == (100.0, 4.0)
    whole = tb.hybrid_cluster(single, shape, "zigzag", 4, links)  # Ulysses over every rank: all slow
    assert whole.a2a_intra.gbps == 4.0


def test_topo_bench_inter_ctas_on_gloo(pool, tmp_path):
    """The slow mode's groups: a copy of the whole group and the blocks that cross nodes get the
    options, blocks inside a node do not, and no scheme makes a group of its own afterwards."""
    out = pool.run(topo_cases.bench_tiny_slow, str(tmp_path), world=4)
    # the whole-group copy and the two inter-node pairs, on every rank; 3 sets made, none later
    assert all(o["slowed"] == [3, 3, 3] and o["sets"] == 3 for o in out), out
    rec = json.load(open(out[0]["path"]))
    hop = rec["inter_hop"]
    assert hop["inter_ctas"] == 3 and "min_ctas = max_ctas = 3" in hop["how"]
    assert hop["inter_gbps"] > 0 and hop["intra_gbps"] > 0
    assert {"world", "intra", "inter", "a2a", "a2a_intra"} <= set(rec["calibration"]["links"])
    assert {r["label"] for r in rec["rows"]} == {"burst", "ring", "burst_double", "ring_double", "ulysses",
                                                 "hybrid:U=2", "hybrid:U=4"}
