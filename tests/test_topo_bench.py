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
