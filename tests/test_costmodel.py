"""The cost model (burstengine/costmodel.py) and `burstengine plan`: hand-computed timelines,
the overlap rules, Table 1's orderings, the byte counts the code reports, and the "auto"
choices (bytes when no link figures are known)."""
import dataclasses
import json

import pytest

from burstengine import costmodel as cm
from burstengine.attention import planning
from burstengine.schedule import backward_by_bytes, backward_bytes, forward_bytes, home_bytes, hop_bytes
from burstengine.cli import main
from burstengine.schedule import Topology

GBs = 1e9


def _cluster(nodes=1, m=2, intra=100.0, inter=10.0, tflops=100.0, lat=0.0):
    return cm.Cluster(nodes, m, cm.Link(intra, lat), cm.Link(inter, lat), tflops, tflops)


def test_two_rank_ring_by_hand():
    c = _cluster(1, 2, intra=1.0, tflops=1.0)
    a = cm.Attn(seq=2048, heads=2, kv_heads=2, head_dim=16, causal=False)
    n = 1024
    comp = 4 * 2 * 16 * n * n / 1e12  # one full block, forward
    kv, _ = hop_bytes("forward", 1, n, 2, 2, 16, 2)
    d, g = hop_bytes("burst", 1, n, 2, 2, 16, 2)
    gh = home_bytes("burst", 1, n, 2, 2, 16, 2)
    assert gh == g // 2  # the finished dq goes home in bf16, not float32
    p = cm.predict("burst", c, a)
    assert p.fwd_s == pytest.approx(max(comp, kv / GBs) + comp)
    bc = 2.5 * comp
    assert p.bwd_s == pytest.approx(max(bc, d / GBs) + max(bc, g / GBs) + gh / GBs)  # last hop home exposed
    assert p.compute_s == pytest.approx(2 * comp + 2 * bc)
    assert p.intra_bytes + p.inter_bytes == forward_bytes(1, n, 2, 16, 2, 2) + backward_bytes("burst", 1, n, 2, 2, 16, 2, 2)


@pytest.mark.parametrize("scheme", ["burst", "ring", "burst_double", "ring_double"])
def test_model_bytes_are_the_codes_bytes(scheme):
    c = _cluster(2, 4)
    a = cm.Attn(seq=8 * 4096, heads=8, kv_heads=2, head_dim=64)
    p = cm.predict(scheme, c, a)
    b = scheme.split("_")[0]
    n = a.seq // c.world
    assert p.intra_bytes + p.inter_bytes == forward_bytes(1, n, 2, 64, 2, 8) + backward_bytes(b, 1, n, 8, 2, 64, 2, 8)
    if scheme.endswith("double"):
        assert 0 < p.inter_bytes < p.intra_bytes  # one inter-node hop per round
    else:
        assert p.intra_bytes == 0  # a single ring's edge rank sends every hop across nodes


def test_overlap_rules():
    a = cm.Attn(seq=1 << 16, heads=8, head_dim=64)
    slow_kernel = cm.predict("burst", _cluster(tflops=1.0), a)   # compute-bound
    assert slow_kernel.exposed_s == pytest.approx(_cluster().intra.time(home_bytes("burst", 1, 1 << 15, 8, 8, 64, 2)))
    fast_kernel = cm.predict("burst", _cluster(tflops=1e6), a)   # communication-bound
    assert fast_kernel.total_s == pytest.approx(fast_kernel.comm_only_s, rel=1e-3)
    # a single ring cannot overlap more than it computes: never below either part
    for p in (slow_kernel, fast_kernel):
        assert p.total_s >= max(p.compute_s, p.comm_only_s) - 1e-12


def test_double_ring_wins_across_slow_nodes_and_is_the_ring_on_one_node():
    a = cm.Attn(seq=1 << 18, heads=16, head_dim=128)
    multi = _cluster(4, 8, intra=200.0, inter=10.0, tflops=1e6)
    assert cm.predict("burst_double", multi, a).total_s < cm.predict("burst", multi, a).total_s / 3
    one = _cluster(1, 8)
    assert cm.predict("burst_double", one, a).total_s == cm.predict("burst", one, a).total_s
    names = {p.scheme: p for p in cm.compare(one, a)}
    assert not names["burst_double"].feasible and "same as the single ring" in names["burst_double"].why


def test_table1_orderings_and_the_model_agree():
    """Instant compute, NVLink >> IB: Ring > DoubleRing > Burst in Table 1 and in the model's
    communication-only time; DoubleRing never beats our overlapped ring backward."""
    c = dataclasses.replace(cm.PRESETS["a800-paper"], fwd_tflops=1e9, bwd_tflops=1e9)
    a = cm.Attn(seq=1 << 20, heads=40, head_dim=128)
    t1 = cm.table1(c, a)
    assert t1["ring"] > t1["double_ring"] > t1["burst_double"]
    p = {s: cm.predict(s, c, a) for s in ("ring", "double_ring", "burst_double", "ring_double")}
    assert p["ring"].comm_only_s > p["double_ring"].comm_only_s > p["burst_double"].comm_only_s
    assert p["double_ring"].total_s > p["ring_double"].total_s
    # the two agree within the fp32 gradient partials and the 2N scalars Table 1 leaves out
    for s in ("ring", "double_ring", "burst_double"):
        assert 1.0 <= p[s].comm_only_s / t1[s] < 1.6, (s, p[s].comm_only_s, t1[s])


def test_ulysses_and_hybrid_feasibility():
    a800 = cm.PRESETS["a800-paper"]
    a = cm.Attn(seq=1 << 20, heads=40, head_dim=128)
    assert not cm.predict("ulysses", a800, a).feasible  # 40 heads over 32 GPUs (the paper's point)
    assert cm.hybrid_degrees(a800, a) == [2, 4, 8]
    h = cm.predict("hybrid", a800, a)
    assert h.feasible and h.config["ulysses"] in (2, 4, 8) and h.config["ring"] * h.config["ulysses"] == 32
    gqa = cm.Attn(seq=1 << 16, heads=32, kv_heads=4, head_dim=128)
    assert cm.kv_heads_for(32, 4, 8) == 8 and cm.kv_heads_for(32, 4, 2) == 4 and cm.kv_heads_for(40, 40, 32) is None
    assert cm.predict("ulysses", _cluster(1, 8), gqa).feasible


def test_measured_kernel_times_override_throughput():
    c = _cluster(1, 2)
    key = cm.kernel_key(1, 1024, 1024, 2, 2, 16, "full")
    c2 = dataclasses.replace(c, kernel_times=((key, 0.5, 1.5),))
    assert c2.kernel_time("fwd", 1, 1024, 1024, 2, 2, 16, "full") == 0.5
    assert c2.kernel_time("bwd", 1, 1024, 1024, 2, 2, 16, "full") == 1.5
    assert c2.kernel_time("fwd", 1, 512, 512, 2, 2, 16, "full") == c.kernel_time("fwd", 1, 512, 512, 2, 2, 16, "full")


def test_cluster_json_round_trip_and_loading(tmp_path, monkeypatch):
    c = dataclasses.replace(cm.PRESETS["a800-paper"], kernel_times=((cm.kernel_key(1, 8, 8, 2, 2, 16, "causal"), 1e-3,
                                                                     2e-3),))
    d = json.loads(json.dumps(c.to_dict()))
    assert cm.Cluster.from_dict(d) == c
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"cluster": d, "other": 1}))  # a topo_bench record holds it under "cluster"
    assert cm.load_cluster(str(f)) == c
    assert cm.load_cluster("h200-shm") is cm.PRESETS["h200-shm"]
    assert cm.load_cluster('{"nodes": 2, "gpus_per_node": 4}').world == 8
    with pytest.raises(ValueError, match="unknown cluster fields"):
        cm.Cluster.from_dict({"nodes": 1, "bandwidth": 3})
    monkeypatch.setenv(cm.ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="BURST_CLUSTER"):
        planning.cluster_from_env()
    monkeypatch.setenv(cm.ENV, "a800-paper")
    assert planning.cluster_from_env() is cm.PRESETS["a800-paper"]


@pytest.mark.parametrize("H,Hkv", [(8, 8), (8, 2), (8, 1)])
@pytest.mark.parametrize("shape", [Topology(1, 4), Topology(2, 2)])
def test_auto_without_figures_is_the_byte_choice(shape, H, Hkv):
    args = (1, 512, H, Hkv, 64, 2, True, "zigzag")
    got = cm.choose_call(shape, *args, "auto", None)
    assert got == (shape, backward_by_bytes(1, 512, H, Hkv, 64, 2, shape.world))
    assert cm.choose_call(shape, *args, "ring", None) == (shape, "ring")


def test_auto_with_figures():
    # communication-bound GQA: the ring backward moves fewer bytes and the model agrees
    fast = dataclasses.replace(cm.PRESETS["a800-paper"], fwd_tflops=1e6, bwd_tflops=1e6)
    args = (1, 4096, 32, 4, 128, 2, True, "zigzag")
    assert cm.choose_call(Topology(4, 8), *args, "auto", fast) == (Topology(4, 8), "ring")
    assert cm.choose_call(Topology(4, 8), *args, "burst", fast) == (Topology(4, 8), "burst")
    # equal links: the double ring still wins, as its intra and inter hops run at once
    flat = dataclasses.replace(fast, inter=fast.intra)
    assert cm.choose_call(Topology(4, 8), *args, "auto", flat)[0] == Topology(4, 8)
    # the single ring goes at the pace of its slowest hop, whichever link that is
    odd = dataclasses.replace(fast, intra=cm.Link(1.0, 0.0), inter=cm.Link(1000.0, 0.0))
    assert cm.predict("burst", odd, cm.Attn(32 * 4096, 32, 4, 128)).comm_only_s > 10 * cm.predict(
        "burst", fast, cm.Attn(32 * 4096, 32, 4, 128)).comm_only_s
    # compute-bound MHA: both hide their traffic except the last hop; burst's is smaller
    slow = dataclasses.replace(cm.PRESETS["a800-paper"], fwd_tflops=1.0, bwd_tflops=1.0)
    assert cm.choose_call(Topology(4, 8), 1, 4096, 32, 32, 128, 2, True, "zigzag", "auto", slow)[1] == "burst"


def test_plan_command(capsys, tmp_path):
    assert main(["plan", "--preset", "a800-paper", "--seq", "1M", "--heads", "40", "--json",
                 str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "use: burst_double" in out and 'topology="4x8"' in out
    assert "Table 1" in out and "do not shard 32 ways" in out
    rec = json.loads((tmp_path / "p.json").read_text())
    assert rec["choice"]["scheme"] == "burst_double" and len(rec["predictions"]) == len(cm.SCHEMES)
    assert rec["table1"]["ring"] > rec["table1"]["burst_double"]
    assert main(["plan", "--nodes", "2", "--gpus-per-node", "2", "--intra-gbps", "278", "--inter-gbps", "24",
                 "--seq", "64K", "--heads", "8", "--kv-heads", "2"]) == 0
    assert "use:" in capsys.readouterr().out
    assert main(["plan", "--heads", "6", "--kv-heads", "4"]) == 2
    assert "multiple of --kv-heads" in capsys.readouterr().err
