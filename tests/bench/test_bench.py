"""`burstengine bench attention` end to end on CPU ranks (the harness, not the figures)."""
import json
import os
import subprocess
import sys


def test_bench_attention_smoke_on_cpu(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    methods = "burst-zigzag,ringbwd-striped,ulysses-math,megatron-tp-math,single-gpu-math"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "burstengine", "bench", "attention", "--device", "cpu", "--seqs", "256", "--mask", "both",
           "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--methods", methods, "--warmup", "1",
           "--iters", "2", "--worlds", "1,2", "--out-dir", str(tmp_path), "--name", "smoke"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    rec = json.load(open(tmp_path / "smoke.json"))
    assert rec["world"] == 2 and rec["command"] and rec["commit"] and rec["env"]["device"] == "cpu"
    rows = rec["rows"]
    # every method x mask x kv-heads case ran, with the raw times of every timed iteration
    # world 1 runs no single-gpu peer (it would be the same run)
    assert len(rows) == 5 * 2 + 4 * 2, rows  # methods x masks, world 2 then world 1 (GQA 2: MHA runs elsewhere)
    assert {r["world"] for r in rows} == {1, 2}
    for r in rows:
        assert "error" not in r, r
        assert len(r["fwd_s"]) == 2 and len(r["fwdbwd_s"]) == 2 and min(r["fwdbwd_s"]) > 0
    assert "burst-zigzag" in p.stdout and "f+b FLOP/s" in p.stdout
    # on CPU: rates in a unit that shows their digits, and no device memory to report
    assert "0.0 TF/s" not in p.stdout and "GF/s" in p.stdout and " n/a" in p.stdout and "0.0 GiB" not in p.stdout


def test_bench_rejects_unknown_method():
    p = subprocess.run([sys.executable, "-m", "burstengine", "bench", "attention", "--device", "cpu",
                        "--methods", "nope"], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert p.returncode != 0 and "unknown method" in (p.stdout + p.stderr)


def test_profile_categories_name_every_attention_kernel():
    # a kernel left in "other" hides the attention's share of a step (the Gluon backward did once)
    from burstengine.bench.probes.profile import category
    cases = {
        "bwd_kernel": "attention backward",  # kernels/gluon/bwd.py
        "kv_kernel": "attention backward", "dq_kernel": "attention backward",  # kernels/triton/bwd.py
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128": "attention backward",
        "fwd_kernel": "attention forward",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128": "attention forward",
        "nvjet_tst_256x128_64x4_1x2_h_bz_coopa_NNT": "gemm",
        "ncclDevKernel_AllGather_RING_LL": "collective",
        # a prefill's: the SDPA peers' attention, the compiled RMSNorm / RoPE (model/fused.py: inductor
        # names the casts and cats inside them), the CPU ops of a gloo run
        "pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false>>": "attention forward",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<>::Params)":
            "attention forward",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "elementwise/norm/rope",
        "triton_poi_fused__to_copy_add_cat_mul_neg_slice_unsqueeze_0": "elementwise/norm/rope",
        "triton_red_fused__log_softmax_0": "loss",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<OpaqueType<4u>, unsigned int, 4, 64, 64>": "copy",
        "Memcpy DtoD (Device -> Device)": "copy",
        "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)": "collective",
        "c10d::_reduce_scatter_base_": "collective", "gloo:all_gather": "collective", "aten::linear": "gemm",
        # kernels/triton/bwd.py's D = rowsum(O * dO) before the backward, loss/fused_ce.py's rows
        "delta_kernel": "attention backward", "ce_rows_kernel": "loss",
    }
    for name, want in cases.items():
        assert category(name) == want, name



def test_profile_timeline_finds_waits_on_transfers():
    # the compute stream idle while an offloaded layer's activations move: counted as a wait in
    # the phase where it happens, a transfer under a kernel is not
    from burstengine.bench.probes.profile import timeline
    acts = [("fwd_kernel", 0, 10, "attention forward"),
            ("Memcpy DtoH (Device -> Pinned)", 5, 14, "copy"),       # 4 us past the forward kernel
            ("nvjet_gemm", 14, 20, "gemm"),
            ("bwd_kernel", 20, 40, "attention backward"),
            ("Memcpy HtoD (Pinned -> Device)", 38, 46, "copy"),      # 6 us alone
            ("bwd_kernel", 46, 60, "attention backward")]
    t = timeline(acts, 60.0)
    assert t["compute_gaps_s"] == {"forward": 4e-6, "backward": 6e-6}, t
    assert t["transfers_s"] == {"dtoh": 9e-6, "htod": 8e-6}, t
    assert abs(t["transfer_only_s"] - 10e-6) < 1e-12, t


def test_profile_exposure_splits_fsdp_from_the_ring():
    # a collective under a computing kernel is hidden; the part past every kernel is exposed
    from burstengine.bench.probes.profile import exposure
    acts = [("nvjet_gemm", 0, 10, "gemm"),
            ("ncclDevKernel_AllGather_RING_LL", 2, 14, "collective"),   # 4 us past the gemm
            ("fwd_kernel", 14, 30, "attention forward"),
            ("ncclDevKernel_SendRecv", 20, 37, "collective")]           # 7 us past the attention
    e = exposure(acts)
    assert e["fsdp"] == {"kernel_s": 12e-6, "exposed_s": 4e-6}, e
    assert e["ring"] == {"kernel_s": 17e-6, "exposed_s": 7e-6}, e


def test_profile_gap_causes_charge_idle_time_to_the_shortest_host_op():
    # GPU busy [0, 10] and [100, 110] in a window [0, 130]: gaps [10, 100] and [110, 130]; a
    # 3 us gap [60, 63] is not one (GPU busy [55, 60] and [63, 70]) but launch latency
    from burstengine.bench.probes.profile import gap_causes
    busy = [(0, 10), (55, 60), (63, 70), (100, 110)]
    ops = [("step", 0, 130, -1),              # 0: encloses everything
           ("backward", 5, 125, 0),           # 1
           ("aten::empty", 20, 50, 1),        # 2: [20, 50] of the first gap
           ("cudaMalloc", 25, 45, 2),         # 3: the shortest, inside it: [25, 45]
           ("cudaStreamSynchronize", 112, 118, 1)]  # 4: in the second gap
    g = gap_causes(ops, busy, 0.0, 130.0, min_us=10.0)
    got = {c["op"]: (round(c["s"] * 1e6, 6), c["gaps"]) for c in g["causes"]}
    # gap 1 = [10,55]: 25-10 + 50-45 backward... [10,20] backward, [20,25] empty, [25,45] malloc,
    # [45,50] empty, [50,55] backward; gap 2 [70,100]: backward; gap 3 [110,130]: backward
    # [110,112], [118,125]; sync [112,118]; step [125,130]
    assert got == {"backward": (10 + 5 + 30 + 2 + 7, 3), "cudaMalloc": (20, 1), "aten::empty": (10, 1),
                   "cudaStreamSynchronize": (6, 1), "step": (5, 1)}, got
    assert abs(g["gaps_s"] - (45 + 30 + 20) * 1e-6) < 1e-12 and abs(g["short_gaps_s"] - 3e-6) < 1e-12, g
    top = g["causes"][0]
    assert top["op"] == "backward" and top["inside"] == "backward < step", top
    assert next(c for c in g["causes"] if c["op"] == "cudaMalloc")["inside"] == "cudaMalloc < aten::empty < backward < step"
    # no host op at all: said so
    g = gap_causes([], [(0, 10)], 0.0, 40.0)
    assert g["causes"] == [{"op": "(no host op)", "s": 30e-6, "gaps": 1, "inside": ""}], g


def test_memory_trace_replay_says_what_each_stream_held_at_the_peak_and_before_a_release():
    # two streams: compute (1) and a side stream (2); GiB-sized events.  The side stream frees its
    # block (still cached, reserved), compute grows to the peak (7 GiB), then a retry unmaps the
    # side stream's cache and compute's spare segment and maps anew for its allocation
    from burstengine.bench.probes.profile import replay
    G = 2**30
    trace = [dict(action="segment_map", stream=2, size=3 * G), dict(action="alloc", stream=2, size=3 * G),
             dict(action="free_requested", stream=2, size=3 * G), dict(action="free_completed", stream=2, size=3 * G),
             dict(action="segment_map", stream=1, size=2 * G), dict(action="alloc", stream=1, size=1 * G),
             dict(action="segment_unmap", stream=2, size=3 * G), dict(action="segment_unmap", stream=1, size=1 * G),
             dict(action="segment_map", stream=1, size=4 * G), dict(action="alloc", stream=1, size=4 * G)]
    got = replay({1: 2 * G}, {1: 2 * G}, trace, {1: "compute"})
    # the peak (7 GiB) came when compute mapped its second segment, while the side stream still
    # cached its 3 GiB (the map after the release reaches 7 again, not more)
    assert got["peak_reserved_gib"] == 7.0
    assert got["at_peak"] == {"compute": {"reserved": 4.0, "allocated": 2.0},
                              "stream 2": {"reserved": 3.0, "allocated": 0.0}}
    (r,) = got["releases"]
    assert r["before"] == {"compute": {"reserved": 4.0, "allocated": 3.0}, "stream 2": {"reserved": 3.0, "allocated": 0.0}}
    assert r["freed"] == {"stream 2": 3.0, "compute": 1.0}
    assert r["next_alloc"] == {"stream": "compute", "gib": 4.0}
    assert got["events"] == len(trace) and got["ooms"] == 0


def test_memory_trace_counts_a_block_awaiting_its_free_as_allocated():
    # a block freed while another stream used it is "active_awaiting_free" in the snapshot the
    # history starts from; its free_completed comes in the history: the stream's bytes in use
    # must not go below zero
    from burstengine.bench.probes.profile import _held, replay
    G = 2**30
    seg = dict(device=0, stream=1, total_size=4 * G, blocks=[dict(size=G, state="active_allocated"),
                                                              dict(size=2 * G, state="active_awaiting_free"),
                                                              dict(size=G, state="inactive")])
    other = dict(device=1, stream=1, total_size=8 * G, blocks=[dict(size=8 * G, state="active_allocated")])
    reserved, allocated = _held({"segments": [seg, other]}, 0)
    assert reserved == {1: 4 * G} and allocated == {1: 3 * G}
    got = replay(reserved, allocated, [dict(action="free_completed", stream=1, size=2 * G),
                                       dict(action="segment_map", stream=1, size=G)], {1: "compute"})
    assert got["at_peak"] == {"compute": {"reserved": 5.0, "allocated": 1.0}}, got


def test_memory_trace_tells_each_release_alone():
    # an empty_cache (a release no allocation retried: the next one comes from a cached block),
    # then a retry's release past the number told: neither its bytes nor its allocation are the
    # first release's
    from burstengine.bench.probes.profile import replay
    G = 2**30
    trace = [dict(action="segment_unmap", stream=1, size=G),
             dict(action="free_requested", stream=1, size=G), dict(action="free_completed", stream=1, size=G),
             dict(action="alloc", stream=1, size=G // 4),
             dict(action="segment_unmap", stream=2, size=2 * G), dict(action="segment_map", stream=1, size=3 * G),
             dict(action="alloc", stream=1, size=3 * G)]
    got = replay({1: 4 * G, 2: 2 * G}, {1: G}, trace, {1: "compute"}, releases=1)
    assert got["releases"] == [{"before": {"compute": {"reserved": 4.0, "allocated": 1.0},
                                           "stream 2": {"reserved": 2.0, "allocated": 0.0}},
                                "freed": {"compute": 1.0}, "next_alloc": None}], got["releases"]
    assert len(replay({1: 4 * G, 2: 2 * G}, {1: G}, trace, {1: "compute"})["releases"]) == 2
    # nor is a later growth's allocation, with no release between
    grown = trace[:4] + trace[5:]
    assert replay({1: 4 * G, 2: 2 * G}, {1: G}, grown, {1: "compute"})["releases"][0]["next_alloc"] is None


def test_profile_gap_causes_match_a_moment_by_moment_count():
    # random profiles on a 1-us grid: each idle microsecond of a gap of >= 10 us goes to the
    # shortest op over it (lengths all distinct: no ties), on any thread; ops that start before
    # the window, end after it, overlap on other threads or last 0 us included
    import random

    from burstengine.bench.probes.profile import gap_causes
    for seed in range(200):
        r = random.Random(seed)
        lengths = r.sample(range(0, 400), r.randint(0, 40))
        ops = [(f"op{k}", (s := r.randint(-60, 300)), s + n, -1) for k, n in enumerate(lengths)]
        busy = [((s := r.randint(-20, 320)), s + r.randint(1, 40)) for _ in range(r.randint(0, 15))]
        want, gap_of = {}, {}
        t = 0
        while t < 300:  # the idle stretches of [0, 300]
            if any(a <= t < b for a, b in busy):
                t += 1
                continue
            e = t
            while e < 300 and not any(a <= e < b for a, b in busy):
                e += 1
            if e - t >= 10:
                for u in range(t, e):
                    over = [o for o in ops if o[1] <= u and o[2] >= u + 1]
                    name = min(over, key=lambda o: o[2] - o[1])[0] if over else "(no host op)"
                    want[name] = want.get(name, 0) + 1
                    gap_of.setdefault(name, set()).add(t)
            t = e
        g = gap_causes(ops, busy, 0.0, 300.0, top=100)
        got = {c["op"]: (round(c["s"] * 1e6, 6), c["gaps"]) for c in g["causes"]}
        assert got == {n: (float(s), len(gap_of[n])) for n, s in want.items()}, (seed, got, want)


def test_training_benches_check_at_the_trainers_level(monkeypatch):
    # bench train / bench profile time what `burstengine train` runs: checks at level "once"
    # (BURST_CHECKS when set).  At "full" every layer read the NaN/inf scan back on the host.
    from burstengine.attention import checks
    from burstengine.bench.peers import train
    from burstengine.bench.probes import profile

    monkeypatch.setattr(train, "_run_case", lambda *a: checks.check_level())
    monkeypatch.setattr(profile, "_profile", lambda *a: checks.check_level())
    monkeypatch.delenv("BURST_CHECKS", raising=False)
    assert train.run_case("tiny", "burst", 8, None) == "once"
    assert profile.run_rank(None) == "once"
    monkeypatch.setenv("BURST_CHECKS", "full")
    assert train.run_case("tiny", "burst", 8, None) == "full" and profile.run_rank(None) == "full"


def test_suite_time_records_the_readme_command(tmp_path, monkeypatch, capsys):
    """bench suite-time runs pytest as the README does (here on one small file) and records its
    summary, wall and CPU time; from a folder without tests/ it refuses in one line."""
    from burstengine.bench.probes import suite_time

    root = os.getcwd()
    # -n 0: one test process (pyproject's addopts would start two) for a file of two tests outside
    # tests/ (whose conftest imports torch: seconds a run)
    one = tmp_path / "t" / "test_one.py"
    one.parent.mkdir()
    one.write_text("def test_one():\n    assert 1\n\n\ndef test_two():\n    assert 2\n")
    assert suite_time.main(["--pytest-args", f"-q -n 0 -p no:cacheprovider {one}", "--out-dir", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "suite_cpu.json").read_text())
    assert rec["returncode"] == 0 and "2 passed" in rec["summary"] and "failed" not in rec["summary"]
    assert rec["wall_s"] > 0 and rec["cpu_s"] > 0 and rec["pytest"].endswith("test_one.py")
    assert "passed" in suite_time.block_suite([("suite_cpu.json", rec)])
    assert suite_time.main(["--pytest-args", f"-q -n 0 -p no:cacheprovider {one} -k no_such_test_at_all",
                            "--out-dir", str(tmp_path), "--name", "none"]) == 1  # pytest's exit 5: nothing ran
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert suite_time.main([]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    monkeypatch.chdir(root)


def test_longest_table_shows_a_try_that_fit_as_its_peak_not_as_oom():
    """The record holds each try's peak in bytes (None on OOM); the table once read a GiB key only
    and showed every try, the one that fit too, as "OOM"."""
    from burstengine.bench.probes.longest import render
    rec = {"rows": [{"method": "burst-zigzag", "predicted": 5_000_000, "capped": 4_194_304, "longest": 4_194_304,
                     "tries": [{"S": 4_194_304, "peak_bytes": 100 * 2**30, "seconds": 300.0}]},
                    {"method": "torch-cp-cudnn", "predicted": 900_000, "longest": 800_000,
                     "tries": [{"S": 900_000, "peak_bytes": None, "seconds": 9.0},
                               {"S": 800_000, "peak_bytes": 2**31, "seconds": 8.0}]}]}
    out = "\n".join(render(rec))
    assert "S=4194304: 100.0 GiB (300 s)" in out and "tried at most 4194304" in out
    assert "S=900000: OOM" in out and "S=800000: 2.0 GiB" in out


def test_decode_tables_mark_a_row_timed_op_by_op():
    """Under graphs="auto" a capture that fails on every try leaves the row timed op by op: the
    block, whose rows are CUDA-graph steps, and the record's table, whose column is the graph's
    time, say so on that row (and only there)."""
    import copy
    import glob

    from burstengine.bench.peers.decode import RANK_RUNS, block_decode_ranks, render

    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "results")
    records = [(os.path.basename(p), json.load(open(p))) for p in glob.glob(os.path.join(results, "decode_8b_*.json"))]
    assert "op by op" not in block_decode_ranks(records)
    name = RANK_RUNS[-1]
    rec = copy.deepcopy(dict(records)[name])
    rec["rows"][0]["graphs"] = False
    out = block_decode_ranks([(n, rec if n == name else r) for n, r in records])
    marked = [line for line in out.splitlines() if "op by op" in line]
    assert len(marked) == 1 and f"`{name}`" in marked[0], marked
    assert "op by op: capture failed" not in "\n".join(render(dict(records)[name]))
    assert "op by op: capture failed" in "\n".join(render(rec))
