"""Tensor-parallel decoding over the ranks that hold the KV cache (burstengine/model/
tensor_parallel.py, inference/step.py): on gloo, for 2, 3 and 4 ranks, the greedy tokens of a
float64 model decoded with its projections split over the ranks (views of a whole model, or a
model that holds only its slices, prefilled with each layer's weights gathered) equal one-rank
decoding, and every step's logits too (within 1e-10 of the largest), also with the q/k/v and gate/up
weights packed as load_model packs them; with a sliding window,
q/k/v biases, q/k norms and tied embeddings.  A checkpoint is read one slice at a time (the bytes
read are the slice's); the step reads no device value on the host; a CUDA graph is kept on every
rank or on none; the option's errors."""
import pytest
import torch

import generate_cases as gc
import tp_cases as tc

TOL = 1e-10
# Gemma 3's parts: sliding and full layers with two RoPE bases, 1 + weight norms, the norms on the
# attention's and MLP's outputs (after the ranks' partial sums are added), GeGLU, scaled embeddings
GEMMA = dict(window=9, window_layers="sf", local_rope_theta=1000.0, norm_plus_one=True, sandwich_norm=True,
             activation="gelu_tanh", embed_scale=True, query_pre_attn_scalar=20.0, qk_norm=True,
             tie_embeddings=True)


@pytest.fixture(scope="module")
def one_rank(pool):
    return {k: pool.run(tc.run_decode, "whole", False, overrides=o, world=1)[0]
            for k, o in (("plain", None), ("variants", dict(window=9, qkv_bias=True, qk_norm=True)),
                         ("tied", dict(tie_embeddings=True)), ("gemma", GEMMA))}


def _same(got, want):
    tokens, logits, split = got
    err = float((logits - want[1]).abs().max() / want[1].abs().max())
    return tokens == want[0], err, split


@pytest.mark.parametrize("world,source", [(w, s) for w in (2, 3, 4) for s in ("whole", "sliced")]
                         + [(2, "sliced-packed"), (3, "whole-packed")])
def test_tensor_parallel_decode_equals_one_rank(pool, one_rank, world, source):
    res = pool.run(tc.run_decode, source, True, world=world)
    for rank, r in enumerate(res):
        assert r[0] == one_rank["plain"][0], (world, source, rank)
        assert r[2] is True
    same, err, _ = _same(res[0], one_rank["plain"])
    assert same and err < TOL, (world, source, err)


@pytest.mark.parametrize("world,source", [(2, "sliced-packed"), (4, "whole")])
def test_tensor_parallel_decode_over_an_fp8_cache_equals_one_rank(pool, world, source):
    """The FP8 cache under tensor parallelism: the gathered heads' K/V are quantized as one rank's
    whole-model step quantizes them, so the tokens are one rank's and the logits its up to
    float32 rounding (and not the bf16 cache's: the quantization is there)."""
    one = pool.run(tc.run_decode, "whole", False, kv_dtype="fp8", world=1)[0]
    res = pool.run(tc.run_decode, source, True, kv_dtype="fp8", world=world)
    assert all(r[2] is True and r[0] == one[0] for r in res)
    same, err, _ = _same(res[0], one)
    assert same and err < TOL, (world, source, err)
    plain = pool.run(tc.run_decode, "whole", False, world=1)[0]
    assert float((one[1] - plain[1]).abs().max() / plain[1].abs().max()) > 10 * TOL


@pytest.mark.parametrize("world,source,kind", [(2, "sliced", "variants"), (4, "whole", "variants"),
                                               (2, "sliced-packed", "variants"),
                                               (3, "sliced", "tied"), (2, "whole", "tied"),
                                               (2, "sliced", "gemma"), (4, "whole", "gemma")])
def test_tensor_parallel_variants(pool, one_rank, world, source, kind):
    o = {"variants": dict(window=9, qkv_bias=True, qk_norm=True), "tied": dict(tie_embeddings=True),
         "gemma": GEMMA}[kind]
    res = pool.run(tc.run_decode, source, "auto", overrides=o, world=world)
    same, err, split = _same(res[0], one_rank[kind])
    assert same and err < TOL and split is True, (world, source, kind, err)


@pytest.mark.parametrize("world,source,kind", [(2, "sliced-packed", "plain"), (3, "whole", "gemma"),
                                               (2, "sliced-packed", "variants")])
def test_one_sequence_ropes_q_and_k_after_the_gather(pool, world, source, kind):
    # a step of one sequence hands the gather raw q, k, v (Hooks.raw_qkv): the q/k norms and RoPE
    # (Gemma's two bases among them) run as the heads are unpacked; the same tokens and logits
    o = {"plain": None, "variants": dict(window=9, qkv_bias=True, qk_norm=True), "gemma": GEMMA}[kind]
    want = pool.run(tc.run_decode, "whole", False, overrides=o, lengths=(53,), world=1)[0]
    res = pool.run(tc.run_decode, source, True, overrides=o, lengths=(53,), world=world)
    same, err, split = _same(res[0], want)
    assert same and err < TOL and split is True, (world, source, kind, err)


def test_auto_and_off(pool, one_rank):
    # "auto" splits where the shapes divide (24 heads over 4), and not where they do not (12 kv heads
    # over 4 do, 5 heads would not); False keeps the whole model on every rank: the same tokens
    res = pool.run(tc.run_decode, "whole", False, world=2)
    assert res[0][2] is False and _same(res[0], one_rank["plain"])[:2] == (True, pytest.approx(0, abs=TOL))
    odd = dict(n_heads=20, n_kv_heads=10, dim=160)  # 10 kv heads over 4 ranks: no split
    res = pool.run(tc.run_decode, "whole", "auto", overrides=odd, world=4)
    assert all(r[2] is False for r in res)
    res = pool.run(tc.run_decode, "whole", "auto", overrides=odd, world=2)
    assert all(r[2] is True for r in res)


@pytest.mark.parametrize("source,mode,overrides,match", [
    ("whole", True, dict(n_heads=20, n_kv_heads=10, dim=160), "kv heads (10) divisible by 4"),
    ("sliced", False, None, "holds only its tensor-parallel slices"),
    ("whole", "yes", None, "tensor_parallel must be True, False or 'auto'"),
])
def test_option_errors_on_every_rank(pool, source, mode, overrides, match):
    msgs = pool.run(tc.raises, source, mode, overrides, world=4)
    assert all(m is not None and match in m for m in msgs), msgs


def test_a_slice_cannot_run_on_another_group(pool):
    # a model sliced over 4 ranks, decoded over 2 of them: refused before anything runs
    from burstengine.model.tensor_parallel import Split, refuses

    assert refuses(tc.model(None, "whole").model.args, 5) is not None
    m = tc.model(None, "whole")
    m.model.tp = Split(1, 4)  # as a rank-1-of-4 slice would say
    with pytest.raises(ValueError, match="slice of rank 1 of 4; this run is rank 0 of 1"):
        m.decoder(None)


def test_hf_checkpoint_sliced_greedy_equals_transformers(pool, tmp_path):
    from test_generate import hf_greedy

    path = gc.save_tiny(tmp_path / "llama", "llama", seed=1)  # 4 heads, 2 kv heads, ffn 96, vocab 192
    want = hf_greedy(path, (97, 45), 6)
    for rank, tokens in enumerate(pool.run(tc.run_hf_sliced, path, (97, 45), 6, world=2)):
        assert tokens == want, rank


def test_sliced_load_reads_only_the_slice(tmp_path):
    from burstengine.model.hf_dir import load_hf_model, load_weights
    from burstengine.model.tensor_parallel import Split, sliced

    path = gc.save_tiny(tmp_path / "qwen2", "qwen2", seed=2)  # q/k/v biases: sliced rows too
    whole = load_hf_model(path)
    total = sum(p.numel() * p.element_size() for p in whole.parameters())
    for world in (1, 2):
        got = 0
        for r in range(world):
            m = sliced(whole.args, Split(r, world), "cpu", torch.float32)
            stats = load_weights(m, path)
            mine = sum(p.numel() * p.element_size() for p in m.parameters())
            assert stats["read_bytes"] == mine  # the slice's bytes, nothing more
            got += mine
            full = dict(whole.named_parameters())
            for n, p in m.named_parameters():
                c = m.tp.cut(n, m.args)
                want = full[n] if c is None else full[n].narrow(c.dim, c.start, c.size)
                assert torch.equal(p, want), (world, r, n)
        # the sliced parameters once over the ranks, the rest (norms, embedding) on every rank
        whole_only = sum(p.numel() * p.element_size() for n, p in whole.named_parameters()
                         if Split(0, 2).cut(n, whole.args) is None)
        assert got == total + (world - 1) * whole_only
        if world == 2:
            assert stats["read_bytes"] < total


@pytest.mark.parametrize("kv_dtype", [None, "fp8"])
def test_tensor_parallel_step_reads_no_device_value_on_the_host(pool, kv_dtype):
    res = pool.run(tc.watch_step, kv_dtype, world=2)
    for tokens, ops, bad in res:
        assert tokens == res[0][0] and not bad, bad
        # the step's own collectives ran inside it (the q/k/v gather, the merge and the logits'
        # all-gathers, the all-reduces after wo and w2); over an FP8 cache, its quantization too
        assert {"_allgather_base_", "allreduce_", "index_copy_", "embedding"} <= set(ops), ops
        assert ("amax" in ops) == (kv_dtype == "fp8"), ops


@pytest.mark.parametrize("graphs", ["auto", "on"])
def test_a_capture_that_fails_on_one_rank_fails_on_all(pool, graphs):
    res = pool.run(tc.capture_fails_on_the_last_rank, graphs, world=2)
    if graphs == "on":
        assert res[1] == ("raised", res[1][1]) and "out of graph memory" in res[1][1]
        assert res[0][0] == "raised" and "failed on rank(s) 1" in res[0][1]
        return
    (t0, w0), (t1, w1) = res
    assert t0 == t1
    assert len(w0) == 1 and "failed on rank(s) 1" in w0[0] and len(w1) == 1 and "out of graph memory" in w1[0]
