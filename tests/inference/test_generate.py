"""Generation against the sharded KV cache (burstengine/inference/generate.py, kvcache.py,
step.py, sampling.py): greedy tokens equal transformers' generate(do_sample=False) for tiny
random Llama, Qwen2, Mistral (sliding window), Gemma 3 (sliding and global layers) and Phi-3
(LongRoPE, long regime) checkpoints on 1, 2 and 4 gloo ranks, for
prompt lengths that divide nothing and batches of different lengths (every decode step here is
the static step of step.py, launched op by op: on CPU there is no CUDA graph to replay it, and
the graph only replays these kernels); the step is idempotent, as graph capture's warm-up needs;
sampling with a seed gives the same tokens on 1, 2 and 4 ranks; the cache stays balanced; bad
inputs raise clear errors."""
import functools
import random

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import cli_cases  # noqa: E402
import decode_cases  # noqa: E402
import generate_cases as gc  # noqa: E402
from burstengine.inference import Sampling  # noqa: E402
from burstengine.inference.kvcache import appends, merge, next_owner, shard_attention  # noqa: E402
from burstengine.inference.sampling import choose, filtered_logits  # noqa: E402

LENGTHS = (997, 613)   # divide nothing: 997 is prime, 613 too; a batch of two lengths
NEW = 8


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("generate")
    return {arch: gc.save_tiny(root / arch, arch, seed=1) for arch in ("llama", "qwen2", "mistral", "gemma3", "phi3")}


@functools.lru_cache(maxsize=8)
def hf_greedy(path, lengths, new, seed=0):
    """transformers' greedy tokens, each prompt alone (no padding: the attention mask says so, or
    generate takes the prompt's token 0, pad_token_id, for padding, which Gemma 3's masks act on)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    out = []
    for p in gc.prompts(lengths, seed):
        with torch.no_grad():
            r = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                            max_new_tokens=new, do_sample=False, pad_token_id=0)
        out.append(r[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma3", "phi3"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_greedy_equals_transformers(pool, model_dirs, arch, world):
    path = model_dirs[arch]
    want = hf_greedy(path, LENGTHS, NEW)
    for rank, (tokens, _) in enumerate(pool.run(gc.run_generate, path, LENGTHS, NEW, world=world)):
        assert tokens == want, (arch, world, rank)


@functools.lru_cache(maxsize=8)
def hf_logits64(path, prompt: tuple, tokens: tuple):
    """transformers' float64 logits (eager attention) after each prefix of prompt + tokens[:-1]
    that ends past the prompt: the reference for each decode step (teacher-forced)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager").eval()
    ids = torch.tensor([list(prompt) + list(tokens[:-1])])
    with torch.no_grad():
        return hf(ids).logits[0, len(prompt):]


@pytest.mark.parametrize("arch,world", [("llama", 1), ("qwen2", 2), ("mistral", 1), ("mistral", 2), ("gemma3", 1),
                                        ("gemma3", 2), ("phi3", 2)])
def test_decode_logits_equal_transformers(pool, model_dirs, arch, world):
    """Every decode step's logits against transformers' float64 forward over the same tokens
    (the tiny models' greedy tokens hardly depend on attention; their logits do, beyond float32
    rounding): mixed lengths (the cache's visibility), a window (Mistral), two ranks (the
    scratch slot of the rank that does not own a step's token, the all-gather merge), Gemma 3's
    window on some layers, its RoPE per layer type and its attention scale, LongRoPE's long
    factors (Phi-3)."""
    path = model_dirs[arch]
    res = pool.run(gc.run_generate_logits, path, LENGTHS, NEW, world=world)
    tokens, logits = res[0]
    assert logits.shape == (len(LENGTHS), NEW - 1, gc.VOCAB) and all(r[1] is None for r in res[1:])
    for b, p in enumerate(gc.prompts(LENGTHS)):
        ref = hf_logits64(path, tuple(p), tuple(tokens[b]))
        err = float((logits[b].double() - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, (arch, world, b, err)


def test_greedy_long_prompt_and_other_layouts(pool, model_dirs):
    # 4093 tokens (prime) on 4 ranks; the two other layouts on a short batch
    path = model_dirs["llama"]
    assert pool.run(gc.run_generate, path, (4093,), 4, world=4)[0][0] == hf_greedy(path, (4093,), 4)
    want = hf_greedy(path, (61, 3, 100), NEW, seed=5)
    for layout in ("contiguous", "striped"):
        assert pool.run(gc.run_generate, path, (61, 3, 100), NEW, 5, layout, world=3)[0][0] == want, layout


def test_sampling_gives_the_same_tokens_on_1_2_4_ranks(pool, model_dirs):
    path = model_dirs["mistral"]
    s = dict(temperature=1.5, top_k=40, top_p=0.95, seed=11)
    runs = {w: pool.run(gc.run_generate, path, (301, 150), 16, world=w, **s) for w in (1, 2, 4)}
    for w, per_rank in runs.items():
        for tokens, _ in per_rank:
            assert tokens == runs[1][0][0], w
    sampled = runs[1][0][0]
    assert sampled != hf_greedy(path, (301, 150), 16)  # it did sample
    other = pool.run(gc.run_generate, path, (301, 150), 16, world=2, **dict(s, seed=12))[0][0]
    assert other != sampled  # and the seed matters


def test_stop_tokens_end_one_sequence(pool, model_dirs):
    path = model_dirs["qwen2"]
    want = hf_greedy(path, LENGTHS, NEW)
    stop = want[0][2]
    assert stop not in want[1] and stop not in want[0][:2]
    tokens, _ = pool.run(gc.run_generate, path, LENGTHS, NEW, world=2, eos=(stop,))[0]
    assert tokens == [want[0][:3], want[1]]


@pytest.mark.parametrize("world", [1, 2])
def test_greedy_loop_reads_tokens_late_and_stops_where_the_tokens_say(pool, model_dirs, world):
    """Greedy decoding feeds each step's tokens to the next on the device and reads them a step
    late: when every sequence has stopped, the step already launched is dropped unseen (no
    tokens, no on_tokens or on_logits call, no shard lengths, no timing), and each step's calls
    come once, in order, with the tokens transformers chooses (on_logits: the logits they come from)."""
    path = model_dirs["qwen2"]
    want = hf_greedy(path, LENGTHS, NEW)
    # both sequences stop at step 3 (their 4th token); a stop token that came earlier would end them sooner
    eos = (want[0][3], want[1][3])
    assert not set(eos) & set(want[0][:3] + want[1][:3])
    for rank, (tokens, history, calls, timed, seen) in enumerate(
            pool.run(gc.run_generate_stream, path, LENGTHS, NEW, eos, world=world)):
        assert tokens == [w[:4] for w in want]
        assert seen == ([c[:2] for c in calls] if rank == 0 else []), (rank, seen)
        assert [c[0] for c in calls] == [0, 1, 2, 3]
        assert [c[1] for c in calls] == [[want[0][i], want[1][i]] for i in range(4)]
        assert calls[-1][2] == [True, True] and calls[-2][2] == [False, False]
        assert len(history) == 4 and timed == 3
        assert sum(history[-1]) - sum(history[0]) == 3  # the dropped step's append is not reported


def test_greedy_steps_do_not_choose_on_the_host(model_dirs, monkeypatch):
    """The greedy loop never takes the host path (choose -> .cpu() -> broadcast) after the prefill:
    its tokens stay on the device between steps.  Sampling does take it."""
    import importlib

    g = importlib.import_module("burstengine.inference.generate")  # the module (the package exports the function)
    calls = []
    real = g._choose
    monkeypatch.setattr(g, "_choose", lambda *a: calls.append(1) or real(*a))
    model = gc._model(model_dirs["llama"])
    assert g.generate(model, gc.prompts((37,)), 5).tokens == hf_greedy(model_dirs["llama"], (37,), 5)
    assert len(calls) == 1  # the prefill's token
    g.generate(model, gc.prompts((37,)), 5, Sampling(temperature=1.0))
    assert len(calls) == 1 + 5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_greedy_token_read_waits_on_the_tokens_device():
    """The host reads a greedy step's tokens once the event after their copy has passed: recorded
    on the current device's stream, with the model on another GPU, it passed at once and the
    host read the pinned buffer before the copy had landed."""
    import importlib

    g = importlib.import_module("burstengine.inference.generate")
    dev = torch.device("cuda:1")
    with torch.cuda.device(0):
        reader = g._TokenReader(4, dev)
        x = torch.randn(4096, 4096, device=dev) / 64
        for t in range(1, 21):
            y = x
            for _ in range(20):  # work ahead of the tokens on their device's stream
                y = torch.tanh(y @ x)
            assert reader.start((y[0, :4] * 0).long() + t).tokens() == [t] * 4, t


def test_graph_capture_time_is_reported_and_not_a_steps(model_dirs, monkeypatch):
    """timings["graph_capture_s"] is the first step's capture (a capture that fails and leaves the
    step op by op is timed too), kept out of decode_step_s: the greedy loop once reported 0."""
    import importlib
    import time

    g = importlib.import_module("burstengine.inference.generate")
    took = 0.5
    monkeypatch.setattr(g, "use_graphs", lambda mode, dev: True)
    monkeypatch.setattr(g, "_capture", lambda *a, **k: time.sleep(took) or False)
    model = gc._model(model_dirs["llama"])
    for sampling in (Sampling(), Sampling(temperature=1.0)):
        t = g.generate(model, gc.prompts((37,)), 4, sampling).timings
        assert t["graph_capture_s"] >= took and len(t["decode_step_s"]) == 3, t
        assert sum(t["decode_step_s"]) < t["total_s"] - t["prefill_s"] - took, t


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_prefill_pads_a_prompt_of_any_length(pool, model_dirs, layout):
    # 61 tokens on 4 ranks: padded to 64 (zigzag) / 64 (striped); the logits are those of token 60
    from transformers import AutoModelForCausalLM

    path = model_dirs["llama"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        want = hf(torch.tensor(gc.prompts((61,), 3))).logits[:, -1]
    res = pool.run(gc.run_prefill, path, 61, layout, world=4)
    held = sorted(p for _, pos, _ in res for p in pos)
    assert held == list(range(61))  # the pad rows are not returned
    for logits, pos, rows in res:
        assert (logits - want).abs().max() <= 1e-4 * want.abs().max()
        assert rows == [len(pos)] * 2


# --- the cache's balance --------------------------------------------------------------------------

def _check_balance(history):
    """The guarantee stated in kvcache.py, step by step."""
    d0 = max(history[0]) - min(history[0])
    deficit = sum(max(history[0]) - n for n in history[0])
    for t in range(1, len(history)):
        prev, cur = history[t - 1], history[t]
        assert sum(cur) == sum(prev) + 1
        r = next_owner(prev)
        assert cur[r] == prev[r] + 1 and min(prev) == prev[r]
        assert max(cur) - min(cur) <= max(max(prev) - min(prev), 1) <= max(d0, 1)
        if t >= deficit:
            assert max(cur) - min(cur) <= 1, (t, deficit, history)


def test_cache_stays_balanced(pool, model_dirs):
    # 997 tokens on 4 ranks: padded to 1000 under zigzag, the 3 pad slots dropped from rank 0
    path = model_dirs["llama"]
    for _, history in pool.run(gc.run_generate, path, (997,), 12, world=4):
        assert history[0] == [247, 250, 250, 250]
        assert len(history) == 12
        _check_balance(history)
        assert max(history[-1]) - min(history[-1]) <= 1


def test_balance_guarantee_from_any_start():
    rng = random.Random(0)
    for _ in range(200):
        start = [rng.randrange(0, 9) for _ in range(rng.randrange(1, 6))]
        hist = [list(start)]
        for _ in range(rng.randrange(0, 30)):
            n = list(hist[-1])
            n[next_owner(n)] += 1
            hist.append(n)
        _check_balance(hist)
        assert [a + b for a, b in zip(start, appends(start, len(hist) - 1))] == hist[-1]
    assert next_owner([3, 2, 2]) == 1


# --- the pieces, against float64 references ----------------------------------------------------

def test_shard_attention_and_merge_are_exact():
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, D, n = 2, 4, 2, 16, 37
    q = torch.randn(B, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, n, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, n, D, generator=g, dtype=torch.float64)
    vis = torch.rand(B, n, generator=g) < 0.7
    vis[:, 0] = True
    kk, vv = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)
    s = torch.einsum("bhd,bhnd->bhn", q, kk) / D ** 0.5
    s = s.masked_fill(~vis[:, None], float("-inf"))
    ref = torch.einsum("bhn,bhnd->bhd", torch.softmax(s, -1), vv)
    parts = []
    for a, z in ((0, 10), (10, 10), (10, 30), (30, n)):  # an empty shard among them
        o, lse = shard_attention(q, k[:, :, a:z], v[:, :, a:z], D ** -0.5, visible=vis[:, a:z])
        if z == a:
            assert (o == 0).all() and (lse == float("-inf")).all()
        parts.append(torch.cat([o.double(), lse.double()[..., None]], -1))
    out, lse = merge(torch.stack(parts))
    assert (out - ref).abs().max() < 1e-6
    assert (lse - torch.logsumexp(s, -1)).abs().max() < 1e-6


@pytest.mark.parametrize("case", decode_cases.CASES, ids=decode_cases.CASE_IDS)
def test_shard_attention_math_path_matches_oracle(case):
    # the exact path (CPU, float64) on the kernel's cases: valid counts per sequence, visibility,
    # windows over shuffled positions; the slots past the valid ones hold large values here
    # (the math path reads them and must weigh them 0), the kernel's own test poisons them
    q, k, v, valid, visible, window, qpos, kpos = decode_cases.make(case)
    q, k, v = q.double(), k.double().nan_to_num(1e3), v.double().nan_to_num(1e3)
    scale = q.shape[-1] ** -0.5
    out, lse = shard_attention(q, k, v, scale, valid, visible, window, qpos, kpos)
    ro, rl = decode_cases.oracle(q, k, v, scale, valid, visible, window, qpos, kpos)
    assert out.dtype == lse.dtype == torch.float64  # float64 in, float64 out: the oracle keeps its precision
    assert torch.equal(torch.isfinite(lse), torch.isfinite(rl))
    assert (out - ro).abs().max() < 1e-12 and (lse - rl)[torch.isfinite(rl)].abs().max() < 1e-12
    assert (out[~torch.isfinite(rl)] == 0).all()


def test_decode_step_is_idempotent(model_dirs, monkeypatch):
    """A CUDA graph's capture runs the first step's kernels in its warm-up before the step
    itself, so running a step twice on the same state must leave the same cache and logits
    (and the tokens must not change)."""
    from burstengine.inference import step as st

    launch, seen = st.DecodeStep.launch, []

    def twice(self):
        first = self.forward()
        c = self.cache
        snap = [t.clone() for t in (*c.k, *c.v, c.pos, c.visible, self.state)]
        again = launch(self)
        same = torch.equal(first, again) and all(
            torch.equal(a, b) for a, b in zip(snap, (*c.k, *c.v, c.pos, c.visible, self.state)))
        seen.append(same)
        return again

    monkeypatch.setattr(st.DecodeStep, "launch", twice)
    for arch in ("llama", "mistral"):  # a visibility mask (two lengths); a window too
        tokens, _ = gc.run_generate(None, model_dirs[arch], LENGTHS, NEW)
        assert tokens == hf_greedy(model_dirs[arch], LENGTHS, NEW), arch
    assert len(seen) == 2 * (NEW - 1) and all(seen)


def test_a_failed_capture_under_auto_decodes_op_by_op(model_dirs, monkeypatch):
    """graphs='auto' asks for speed, not for the graph: a capture that fails warns once and the
    same step runs op by op, giving the same tokens (graphs='on' raises instead)."""
    import importlib
    import warnings

    from burstengine.inference import step as st

    gen = importlib.import_module("burstengine.inference.generate")  # the module (the package exports the function)

    def broken(self, warmup=2, strict=False):
        raise RuntimeError("capturing the decode step in a CUDA graph failed: operation not permitted")

    monkeypatch.setattr(gen, "use_graphs", lambda mode, device: True)  # as on a GPU
    monkeypatch.setattr(st.DecodeStep, "capture", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens, _ = gc.run_generate(None, model_dirs["llama"], LENGTHS, NEW)
    assert tokens == hf_greedy(model_dirs["llama"], LENGTHS, NEW)
    msgs = [str(w.message) for w in caught if "decoding op by op" in str(w.message)]
    assert len(msgs) == 1 and "operation not permitted" in msgs[0], [str(w.message) for w in caught]
    with pytest.raises(RuntimeError, match="operation not permitted"):
        gen.generate(gc._model(model_dirs["llama"]), gc.prompts(LENGTHS, 0), NEW, graphs="on")


@pytest.mark.parametrize("failures", [1, 2])
def test_a_capture_that_fails_on_one_rank_is_tried_again_on_every_rank(pool, model_dirs, failures):
    """A capture that failed on one rank only (seen on 4xH200: "operation failed due to a previous
    error during capture") is tried again by every rank together, the ranks whose capture worked
    dropping theirs first; once more failing, every rank decodes op by op (no rank replays a
    graph), each saying which rank failed and why: the first try's cause, and the second's where
    it differs; the tokens are the same; under graphs='on' every rank raises."""
    path = model_dirs["llama"]
    want = hf_greedy(path, LENGTHS, NEW)
    res = pool.run(gc.run_generate_flaky_capture, path, LENGTHS, NEW, 1, failures, world=2)
    for rank, (tokens, tried, graphed, replayed, said) in enumerate(res):
        assert tokens == want, rank
        assert tried == [False, True] and graphed is (failures == 1), (rank, tried, graphed)  # the retry strict
        assert len(replayed) == NEW - 1 and set(replayed) == {graphed}, (rank, replayed)
        assert len(said) == 1 and ("failed on rank 1: " if rank == 1 else "failed on rank(s) 1") in said[0], said
        assert ("captured on try 2" in said[0]) is (failures == 1), said
        if rank == 1:
            assert "a previous error during capture" in said[0], said
            assert ("; on try 2: " in said[0] and "illegal memory access" in said[0]) is (failures == 2), said
    if failures == 2:
        for rank, (tokens, tried, graphed, replayed, said) in enumerate(
                pool.run(gc.run_generate_flaky_capture, path, LENGTHS, NEW, 1, failures, "on", world=2)):
            assert tokens is None and tried == [False, True] and not replayed and "rank" in said[0], said
            assert ("a previous error during capture" in said[0]) is (rank == 1), said


# --- the FP8 cache (kv_dtype="fp8") ------------------------------------------------------------

def test_quantize_rows_bounds_and_round_trip():
    """One scale per row: every e4m3 value within its largest (448), each element back within
    e4m3's rounding (half a step of a 3-bit mantissa, or of the subnormal spacing of its row's
    largest / 448), an all-zero row to zeros (the scale's floor, no 0 / 0), magnitudes from 1e-30
    (float32 holds them; a floor of 2^-60 on the scale flushed such rows to zeros) to 1e4 alike."""
    from burstengine.inference.kvcache import dequantize, quantize_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 5, 64, generator=g, dtype=torch.float64)
    x *= torch.tensor([1e-30, 1e-6, 1e-1, 1e2, 1e4], dtype=torch.float64)[None, None, :, None]
    x[1, 2, 3] = 0
    rows, scale = quantize_rows(x)
    assert rows.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    top = rows.float().abs().amax(-1)
    assert bool((top == 448.0).sum() == top.numel() - 1) and top[1, 2, 3] == 0  # each row's largest lands on 448
    back = dequantize(rows, scale, torch.float64)
    bound = 2.0 ** -4 * x.abs() + x.abs().amax(-1, keepdim=True) / 448 * 2.0 ** -10
    assert bool(((back - x).abs() <= bound * (1 + 1e-6)).all())
    assert bool((back[1, 2, 3] == 0).all()) and torch.isfinite(back).all()


@pytest.mark.parametrize("mask", ["", "vis+win"])
def test_fp8_cache_attention_is_its_rows_attention_and_near_the_exact_one(mask):
    """Over an FP8 cache, shard_attention is exact attention over the dequantized rows (float64
    queries: to float64 rounding); against the unquantized cache its error is FP8's: well above
    bf16's (so the quantization cannot go missing) and within a few percent."""
    from burstengine.inference.kvcache import dequantize, quantize_kv

    case = next(c for c in decode_cases.CASES if c[8] == mask and c[7] != torch.float16)
    q, k, v, valid, visible, window, qpos, kpos = decode_cases.make(case)
    # float64 values, not the case's (bf16 ones: rounding them to bf16 would change nothing, and
    # the bound below against bf16's error would be 0 < err)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (q, k, v))
    D = q.shape[-1]
    k8, ks, v8, vs = quantize_kv(k, v)
    got = shard_attention(q, k8, v8, D ** -0.5, valid, visible, window, qpos, kpos, k_scale=ks, v_scale=vs)
    rows = shard_attention(q, dequantize(k8, ks, torch.float64), dequantize(v8, vs, torch.float64), D ** -0.5, valid,
                           visible, window, qpos, kpos)
    exact = shard_attention(q, k, v, D ** -0.5, valid, visible, window, qpos, kpos)
    bf16 = shard_attention(q, k.bfloat16().double(), v.bfloat16().double(), D ** -0.5, valid, visible, window, qpos,
                           kpos)
    assert got[0].dtype == torch.float64 and torch.allclose(got[0], rows[0], atol=1e-12)
    seen = torch.isfinite(exact[1])
    assert torch.equal(torch.isfinite(got[1]), seen) and torch.allclose(got[1][seen], rows[1][seen], atol=1e-12)

    def err(o):
        return float((o - exact[0]).norm() / exact[0].norm())

    assert err(bf16[0]) > 1e-3 and 3 * err(bf16[0]) < err(got[0]) < 0.06, (err(got[0]), err(bf16[0]))


@pytest.mark.parametrize("arch,world", [("llama", 2), ("mistral", 1), ("gemma3", 2)])
def test_fp8_cache_decode_logits_near_transformers_and_equal_over_ranks(pool, model_dirs, arch, world):
    """Decoding from an FP8 cache: every step's logits against transformers' float64 forward over
    the same tokens are FP8's distance away (not float32's: the cache is quantized); the cache's
    rows are quantized per token, so one rank and several give the same logits and tokens."""
    path = model_dirs[arch]
    tokens, logits = pool.run(gc.run_generate_logits, path, LENGTHS, NEW, kv_dtype="fp8", world=world)[0]
    one_tokens, one_logits = pool.run(gc.run_generate_logits, path, LENGTHS, NEW, kv_dtype="fp8", world=1)[0]
    assert tokens == one_tokens and torch.allclose(logits, one_logits, atol=1e-5 * float(one_logits.abs().max()))
    for b, p in enumerate(gc.prompts(LENGTHS)):
        ref = hf_logits64(path, tuple(p), tuple(tokens[b]))
        err = float((logits[b].double() - ref).abs().max() / ref.abs().max())
        assert 2e-5 < err < 0.08, (arch, world, b, err)  # float32 cache: < 1e-5 (the test above)


def test_kv_dtype_is_checked_before_anything_runs(model_dirs):
    from burstengine.inference import generate

    with pytest.raises(ValueError, match="kv_dtype 'int4': one of None, fp8"):
        generate(gc._model(model_dirs["llama"]), gc.prompts((5,)), 2, kv_dtype="int4")


def test_a_capture_raising_other_than_runtimeerror_still_joins_the_agreement(monkeypatch):
    """Whatever a rank's capture raises, that rank joins the all_reduce by which the ranks agree on
    the outcome (leaving generate alone, it would leave the others waiting there), and says which
    rank failed and the exception's kind."""
    import importlib
    import warnings

    gen = importlib.import_module("burstengine.inference.generate")  # the module (the package exports the function)
    reduced = []

    class Step:  # rank 1 of 2; rank 0's capture works
        rank, graph, logits = 1, None, None

        def capture(self, strict=False):
            raise IndexError("device index 9 out of range")

    monkeypatch.setattr(gen.dist, "all_reduce", lambda flags, group=None: reduced.append(flags.tolist()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert gen._capture(Step(), "auto", 2, None, torch.device("cpu")) is False
    assert reduced == [[0.0, 1.0]] * 2
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and "failed on rank 1: IndexError: device index 9 out of range" in said[0], said


@pytest.mark.parametrize("routing_left", [True, False], ids=["torch-2.11", "torch-2.12"])
def test_a_failed_capture_leaves_the_stream_the_allocator_and_its_memory_as_they_were(model_dirs, monkeypatch,
                                                                                    routing_left):
    """A capture invalidated on GPUs ends in capture_end raising (as torch's CUDA calls are faked
    here on CPU: gc.FakeCuda).  The step's error is one line naming the rank and the cause, chains
    nothing, and holds neither the failed graph nor the logits it allocated; the stream current
    before is current again (torch.cuda.graph's exit skips that); the allocator routes nothing more
    to the graph's pool, released once (torch 2.11 ends neither: the graph is then kept, the
    allocator's hooks point at it); and the retry captures."""
    from burstengine.inference import step as st

    steps, init = [], st.DecodeStep.__init__

    def kept(self, *args, **kwargs):
        init(self, *args, **kwargs)
        steps.append(self)

    monkeypatch.setattr(st.DecodeStep, "__init__", kept)
    gc.run_generate(None, model_dirs["llama"], LENGTHS, 3)  # on CPU op by op: a step with a state loaded
    step = steps[-1]
    step.device = torch.device("cuda", 0)  # its CUDA calls are the fakes'
    fake = gc.FakeCuda(monkeypatch, routing_left)
    with pytest.raises(RuntimeError) as info:
        step.capture()
    err = info.value
    assert str(err).startswith("capturing the decode step in a CUDA graph failed on rank 0: RuntimeError: CUDA error: "
                               "operation failed due to a previous error during capture (generate(graphs='off')"), err
    assert "\n" not in str(err) and err.__cause__ is None and err.__context__ is None
    assert step.graph is None and step.logits is None
    assert fake.current is fake.caller
    assert not fake.routing and fake.released == ([(0, 1)] if routing_left else [])
    assert fake.logits[-1]() is None  # the capture's logits, gone while the error is held
    assert (fake.graphs[-1]() is None) is (not routing_left) and len(st._ABANDONED) == routing_left
    step.capture()  # the retry
    assert step.graph is fake.graphs[-1]() and step.logits is fake.logits[-1]() is not None
    assert fake.current is fake.caller and not fake.routing


def test_decode_step_reads_no_device_value_on_the_host(model_dirs, monkeypatch):
    """What a CUDA graph needs of the step, checked on CPU: every op the step's forward runs, at
    the aten level, for a batch of two lengths (visibility) and a window: none reads a tensor's
    value on the host, no index is a boolean mask (data-dependent shape)."""
    from burstengine.inference import step as st

    ops, bad = set(), []
    monkeypatch.setattr(st.DecodeStep, "forward", decode_cases.watched(st.DecodeStep.forward, ops, bad))
    for arch in ("llama", "mistral", "gemma3"):
        tokens, _ = gc.run_generate(None, model_dirs[arch], (61, 30), 4)
        assert tokens == hf_greedy(model_dirs[arch], (61, 30), 4), arch
    assert {"index_copy", "embedding", "logsumexp"} <= {o.rstrip("_") for o in ops}, sorted(ops)
    assert not bad, sorted(set(bad))
    # an FP8 cache: the step quantizes its K/V rows (amax, the e4m3 cast) and reads the cache's
    # scales (a window and a visibility mask again)
    ops.clear()
    gc.run_generate_logits(None, model_dirs["mistral"], (61, 30), 4, kv_dtype="fp8")
    assert {"index_copy", "amax", "clamp_min", "logsumexp"} <= {o.rstrip("_") for o in ops}, sorted(ops)
    assert not bad, sorted(set(bad))


def test_dynamic_rope_follows_the_length_in_decode(tmp_path, monkeypatch):
    # dynamic NTK scaling past a 16-token context: the decode step keeps RoPE's frequencies in a
    # device buffer (a graph replays it) and recomputes them before each step from the length;
    # its tables are the model's own for that length (the tiny model's tokens hardly depend on
    # RoPE, so the tables are compared too)
    from transformers import AutoModelForCausalLM

    from burstengine.inference import generate, load_model
    from burstengine.inference import step as st
    from burstengine.model.rope import tables_from_inv

    forward, seen = st.DecodeStep.forward, []

    def checked(self):
        qpos = self.qpos.clone()
        want = self.model.model.rope(qpos, torch.float64, seq_len=int(qpos.max()) + 1)
        got = tables_from_inv(qpos, self.inv, self.rope_attn)
        seen.append(all(torch.equal(a, b) for a, b in zip(got, want)))
        return forward(self)

    monkeypatch.setattr(st.DecodeStep, "forward", checked)

    path = gc.save_tiny(tmp_path / "dyn", "llama", seed=1, max_position_embeddings=16,
                        rope_parameters={"rope_type": "dynamic", "factor": 8.0, "rope_theta": 10000.0})
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ps = gc.prompts((97,), 2)
    with torch.no_grad():
        want = hf.generate(torch.tensor(ps), max_new_tokens=NEW, do_sample=False, pad_token_id=0)[0, 97:].tolist()
    model = load_model(path)
    assert model.model.args.rope_scaling.type == "dynamic"
    assert generate(model, ps, NEW).tokens[0] == want
    assert len(seen) == NEW - 1 and all(seen)


def test_graphs_option():
    # "auto" captures on CUDA whatever the number of ranks (the collectives go into the graph)
    from burstengine.inference.step import use_graphs

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert use_graphs("auto", cuda) and use_graphs("on", cuda)
    assert not use_graphs("auto", cpu) and not use_graphs("off", cuda) and not use_graphs("off", cpu)
    with pytest.raises(ValueError, match="graphs='on' needs a CUDA device: the model is on cpu"):
        use_graphs("on", cpu)
    with pytest.raises(ValueError, match="graphs must be one of"):
        use_graphs("yes", cuda)


def test_graphs_on_is_refused_on_every_rank_here(pool, model_dirs):
    msgs = pool.run(gc.raises, model_dirs["llama"], "generate", [[1, 2, 3]], 2, {}, world=2, graphs="on")
    assert all(m is not None and "graphs='on' needs a CUDA device" in m for m in msgs), msgs


def test_sampling_filters_match_transformers():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g, dtype=torch.float64) * 3
    for k, p in ((5, 1.0), (0, 0.7), (10, 0.5), (0, 0.01)):
        s = Sampling(temperature=0.7, top_k=k, top_p=p)
        ref = logits / 0.7
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1:
            ref = TopPLogitsWarper(p)(None, ref)
        assert torch.equal(torch.isinf(filtered_logits(logits, s)), torch.isinf(ref)), (k, p)
    greedy = logits.argmax(-1)
    assert torch.equal(choose(logits, Sampling(), None), greedy)
    assert torch.equal(choose(logits, Sampling(temperature=1.0, top_k=1), Sampling().generator()), greedy)


# --- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompts,new,sampling,match", [
    ([[1, 2], []], 4, {}, "prompt 1 is empty"),
    ([[1, gc.VOCAB]], 4, {}, f"token id {gc.VOCAB}, outside the model's vocabulary"),
    ([[1, 2]], 0, {}, "max_new_tokens must be an int >= 1"),
    ([[1, 2]], 4, dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    ([[1, 2]], 4, dict(temperature=1.0, top_p=0.0), "top_p must be in"),
    ([[1, 2]], 4, dict(top_k=5), "need a temperature > 0"),
    ([[1, 2]], 4, dict(eos=(999,)), "stop token ids must be ints"),
    ([], 4, {}, "no prompts"),
])
def test_bad_inputs_raise_on_every_rank(pool, model_dirs, prompts, new, sampling, match):
    msgs = pool.run(gc.raises, model_dirs["llama"], "generate", prompts, new, sampling, world=2)
    assert all(m is not None and match in m for m in msgs), msgs


def test_transformers_model_is_refused():
    from burstengine.inference import generate, load_model

    with pytest.raises(ValueError, match="impl 'ours'"):
        generate(load_model("tiny", "hf"), [[1, 2, 3]], 2)


# --- the commands -------------------------------------------------------------------------------

@pytest.fixture(scope="session")
def text_model(model_dirs):
    gc.save_tokenizer(model_dirs["llama"])  # the llama directory gets a tokenizer
    return model_dirs["llama"]


def _cli(*argv):
    """``burstengine ARGV`` (in this process: tests/cli_cases.py); exit code, stdout, stderr."""
    return cli_cases.run(argv)


def test_generate_command_spawns_ranks_and_writes_tokens(text_model, tmp_path):
    import json

    import numpy as np

    ps = gc.prompts((997, 613))
    np.save(tmp_path / "p.npy", np.array([np.array(p) for p in ps], dtype=object), allow_pickle=True)
    rc, out, err = _cli("generate", "--model", text_model, "--prompt-tokens", str(tmp_path / "p.npy"),
                        "--max-new-tokens", str(NEW), "--world", "2", "--eos", "none", "--output",
                        str(tmp_path / "o.json"))
    assert rc == 0, err
    rec = json.load(open(tmp_path / "o.json"))
    assert rec["tokens"] == hf_greedy(text_model, LENGTHS, NEW)
    assert len(rec["timings"]["decode_step_s"]) == NEW - 1 and rec["timings"]["prefill_s"] > 0
    assert "[0] " in out and "[1] " in out and "first-token latency" in err
    # text: streamed on rank 0, the same tokens as the API's; --tp off keeps the model whole on
    # both ranks (the --tp auto split is test_generate_command_takes_a_prompt_and_decodes_tensor_parallel's)
    from transformers import AutoTokenizer

    from burstengine.inference import generate, load_model

    text = "Hello world, once upon a time"
    tok = AutoTokenizer.from_pretrained(text_model)
    want = generate(load_model(text_model), [tok(text).input_ids], 6).tokens
    (tmp_path / "q.txt").write_text(text)
    rc, out, err = _cli("generate", "--model", text_model, "--prompt-file", str(tmp_path / "q.txt"),
                        "--max-new-tokens", "6", "--world", "2", "--eos", "none", "--tp", "off", "--output",
                        str(tmp_path / "t.json"))
    assert rc == 0, err
    rec = json.load(open(tmp_path / "t.json"))
    toks = rec["tokens"][0]
    assert [toks] == want and len(toks) == 6 and out.strip() == tok.decode(toks, skip_special_tokens=True).strip()
    assert rec["timings"]["tensor_parallel"] is False and "tensor-parallel over 2 ranks" not in err, (rec["timings"], err)


def test_generate_command_runs_a_gemma3_directory(model_dirs, tmp_path):
    import json

    import numpy as np

    path, lengths = model_dirs["gemma3"], (97, 50)
    np.save(tmp_path / "p.npy", np.array([np.array(p) for p in gc.prompts(lengths)], dtype=object), allow_pickle=True)
    rc, out, err = _cli("generate", "--model", path, "--prompt-tokens", str(tmp_path / "p.npy"), "--max-new-tokens",
                        "5", "--world", "2", "--eos", "none", "--output", str(tmp_path / "o.json"))
    assert rc == 0, err
    assert json.load(open(tmp_path / "o.json"))["tokens"] == hf_greedy(path, lengths, 5)


@pytest.mark.parametrize("argv,match", [
    (["--model", "/nowhere", "--prompt-tokens", "x.npy", "--max-new-tokens", "4"], "neither a preset"),
    (["--model", "tiny", "--prompt-file", "/etc/hostname", "--max-new-tokens", "4"], "needs a tokenizer"),
    (["--model", "tiny", "--prompt-tokens", "/nowhere.npy", "--max-new-tokens", "4"], "does not exist"),
    (["--model", "tiny", "--prompt-tokens", "{npy}", "--max-new-tokens", "0"], "--max-new-tokens must be"),
    (["--model", "tiny", "--prompt-tokens", "{npy}", "--max-new-tokens", "2", "--top-p", "2"], "top_p must be"),
    (["--model", "tiny", "--prompt-tokens", "{npy}", "--max-new-tokens", "2", "--eos", "x"], "--eos must be"),
    (["--model", "tiny", "--prompt-tokens", "{bad}", "--max-new-tokens", "2"], "outside the model's vocabulary"),
    (["--model", "tiny", "--prompt-tokens", "{npy}", "--max-new-tokens", "2", "--graphs", "on"],
     "--graphs on needs a CUDA device"),
    (["--model", "tiny", "--prompt", "hello", "--max-new-tokens", "2"], "--prompt needs a tokenizer"),
    (["--model", "tiny", "--prompt-tokens", "{npy}", "--max-new-tokens", "2", "--chunk", "-1"], "--chunk must be >= 0"),
])
def test_generate_command_rejects_bad_arguments(argv, match, tmp_path, capsys):
    import numpy as np

    from burstengine import cli

    np.save(tmp_path / "p.npy", np.array([1, 2, 3]))
    np.save(tmp_path / "bad.npy", np.array([[1, 2, 99999]]))
    argv = [a.format(npy=tmp_path / "p.npy", bad=tmp_path / "bad.npy") for a in argv]
    assert cli.main(["generate", *argv]) == 2  # before any rank starts
    assert match in capsys.readouterr().err


def test_generate_command_takes_a_prompt_and_decodes_tensor_parallel(text_model, tmp_path):
    """--prompt "text": the same tokens as the API on the tokenized text; on two ranks --tp auto
    splits the tiny model (4 heads, 2 kv heads, ffn 96, vocab 192), each rank loading its slices
    (--tp off, the whole model on each rank, gives the API's tokens for the same text in
    test_generate_command_spawns_ranks_and_writes_tokens: one two-rank command fewer)."""
    import json

    from transformers import AutoTokenizer

    from burstengine.inference import generate, load_model

    text = "Hello world, once upon a time"
    ids = AutoTokenizer.from_pretrained(text_model)(text).input_ids
    want = generate(load_model(text_model), [ids], 6).tokens
    for tp in ("auto",):
        rc, out, err = _cli("generate", "--model", text_model, "--prompt", text, "--max-new-tokens", "6", "--world",
                            "2", "--eos", "none", "--tp", tp, "--quiet", "--output", str(tmp_path / f"{tp}.json"))
        assert rc == 0, err
        rec = json.load(open(tmp_path / f"{tp}.json"))
        assert rec["tokens"] == want and rec["timings"]["tensor_parallel"] is (tp == "auto"), (tp, rec["timings"])
        assert ("tensor-parallel over 2 ranks" in err) is (tp == "auto")


def test_generate_command_decodes_from_an_fp8_cache(text_model, tmp_path, capsys):
    """--kv-cache fp8 reaches generate (its timings say so, and the record): the API's FP8 tokens;
    a word other than model / fp8 is refused before any rank starts."""
    import json

    from burstengine import cli
    from burstengine.inference import generate, load_model

    ids = gc.prompts((61,))
    want = generate(load_model(text_model), ids, 6, kv_dtype="fp8")
    assert want.timings["kv_dtype"] == "fp8"
    np = pytest.importorskip("numpy")
    np.save(tmp_path / "p.npy", np.array(ids[0]))
    rc, out, err = _cli("generate", "--model", text_model, "--prompt-tokens", str(tmp_path / "p.npy"),
                        "--max-new-tokens", "6", "--world", "1", "--eos", "none", "--quiet", "--kv-cache", "fp8",
                        "--output", str(tmp_path / "o.json"))
    assert rc == 0, err
    rec = json.load(open(tmp_path / "o.json"))
    assert rec["tokens"] == want.tokens and rec["kv_cache"] == "fp8" and rec["timings"]["kv_dtype"] == "fp8", rec
    assert "an FP8 KV cache" in err
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--model", "tiny", "--prompt-tokens", str(tmp_path / "p.npy"), "--max-new-tokens", "2",
                  "--kv-cache", "int4"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "argument --kv-cache: invalid choice: 'int4' (choose from 'model', 'fp8')")


def test_generate_command_refuses_a_prompt_longer_than_the_context(tmp_path, capsys):
    """A prompt longer than max_position_embeddings (stretched by the RoPE scaling factor) is
    refused in one line before any rank starts, unless --allow-longer."""
    import numpy as np

    from burstengine import cli

    plain = gc.save_tiny(tmp_path / "plain", "llama", max_position_embeddings=50)
    linear = gc.save_tiny(tmp_path / "linear", "llama", max_position_embeddings=50,
                          rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    np.save(tmp_path / "p60.npy", np.array(gc.prompts((60,))[0]))
    np.save(tmp_path / "p120.npy", np.array(gc.prompts((120,))[0]))
    base = ["generate", "--max-new-tokens", "2", "--world", "1", "--quiet"]
    assert cli.main(base + ["--model", plain, "--prompt-tokens", str(tmp_path / "p60.npy")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("prompt 0 has 60 tokens, more than the model's context of 50 (its "
                            "max_position_embeddings); --allow-longer runs it anyway"), err
    assert cli.main(base + ["--model", linear, "--prompt-tokens", str(tmp_path / "p120.npy")]) == 2
    assert "more than the model's context of 100 (max_position_embeddings 50 with linear RoPE scaling x2)" in \
        capsys.readouterr().err
    assert cli.main(base + ["--model", linear, "--prompt-tokens", str(tmp_path / "p60.npy")]) == 0  # within x2
    assert cli.main(base + ["--model", plain, "--prompt-tokens", str(tmp_path / "p60.npy"), "--allow-longer"]) == 0


def test_model_context_after_rope_scaling():
    from burstengine.model import ModelArgs, RopeScaling

    assert ModelArgs().context == 0  # unknown: no limit
    assert ModelArgs(max_position_embeddings=4096).context == 4096
    # Llama 3.1: max_position_embeddings is already the stretched context (8192 x 8 < 131072)
    l31 = ModelArgs(max_position_embeddings=131072, rope_scaling=RopeScaling(
        type="llama3", factor=8.0, original_max_position_embeddings=8192))
    assert l31.context == 131072
    # yarn / linear with max_position_embeddings the original length: stretched by the factor
    assert ModelArgs(max_position_embeddings=32768, rope_scaling=RopeScaling(type="yarn", factor=4.0)).context == 131072
    assert ModelArgs(max_position_embeddings=2048, rope_scaling=RopeScaling(type="linear", factor=2.0)).context == 4096


def test_needle_eval_writes_a_record_and_a_heatmap(text_model, tmp_path):
    import json

    rc, out, err = _cli("eval", "needle", "--model", text_model, "--lengths", "200,300", "--depths", "0,0.5,1",
                        "--world", "2", "--out", str(tmp_path))
    assert rc == 0, err
    rec = json.load(open(tmp_path / "needle.json"))
    assert rec["commit"] and rec["tokenizer"] and len(rec["cells"]) == 6 and len(rec["answers"]) == 6
    assert all(0.0 <= c["accuracy"] <= 1.0 for c in rec["cells"])
    assert (tmp_path / "needle.png").stat().st_size > 1000 and "mean accuracy" in out
    rc, _, err = _cli("eval", "needle", "--model", text_model, "--lengths", "4Q", "--world", "2")
    assert rc == 2 and "not a length" in err


def test_needle_cases_and_scoring(text_model):
    from transformers import AutoTokenizer

    from burstengine.inference import needle

    tok = AutoTokenizer.from_pretrained(text_model)
    assert needle.parse_lengths("4K,1M,300") == [4096, 1 << 20, 300]
    for depth in (0.0, 0.5, 1.0):
        c = needle.text_case(tok, 300, depth, 0, 0)
        text = tok.decode(c.ids)
        assert len(c.ids) == 300 and text.count(c.answer) == 2 and text.rstrip().endswith("The pass key is")
        at = text.index(c.answer) / len(text)
        assert abs(at - depth) < 0.15, (depth, at)
        answer = tok(f" {c.answer}. Remember", add_special_tokens=False).input_ids
        assert needle.correct(c, answer, tok)[0]
        assert not needle.correct(c, tok(" 12", add_special_tokens=False).input_ids, tok)[0]
    c = needle.token_case(gc.VOCAB, 100, 0.5, 0, 0)
    # 88 filler ids: the key at 44 (the middle), the value after it, the key again at the end
    assert len(c.ids) == 100 and c.ids[-4:] == c.ids[44:48] and c.ids[48:52] == c.answer
    assert len(set(c.ids[-4:])) > 1
    assert needle.correct(c, list(c.answer) + [7], None)[0] and not needle.correct(c, [0, 0, 0, 0], None)[0]


def test_decode_bench_with_an_fp8_cache_counts_its_bytes(tmp_path):
    """bench decode --kv-cache fp8: the rows say so, and the bound counts a byte a cached value
    and a float32 scale a row (the tiny preset: 2 layers, 2 kv heads of 32, float32 on CPU)."""
    import json

    for kv in ("model", "fp8"):
        rc, _, err = _cli("bench", "decode", "--model", "tiny", "--seqs", "128", "--batches", "1", "--tokens", "2",
                          "--warmup", "1", "--world", "1", "--out-dir", str(tmp_path), "--name", kv, "--kv-cache", kv)
        assert rc == 0, err
    rows = {kv: json.load(open(tmp_path / f"{kv}.json"))["rows"][0] for kv in ("model", "fp8")}
    assert rows["fp8"]["kv_cache"] == "fp8" and rows["model"]["kv_cache"] == "model"
    tokens = 128 + 1 + 2 // 2  # the prompt, the warm-up step, half the timed ones: what step_bytes counts
    per_row = 32 * 4 - (32 + 4)
    assert rows["model"]["step_bytes"] - rows["fp8"]["step_bytes"] == 2 * 2 * 2 * per_row * tokens
    rc, _, err = _cli("bench", "decode", "--model", "tiny", "--kv-cache", "int4", "--world", "1")
    assert rc == 2 and "--kv-cache" in err


def test_decode_bench_runs_on_cpu(tmp_path):
    import json

    rc, out, err = _cli("bench", "decode", "--model", "tiny", "--seqs", "128,200", "--batches", "1,2", "--batch-max",
                        "128", "--tokens", "3", "--warmup", "1", "--world", "1", "--out-dir", str(tmp_path),
                        "--name", "d", "--check", "--profile", "2")
    assert rc == 0, err
    rec = json.load(open(tmp_path / "d.json"))
    # --profile: the last row's case again, its decode steps found by their profiler range (no GPU
    # kernels on a CPU: the kinds stay empty)
    prof = rec["profile"]
    assert (prof["S"], prof["batch"], prof["steps"]) == (200, 1, 2) and len(prof["per_step"]) == 2
    assert all(p["wall_s"] > 0 for p in prof["per_step"]) and prof["kinds_s"] == {} and prof["window"] == "host"
    assert rec["commit"] and rec["env"]["device"] == "cpu" and rec["copy_bandwidth_Bps"] > 0
    assert rec["threads"] == 1  # the default: a decode step's small ops slow down on a shared machine's pool
    # the check ran what a CPU has (the math path; the float32 step's tokens vs float64's), and
    # no CUDA graph here: no eager-vs-graph columns
    assert rec["check"]["ok"] and len(rec["check"]["attention"]) == 46 and "check PASSED" in out
    fp8 = [r for r in rec["check"]["attention"] if r["cache"] == "fp8"]
    assert len(fp8) == 10 and sum(r["dtype"] == "float16" and r["v_magnitude"] == 1e-3 for r in fp8) == 2
    assert [list(r["equal"]) for r in rec["check"]["tokens"]] == [["float32_eager == float64"]] * 2
    assert rec["graphs"] is False and not any("eager_decode_s_per_token" in r for r in rec["rows"])
    assert [(r["S"], r["batch"]) for r in rec["rows"]] == [(128, 1), (128, 2), (200, 1)]
    for r in rec["rows"]:
        assert len(r["decode_step_s"]) == 4 and r["bound_s"] > 0 and r["peak_bytes"] > 0
        assert ("sdpa_first_token_s" in r) == (r["batch"] == 1)
        # weights (all but the embedding) + the cache, in bytes
        assert r["step_bytes"] > 4 * (2 * 128 * 128 + 2 * 128 * 64) * 2
    rc, _, err = _cli("bench", "decode", "--model", "tiny", "--graphs", "on", "--world", "1")
    assert rc == 2 and "--graphs on needs a CUDA device" in err
    rc, _, err = _cli("bench", "decode", "--model", "tiny", "--profile", "-1", "--world", "1")
    assert rc == 2 and "--profile must be >= 0" in err


def test_decode_profile_counts_kernels_not_the_gpu_side_ranges_of_annotations(monkeypatch):
    # a record_function's GPU-side range (nccl:all_reduce around a collective launched op by op,
    # the step's own range) is a user annotation spanning kernels listed already: counted as a
    # kernel, it doubled the collectives' time (as in the training profiles' nccl:coalesced rows)
    import types

    from burstengine.bench.peers import decode
    from burstengine.inference.generate import STEP_LABEL

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def ev(name, dev, a, b, note=False):
        return types.SimpleNamespace(name=name, device_type=dev, is_user_annotation=note,
                                     time_range=types.SimpleNamespace(start=a, end=b))

    events = [ev(STEP_LABEL, cpu, 0, 5, True), ev(STEP_LABEL, cuda, 10, 30, True),
              ev("gemv_kernel", cuda, 10, 16), ev("nccl:all_reduce", cuda, 16, 30, True),
              ev("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", cuda, 16, 30)]

    class Prof:
        def __init__(self, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def step(self):
            pass

        def events(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", Prof)
    monkeypatch.setattr(decode, "generate", lambda *a, **k: None)
    args = types.SimpleNamespace(warmup=0, profile=1, chunk=None, graphs="off", kv_cache="model")
    prof = decode.step_profile(None, torch.zeros(1, 8, dtype=torch.int64), args, True, torch.device("cuda"))
    assert prof["window"] == "gpu" and prof["steps"] == 1, prof
    assert prof["kernels_per_step"] == 2 and prof["wall_s"] == pytest.approx(20e-6), prof
    assert prof["kinds_s"] == pytest.approx({"collective": 14e-6, "matrix products": 6e-6}), prof
    assert [k["name"] for k in prof["top_kernels"]] == ["ncclDevKernel_AllReduce_Sum_bf16_RING_LL", "gemv_kernel"]


def test_decode_bench_on_two_ranks_records_tensor_parallel_rows(tmp_path):
    """Two gloo ranks: the check runs over them (whole and tensor-parallel steps vs float64), and
    each (prompt, batch) gets a tensor-parallel row beside a whole-model one, whose bound counts
    this rank's slice of the weights (the tiny preset: every projection and the head halve); with
    --sliced the ranks load only their slices."""
    import json

    rc, out, err = _cli("bench", "decode", "--model", "tiny", "--seqs", "128", "--batches", "1,2", "--tokens", "2",
                        "--warmup", "1", "--world", "2", "--out-dir", str(tmp_path), "--name", "d", "--check")
    assert rc == 0, err
    rec = json.load(open(tmp_path / "d.json"))
    assert rec["check"]["ok"] and rec["world"] == 2 and rec["sliced"] is False
    assert [list(r["equal"]) for r in rec["check"]["tokens"]] == [["float32_eager == float64",
                                                                  "float32_tp_eager == float64"]] * 2
    rows = rec["rows"]
    assert [(r["S"], r["batch"], r["tensor_parallel"]) for r in rows] == [(128, 1, True), (128, 1, False),
                                                                         (128, 2, True), (128, 2, False)]
    from burstengine.model import PRESETS

    a = PRESETS["tiny"]
    sliced = a.n_layers * (2 * a.dim * a.n_heads * a.head_dim + 2 * a.dim * a.n_kv_heads * a.head_dim
                           + 3 * a.dim * a.ffn_dim) + a.vocab_size * a.dim
    for tp, whole in ((rows[0], rows[1]), (rows[2], rows[3])):
        assert whole["step_bytes"] - tp["step_bytes"] == sliced * 4 // 2  # float32, half of it on each rank
    rc, out, err = _cli("bench", "decode", "--model", "tiny", "--seqs", "128", "--batches", "1", "--tokens", "2",
                        "--warmup", "1", "--world", "2", "--out-dir", str(tmp_path), "--name", "s", "--sliced")
    assert rc == 0, err
    rec = json.load(open(tmp_path / "s.json"))
    assert rec["sliced"] is True and [r["tensor_parallel"] for r in rec["rows"]] == [True]
    assert rec["rows"][0]["step_bytes"] == rows[0]["step_bytes"]
    rc, _, err = _cli("bench", "decode", "--model", "tiny", "--sliced", "--tp", "off")
    assert rc == 2 and "--sliced holds only tensor-parallel slices" in err


def test_decode_check_compares_logits_only_while_the_texts_agree():
    """bf16 beside float64 may choose another token at a near tie (seen on an H200); the logits
    after that score different texts and must not fail the check, those before must."""
    from burstengine.bench.checks.decode_check import _rel_while_same

    base = torch.randn(2, 5, 7, dtype=torch.float64)
    ref_tokens = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]]
    other = base.clone()
    other[0, 2:] += 100.0  # row 0's text parts at token 2: decode entries 2.. see another context
    tokens = [[1, 2, 9, 9, 9, 9], [1, 2, 3, 4, 5, 6]]
    err, n = _rel_while_same(other, base, tokens, ref_tokens)
    assert err == 0.0 and n == 2 + 5
    other[0, 1] += 1.0  # before the parting: counted
    err, n = _rel_while_same(other, base, tokens, ref_tokens)
    assert err == pytest.approx(1.0 / float(base.abs().max())) and n == 7
    assert _rel_while_same(other, base, [[0] * 6] * 2, ref_tokens) == (0.0, 0)  # parted at the first token


def test_decode_check_compares_the_fp8_cache_graph_with_op_by_op(monkeypatch):
    """bench decode --check's graph rows (CUDA) include an FP8 cache under bf16: its graph's tokens
    and logits against op by op.  Run on CPU with the graph runs sent op by op (what a graph
    replays): the rows are there, and pass."""
    from burstengine.bench.checks import decode_check as dc

    real, calls = dc.generate, []

    def generate(model, prompts, new, **kw):
        calls.append((kw.get("graphs"), kw.get("kv_dtype")))
        return real(model, prompts, new, **dict(kw, graphs="off"))

    monkeypatch.setattr(dc, "generate", generate)
    rows = dc.check_tokens("cpu", (61, 37), 3, graphs=True)
    for r in rows:
        assert r["equal"]["fp8kv_graph == fp8kv_eager"] and r["logits_err"]["fp8kv_graph vs fp8kv_eager"] == 0, r
        assert r["ok"], r
    assert calls.count(("on", "fp8")) == calls.count(("off", "fp8")) == len(rows) == 2


def test_an_fp8_cache_on_a_gpu_without_fp8_is_one_line(monkeypatch):
    """An FP8 cache on a GPU before compute capability 8.9 (an A100) is refused by name, not left
    to fail inside a compiled kernel; Hopper passes; CPU (the math path) always does."""
    from burstengine.inference import kvcache

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    for cap, refused in (((8, 0), True), ((8, 9), False), ((9, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, cap=cap: cap)
        msg = kvcache.kv_dtype_error("fp8", "cuda:0")
        assert (msg is not None) is refused, (cap, msg)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert kvcache.kv_dtype_error("fp8", "cuda:0") == (
        "kv_dtype 'fp8' needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
        "NVIDIA A100-SXM4-80GB is 8.0")
    assert kvcache.kv_dtype_error(None, "cuda:0") is None and kvcache.kv_dtype_error("fp8", "cpu") is None


def test_shard_attention_packs_out_and_lse_for_the_merge():
    # the math path returns out and lse as views of one (B, H, D + 1) buffer, as the Triton kernel
    # does (tests/kernels/test_decode_kernel.py), so the merge's all-gather sends it without a copy;
    # views of anything else are not taken for it (the merge then packs them)
    from burstengine.inference.kvcache import packed
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 4, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g), torch.randn(2, 2, 5, 8, generator=g)
    out, lse = shard_attention(q, k, v, 0.3, valid=torch.tensor([5, 2]))
    base = packed(out, lse)
    assert base is not None and base.shape == (2, 4, 9)
    assert torch.equal(base[..., :8], out) and torch.equal(base[..., 8], lse)
    assert packed(out.clone(), lse) is None and packed(out, lse.clone()) is None
    assert packed(base[:, :2, :8], base[:, :2, 8]) is None  # a slice of the heads: not the whole buffer
