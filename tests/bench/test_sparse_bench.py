"""burstengine bench sparse at a tiny size on 2 gloo ranks: it runs every case, checks the
sparse path against the reference kernel, and writes a record whose steps, ideal ratios and
bytes agree with the schedule and the byte model."""
import json

from burstengine.masks import Pattern
from burstengine.schedule import backward_bytes, forward_bytes, visible_pairs

import sparse_cases


def test_sparse_bench_tiny(pool, tmp_path):
    world, S, DS, H, D = 2, 512, 256, 2, 8
    argv = ["--device", "cpu", "--seq", str(S), "--doc-seq", str(DS), "--windows", "16,300", "--doc-lengths", "4,64",
            "--heads", str(H), "--head-dim", str(D), "--iters", "1", "--warmup", "0", "--check", "--check-seq", "64",
            "--out-dir", str(tmp_path), "--name", "tiny"]
    rec = pool.run(sparse_cases.bench, argv, world=world)[0]
    on_disk = json.load(open(tmp_path / "tiny.json"))
    assert on_disk["rows"] == json.loads(json.dumps(rec["rows"]))
    assert on_disk["commit"] and on_disk["env"]["device"] == "cpu"
    rows = {(r["name"], r["layout"]): r for r in rec["rows"]}
    docs = f"docs-{len(rec['rows'][-1]['cu_seqlens']) - 1}"
    assert set(rows) == {("causal", "zigzag"), ("swa-16", "contiguous"), ("swa-300", "contiguous"),
                         ("one-doc", "zigzag"), (docs, "striped"), (docs, "contiguous")}
    # a window shorter than a shard needs two of the ring's steps; the causal baseline all of them
    assert rows[("swa-16", "contiguous")]["steps"] == 2 and rows[("causal", "zigzag")]["steps"] == world
    for r in rec["rows"]:
        # on CPU the checked kernel is the reference itself: the check must run and agree exactly
        assert (r["check_err"] == 0.0) if ("cu_seqlens" in r or r["window"]) else ("check_err" not in r)
        p = Pattern(causal=True, window=r["window"], cu_seqlens=tuple(r["cu_seqlens"]) if "cu_seqlens" in r else None)
        assert r["visible_pairs"] == visible_pairs(r["S"], p)
        assert r["ideal_speedup"] == rows[("causal" if r["group"] == "window" else "one-doc", "zigzag")]["visible_pairs"] / r["visible_pairs"]
        assert r["speedup"] > 0 and r["balance"] >= 1.0 and r["ideal_balance"] >= 1.0
        n = r["S"] // world
        trim = dict(layout=r["layout"], mask=p)  # a sparse mask's hops carry only the rows later steps read
        whole = forward_bytes(1, n, H, D, 4, world, r["steps"] - 1) + \
            backward_bytes("burst", 1, n, H, H, D, 4, world, r["steps"] - 1)
        assert r["backward"] == "burst" and r["whole_shard_bytes"] == whole
        for rank, p_ in enumerate(r["per_rank"]):
            assert p_["fwd_bytes"] == p_["model_fwd_bytes"] == forward_bytes(1, n, H, D, 4, world, rank=rank, **trim)
            assert p_["bwd_bytes"] == p_["model_bwd_bytes"] == \
                backward_bytes("burst", 1, n, H, H, D, 4, world, rank=rank, **trim)
            assert p_["fwd_bytes"] + p_["bwd_bytes"] <= whole
        if r["name"] == "swa-16":
            # contiguous, W = 16 <= n: K/V of rank 0 to rank 1, the last 15 rows; Q side of rank 1 to rank 0
            kv = 15 * H * D * 4 * 2
            assert [p_["fwd_bytes"] for p_ in r["per_rank"]] == [kv, 0]
            assert [p_["bwd_bytes"] for p_ in r["per_rank"]] == [15 * H * D * 4, 15 * H * (2 * D * 4 + 8)]
