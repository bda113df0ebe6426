"""Distributed prefill against the real client: a tiny LlamaForCausalLM built with transformers
(random weights, saved to a temporary directory) gives next-token logits and K/V that our
prefill reproduces with CP = 1, 2, 4 and every layout (fp32), and so does a Gemma3ForCausalLM
(CP 1, 2, chunked); the HF-checkpoint loader; the `burstengine prefill` command."""
import dataclasses
import os

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import cli_cases  # noqa: E402
import hf_cases  # noqa: E402
import prefill_cases  # noqa: E402
from burstengine.model import hf_dir  # noqa: E402
from burstengine.inference.models import load_model  # noqa: E402

TOL = 1e-4


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return hf_cases.save_tiny_llama(tmp_path_factory.mktemp("prefill") / "llama", seed=5)


CASES = [(1, "contiguous", "ours")] + [(w, l, "ours") for w in (2, 4) for l in ("contiguous", "zigzag", "striped")] \
    + [(4, "zigzag", "hf")]


@pytest.mark.parametrize("world,layout,impl", CASES)
def test_prefill_matches_transformers(pool, llama_dir, world, layout, impl):
    for rank, (errs, layers, ok_pos, shape) in enumerate(
            pool.run(prefill_cases.prefill_vs_hf, llama_dir, layout, impl, 3, world=world)):
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOL, (rank, worst, errs)
        assert layers == 2 and ok_pos and shape == (2, hf_cases.VOCAB)


@pytest.mark.parametrize("world", [1, 2])
def test_prefill_with_the_fp8_kernel(pool, llama_dir, world):
    """kernel="fp8" reaches every ring step of the prefill: the logits carry FP8's error (many times
    the float32 kernel's, still small), the same on every rank."""
    fp8 = pool.run(prefill_cases.prefill_kernel_error, llama_dir, "zigzag", 3, "fp8", world=world)
    exact = pool.run(prefill_cases.prefill_kernel_error, llama_dir, "zigzag", 3, None, world=world)
    assert len(set(fp8)) == 1, fp8
    assert exact[0] <= TOL and max(10 * exact[0], 1e-3) < fp8[0] <= 0.1, (fp8, exact)


@pytest.fixture(scope="session")
def gemma3_dir(tmp_path_factory):
    return hf_cases.save_tiny_gemma3(tmp_path_factory.mktemp("prefill") / "gemma3", seed=5)


@pytest.mark.parametrize("world,layout,chunk", [(1, "contiguous", None), (2, "zigzag", None), (2, "striped", 5)])
def test_prefill_gemma3_matches_transformers(pool, gemma3_dir, world, layout, chunk):
    """Gemma 3 (a window of 7 on two layers of three, each layer type's RoPE) over 32 tokens:
    logits and every layer's K/V (after the k norm and RoPE), whole and chunked."""
    for rank, (errs, layers, ok_pos, shape) in enumerate(
            pool.run(prefill_cases.prefill_vs_hf, gemma3_dir, layout, "ours", 3, seq_per_rank=32 // world,
                     chunk=chunk, world=world)):
        worst = max(errs, key=errs.get)
        assert errs[worst] <= TOL, (rank, worst, errs)
        assert layers == 3 and ok_pos and shape == (2, hf_cases.VOCAB)


# --- the checkpoint loader (one process) ----------------------------------------------------------

def _eager_last_logits(path, ids):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        return m(input_ids=ids).logits[:, -1]


def _ours_last_logits(path, ids):
    from burstengine.inference import prefill

    return prefill(load_model(path), ids, layout="contiguous").logits


def test_loader_tied_and_sharded_checkpoints(tmp_path):
    from transformers import LlamaForCausalLM

    ids = torch.randint(0, hf_cases.VOCAB, (1, 24), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1)
    tied = LlamaForCausalLM(hf_cases.tiny_llama_config(tie_word_embeddings=True, rope_theta=500000.0,
                                                       num_key_value_heads=1))
    tied.save_pretrained(tmp_path / "tied")
    assert hf_dir.args_from_hf_config(hf_dir.read_config(str(tmp_path / "tied"))).tie_embeddings
    path = hf_cases.save_tiny_llama(tmp_path / "sharded", seed=2)
    LlamaForCausalLM.from_pretrained(path).save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    assert os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    for d in ("tied", "sharded"):
        p = str(tmp_path / d)
        want = _eager_last_logits(p, ids)
        assert (_ours_last_logits(p, ids) - want).abs().max() <= TOL * want.abs().max()


def test_both_implementations_of_a_preset_agree():
    from burstengine.inference import prefill

    ids = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(4))
    ours, hf = (prefill(load_model("tiny", impl, seed=3), ids, layout="contiguous").logits for impl in ("ours", "hf"))
    assert (ours - hf).abs().max() <= TOL * hf.abs().max()


def test_name_mapping_round_trips():
    from burstengine.model import PRESETS, Transformer

    with torch.device("meta"):
        names = [n for n, _ in Transformer(PRESETS["tiny"]).named_parameters()]
    assert len(names) == 3 + 9 * PRESETS["tiny"].n_layers
    for n in names:
        assert hf_dir.hf_to_ours(hf_dir.ours_to_hf(n)) == (n,)
    assert hf_dir.hf_to_ours("model.layers.3.mlp.gate_proj.weight") == ("layers.3.feed_forward.w1.weight",)
    assert hf_dir.hf_to_ours("model.rotary_emb.inv_freq") is None
    assert hf_dir.hf_to_ours("model.layers.0.self_attn.q_proj.bias", "qwen2") == ("layers.0.attention.wq.bias",)
    assert hf_dir.hf_to_ours("model.layers.0.self_attn.q_norm.weight", "qwen3") == ("layers.0.attention.q_norm.weight",)
    for name, arch in (("model.layers.0.mlp.gate_proj.bias", "qwen2"), ("model.layers.0.self_attn.q_proj.bias", "llama")):
        with pytest.raises(ValueError, match="unexpected tensor"):
            hf_dir.hf_to_ours(name, arch)


# rope scaling, head_dim != hidden / heads, Qwen2/3 and Mistral's window are reproduced now
# (tests/train/test_finetune.py); these are not
@pytest.mark.parametrize("change,match", [
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 5e5, "factor": 8.0}), "rope type 'longrope'"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(attention_bias=True), "attention_bias=true"),
    (dict(mlp_bias=True), "mlp_bias=true"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(model_type="gpt2"), "architecture 'gpt2' is not supported"),
    (dict(model_type="qwen2", use_sliding_window=True), "use_sliding_window=true"),
])
def test_loader_refuses_what_it_cannot_reproduce(change, match):
    cfg = dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=1, vocab_size=32, intermediate_size=96)
    cfg.update(change)
    with pytest.raises(ValueError, match=match):
        hf_dir.args_from_hf_config(cfg)


def test_loader_errors_name_the_problem(tmp_path, llama_dir):
    with pytest.raises(ValueError, match="neither a preset"):
        load_model(str(tmp_path / "nowhere"))
    (tmp_path / "config.json").write_text(open(os.path.join(llama_dir, "config.json")).read())
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_model(str(tmp_path))
    from safetensors.torch import load_file, save_file

    sd = load_file(os.path.join(llama_dir, "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.weight"]
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks 1 tensor\(s\).*model.layers.1.mlp.up_proj.weight"):
        load_model(str(tmp_path))


# --- the command ----------------------------------------------------------------------------------

def _cli(*argv):
    """``burstengine prefill ARGV`` (in this process: tests/cli_cases.py); exit code, stdout + stderr."""
    rc, out, err = cli_cases.run(["prefill", *argv])
    return rc, out + err


def test_cli_in_a_launched_group_reproduces_transformers(pool, llama_dir, tmp_path):
    # the pool's ranks already form a process group, as torchrun's would: the command uses it
    logits = tmp_path / "logits.pt"
    argv = ["prefill", "--model", llama_dir, "--seq", "64", "--layout", "zigzag", "--warmup", "0",
            "--save-logits", str(logits)]
    assert pool.run(prefill_cases.run_cli, argv, world=4) == [0] * 4
    ids = torch.randint(0, hf_cases.VOCAB, (1, 64), generator=torch.Generator().manual_seed(1))  # the CLI's prompt
    want = _eager_last_logits(llama_dir, ids)
    assert (torch.load(logits) - want).abs().max() <= TOL * want.abs().max()


def test_cli_prefills_a_gemma3_directory(gemma3_dir, tmp_path):
    logits = tmp_path / "logits.pt"
    rc, out = _cli("--model", gemma3_dir, "--seq", "40", "--world", "2", "--layout", "zigzag", "--warmup", "0",
                   "--save-logits", str(logits))
    assert rc == 0, out
    ids = torch.randint(0, hf_cases.VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))  # the CLI's prompt
    want = _eager_last_logits(gemma3_dir, ids)
    assert (torch.load(logits) - want).abs().max() <= TOL * want.abs().max()


def test_cli_spawns_ranks_and_writes_kv_shards(tmp_path):
    from safetensors import safe_open

    from burstengine.inference import prefill

    logits, kv = tmp_path / "logits.pt", tmp_path / "kv"
    rc, out = _cli("--model", "tiny", "--seq", "64", "--world", "2", "--layout", "striped", "--iters", "2",
                   "--save-logits", str(logits), "--save-kv", str(kv))
    assert rc == 0, out
    assert "preset tiny (random weights, seed 0)" in out and "median of 2" in out
    assert "first-token latency" in out and "peak memory per rank" in out and "next token (prompt 0)" in out
    model = load_model("tiny")  # the same random weights in one process, on the same prompt
    ids = torch.randint(0, model.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    one = prefill(model, ids, layout="contiguous", keep_kv=True)
    assert (torch.load(logits) - one.logits).abs().max() <= TOL * one.logits.abs().max()
    with safe_open(str(kv / "kv_rank1.safetensors"), "pt") as f:
        assert f.metadata()["layout"] == "striped"
        assert f.get_tensor("positions").tolist() == list(range(1, 64, 2))
        last = model.n_layers - 1
        k = f.get_tensor(f"layers.{last}.k")
        assert k.shape == (1, 32, 2, 32)
        assert (k - one.kv[last][0][:, 1::2]).abs().max() <= TOL * k.abs().max()


@pytest.mark.parametrize("argv,match", [
    (["--model", "llama-99b"], "neither a preset"),
    (["--seq", "0", "--world", "4"], "at least one token"),
    (["--iters", "0"], "--iters must be >= 1"),
    (["--model", "tiny", "--prompt-file", "x.txt"], "does not exist"),
])
def test_cli_rejects_bad_arguments(argv, match, capsys):
    from burstengine import cli

    assert cli.main(["prefill", *argv]) == 2  # refused before any rank starts
    assert match in capsys.readouterr().err


# --- the benchmark (burstengine bench prefill) at a CPU size --------------------------------------

@pytest.mark.parametrize("world", [2, 4])
def test_prefill_bench_runs_every_method_and_they_agree(pool, tmp_path, world):
    import json

    # world 2: every case counts as long (--long 0), so each method's second length runs once
    long = "0" if world == 2 else "1e9"
    argv = ["--models", "tiny", "--seqs", "64,128", "--iters", "2", "--warmup", "0", "--out-dir", str(tmp_path),
            "--methods", "burst,burst-striped,torch-cp,megatron-v3,megatron-v1", "--long", long]
    rows = pool.run(prefill_cases.bench, argv, world=world)[0]
    assert len(rows) == 5 * 2
    for r in rows:
        if r["method"] == "torch-cp":
            assert r["error"] == "needs CUDA"  # torch CP has no CPU SDPA op
            continue
        assert len(r["seconds"]) == (1 if world == 2 and r["S"] == 128 else 2) and r["peak_bytes"] > 0, r
        if r["method"] != "burst":  # same weights, same prompt: the same next-token logits
            assert r["logits_rel_diff_vs_burst"] <= TOL, r
    rec = json.load(open(tmp_path / f"prefill_{world}cpu.json"))
    assert rec["longest_fit"]["megatron-v3@tiny"] == 128 and rec["longest_fit"]["torch-cp@tiny"] is None
    assert rec["commit"] and rec["env"]["device"] == "cpu" and len(rec["rows"]) == 10


def test_prefill_bench_burst_fp8_is_burst_on_the_fp8_kernel(pool, tmp_path):
    argv = ["--models", "tiny", "--seqs", "64", "--iters", "1", "--warmup", "0", "--out-dir", str(tmp_path),
            "--methods", "burst,burst-fp8"]
    rows = pool.run(prefill_cases.bench, argv, world=2)[0]
    fp8 = next(r for r in rows if r["method"] == "burst-fp8")
    assert 1e-3 < fp8["logits_rel_diff_vs_burst"] < 0.1, fp8  # FP8's error, not another model's


def test_prefill_bench_times_the_first_call_at_each_length(pool, tmp_path):
    """--cold: each length's first call timed apart from the warm ones, the record rewritten after
    every case (the rows so far are on disk while the next case runs)."""
    import json

    argv = ["--models", "tiny", "--seqs", "64,128", "--iters", "2", "--warmup", "1", "--out-dir", str(tmp_path),
            "--methods", "burst,megatron-v1", "--cold", "--name", "cold"]
    rows = pool.run(prefill_cases.bench, argv, world=2)[0]
    for r in rows:
        assert r["first_s"] > 0 and r["first_vs_warm"] == r["first_s"] / r["median_s"] and len(r["seconds"]) == 2, r
    # each method ran once at a short length before its first length
    assert [r.get("warmed_at") for r in rows] == [32, None, 32, None], rows
    rec = json.load(open(tmp_path / "cold.json"))
    assert [r["first_s"] for r in rec["rows"]] == [r["first_s"] for r in rows]
    seen = [f for f in tmp_path.iterdir() if f.name.startswith("cold")]
    assert len(seen) == 1, seen  # one record, rewritten: not one file per case


def test_prefill_bench_ranks_agree_when_one_ranks_warm_up_call_fails(pool, tmp_path):
    """--warmup 0: a warm-up call that fails on one rank only stops that method on every rank, said
    in its row (each rank going on alone would put the ranks in different collectives)."""
    argv = ["--models", "tiny", "--seqs", "64,128", "--iters", "1", "--warmup", "0", "--out-dir", str(tmp_path),
            "--methods", "burst,megatron-v3", "--name", "warmfail"]
    per_rank = pool.run(prefill_cases.bench_warm_fails_on_rank_1, argv, world=2)
    for rows in per_rank:
        first = [r for r in rows if r["S"] == 64]
        assert all("warm-up call at 32 tokens failed" in r["error"] for r in first), first
        assert all(r["error"] == "not run: its warm-up call failed" for r in rows if r["S"] == 128), rows
    assert "a warm-up failure on rank 1" in per_rank[1][0]["error"]
    assert per_rank[0][0]["error"].endswith("failed on another rank")


def test_prefill_bench_profiles_one_more_call_at_the_last_length(pool, tmp_path):
    """--profile: one call of each method that ran at the last length, after its timed calls, under
    torch.profiler; its breakdown (the calling thread's ops on CPU: they do not overlap, so the
    categories add up to the busy time) lands in that row alone, and rank 0 prints it."""
    import json

    argv = ["--models", "tiny", "--seqs", "64,128", "--iters", "1", "--warmup", "0", "--out-dir", str(tmp_path),
            "--methods", "burst,torch-cp,megatron-v3"]
    rows = pool.run(prefill_cases.bench, argv + ["--profile", "--top", "5", "--name", "prof"], world=2)[0]
    profiled = [r for r in rows if "profile" in r]
    assert [(r["method"], r["S"]) for r in profiled] == [("burst", 128), ("megatron-v3", 128)], rows
    # --warmup 0: each method still ran once at a short length first (no method pays the process's start)
    assert [r.get("warmed_at") for r in rows if "seconds" in r] == [32, None, 32, None], rows
    for r in profiled:
        p = r["profile"]
        assert len(r["seconds"]) == 1 and p["wall_s"] > 0, r  # the timed figures: the --iters calls alone
        assert 0 < p["cpu_busy_s"] <= p["wall_s"] and abs(p["host_gap_s"] - (p["wall_s"] - p["cpu_busy_s"])) < 1e-9
        assert sum(p["categories_s"].values()) <= p["cpu_busy_s"] * (1 + 1e-6) + 1e-9, p
        assert 0 < len(p["top_kernels"]) <= 5 and all(len(k["name"]) <= 160 and k["calls"] > 0
                                                      for k in p["top_kernels"]), p
        assert set(p["collectives_s"]) == {"gather/reduce", "send/recv and other"}, p
    # Megatron-v3's all-gathers and reduce-scatters are collectives, BurstAttention's ring is inside its attention
    assert profiled[0]["profile"]["categories_s"]["attention forward"] > 0
    assert profiled[1]["profile"]["collectives_s"]["gather/reduce"]["kernel_s"] > 0
    rec = json.load(open(tmp_path / "prof.json"))
    assert [("profile" in r) for r in rec["rows"]] == [("profile" in r) for r in rows]

    plain = pool.run(prefill_cases.bench, argv + ["--name", "plain"], world=2)[0]
    assert not any("profile" in r for r in plain)


def test_prefill_bench_rates_burst_rows_against_one_gpu_speeds(pool, tmp_path):
    """--efficiency: each BurstEngine row that ran (not the peers) holds its FLOPs, the single-GPU
    speeds measured on rank 0 after the timed calls with the probe's shapes, its ideal time on the
    ranks at those speeds and ideal ÷ measured, warm and (--cold) first; every rank has rank 0's
    figures; the record holds them and renders them."""
    import json

    from burstengine.bench.peers import prefill as pb

    argv = ["--models", "tiny", "--seqs", "64", "--iters", "2", "--warmup", "0", "--out-dir", str(tmp_path),
            "--methods", "burst,megatron-v1", "--cold", "--efficiency", "--name", "eff"]
    per_rank = pool.run(prefill_cases.bench, argv, world=2)
    rows = per_rank[0]
    assert per_rank[1] == rows  # rank 0's probe, broadcast: the same figures on every rank
    burst, megatron = rows
    assert not any(k in megatron for k in ("ideal_s", "parallel_efficiency", "probe")), megatron
    att, mm = burst["probe"]["attention"], burst["probe"]["matmul"]
    # the probe: one causal block of S / W = 32 query rows with tiny's 4 q / 2 kv heads of 32, on CPU's
    # auto kernel; a 256 x 128 @ 128 x 352 matmul; TFLOP/s = their FLOPs (hand-counted) / their time
    assert (att["rows"], att["heads"], att["kv_heads"], att["head_dim"]) == (32, 4, 2, 32), att
    assert att["kernel"] == "cpu_flash" and burst["probe"]["device"] == "cpu", burst["probe"]
    assert att["tflops"] == pytest.approx(2 * 32 ** 2 * 4 * 32 / att["seconds"] / 1e12, rel=1e-12)
    assert (mm["rows"], mm["dim"], mm["ffn"]) == (256, 128, 352)
    assert mm["tflops"] == pytest.approx(2 * 256 * 128 * 352 / mm["seconds"] / 1e12, rel=1e-12)
    assert (burst["attention_tflops"], burst["matmul_tflops"]) == (att["tflops"], mm["tflops"])
    assert (burst["attention_flops"], burst["dense_flops"]) == pb.prefill_flops(pb.SHAPES["tiny"], 64)
    ideal = (burst["attention_flops"] / 2 / (burst["attention_tflops"] * 1e12)
             + burst["dense_flops"] / 2 / (burst["matmul_tflops"] * 1e12))
    assert burst["ideal_s"] == pytest.approx(ideal, rel=1e-12)
    assert burst["parallel_efficiency"] == pytest.approx(burst["ideal_s"] / burst["median_s"], rel=1e-12)
    assert burst["first_parallel_efficiency"] == pytest.approx(burst["ideal_s"] / burst["first_s"], rel=1e-12)
    rec = json.load(open(tmp_path / "eff.json"))
    assert rec["rows"] == rows
    text = "\n".join(pb.render(rec))
    assert "| parallel efficiency | first call's efficiency |" in text
    assert f"| {burst['parallel_efficiency']:.1%} | {burst['first_parallel_efficiency']:.1%} |" in text


def test_prefill_flops_against_a_hand_count():
    """A causal prefill's FLOPs: attention 2·S²·heads·head_dim a layer (QKᵀ and PV, 2·d a pair each,
    over the causal half); 2 per weight of the layers for every token; the final norm and the LM
    head for the last position only (prefill's logits)."""
    from burstengine.bench.peers.prefill import prefill_flops
    from burstengine.model import PRESETS

    # tiny: dim 128, 2 layers, 4 heads / 2 kv heads of 32, ffn 352, vocab 512
    S = 64
    attention = 2 * (2 * S * S * 4 * 32)
    per_layer = 128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 352 + 2 * 128  # q, o; k, v; gate, up, down; 2 norms
    dense = 2 * (2 * per_layer) * S + 2 * (128 + 512 * 128)
    assert prefill_flops(PRESETS["tiny"], S) == (attention, dense)
    # a tied LM head is the embedding matrix: the same matmul, the same FLOPs
    tied = dataclasses.replace(PRESETS["tiny"], tie_embeddings=True)
    assert prefill_flops(tied, S) == (attention, dense)


def test_prefill_bench_efficiency_needs_a_burst_row_and_plain_causal_attention(monkeypatch, capsys):
    from burstengine.bench.peers import prefill as pb
    from burstengine.model import PRESETS

    def err(*argv):
        return pb.validate(pb.build_parser().parse_args(["--models", "tiny", "--seqs", "64", *argv]))

    assert err("--methods", "burst-striped,megatron-v3", "--efficiency") is None
    assert err("--methods", "megatron-v3,megatron-v1", "--efficiency") == (
        "--efficiency rates BurstEngine's rows (burst, burst-fp8, burst-<layout>); --methods megatron-v3,megatron-v1 "
        "has none")
    assert err("--methods", "megatron-v3") is None
    monkeypatch.setitem(pb.SHAPES, "tiny", dataclasses.replace(PRESETS["tiny"], window=16))
    assert "model tiny has a sliding window of 16" in err("--methods", "burst", "--efficiency")
    assert err("--methods", "burst") is None
    # the table: a row's efficiency warm / first call, and the probe's speeds and shapes
    probe = dict(device="NVIDIA H200", dtype="bfloat16", matmul=dict(rows=16384, dim=4096, ffn=14336, tflops=700.0),
                 attention=dict(kernel="auto: gluon", rows=65536, heads=32, kv_heads=8, head_dim=128, tflops=600.0))
    rows = [dict(model="8b", method="burst", S=2 ** 20, world=2, dtype="bfloat16", seconds=[10.0], median_s=10.0,
                 std_s=0.0, first_s=12.5, first_vs_warm=1.25, ideal_s=9.3, parallel_efficiency=0.93,
                 first_parallel_efficiency=0.744, probe=probe)]
    pb.print_tables(rows, ["burst"], [2 ** 20])
    out = capsys.readouterr().out
    assert "parallel efficiency (ideal ÷ measured, warm / first call) at NVIDIA H200's" in out
    assert "burst            93.0%/74.4%" in out
    assert ("matmul 700.0 TF/s (16384 x 4096 @ 4096 x 14336); attention 600.0 TF/s (auto: gluon, causal, 65536 "
            "rows, 32/8 heads, d 128)") in out


def test_prefill_bench_tables_and_longest_fit(capsys):
    from burstengine.bench.peers import prefill as pb

    rows = [dict(model="7b", method=m, S=s, world=4, dtype="bfloat16",
                 **({"seconds": [1.0, 1.2], "median_s": 1.1, "std_s": 0.1, "peak_bytes": 2**30} if s <= fit
                    else {"error": "OOM: CUDA out of memory"}))
            for m, fit in (("burst", 1024), ("megatron-v3", 512)) for s in (256, 512, 1024)]
    rows[-1]["error"] = "not run: OOM at 1024"
    assert pb.longest_fit(rows, "burst", "7b") == 1024 and pb.longest_fit(rows, "megatron-v3", "7b") == 512
    pb.print_tables(rows, ["burst", "megatron-v3"], [256, 512, 1024])
    out = capsys.readouterr().out
    assert "megatron-v3      1.100±0.100   1.100±0.100         (OOM)           512" in out
    rows[2]["profile"] = dict(wall_s=2.0, gpu_busy_s=1.5, host_gap_s=0.5, categories_s={"gemm": 1.0, "collective": 0.5},
                              top_kernels=[], collectives_s={"gather/reduce": dict(kernel_s=0.5, exposed_s=0.25)})
    pb.print_profiles(rows)
    out = capsys.readouterr().out
    assert "profile of 7b burst S=1,024 (rank 0): call 2.000 s, busy 1.500 s" in out and "host gaps" in out
    assert "gemm                        1.000          50.0%" in out and "0.250 s exposed" in out
    assert "not divisible by 2 x 4" in pb.validate(pb.build_parser().parse_args(["--seqs", "100", "--world", "4"]))
    assert "unknown method" in pb.validate(pb.build_parser().parse_args(["--methods", "ring"]))
    assert "--top must be >= 1" in pb.validate(pb.build_parser().parse_args(["--top", "0"]))
