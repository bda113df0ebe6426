"""Phi-3 (burstengine/model/families/phi3.py) against transformers' Phi3ForCausalLM, on tiny random
checkpoints saved by transformers: config.json both ways (LongRoPE, the sliding window, what is
refused), weights in and out bitwise through the fused tensors, float32 logits and prefill K/V at
CP 1 and 2 in LongRoPE's short and long regimes, the first training loss in the short regime (the
long one: tests/train/test_finetune.py), generation in the short regime and across the switch, and the
four commands on a Phi-3 directory.  Transformers' generate, the long regime and more CP degrees
are in tests/inference/test_generate.py's parametrisations."""
import json
import re

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import finetune_cases as fc  # noqa: E402
import generate_cases as gc  # noqa: E402
import prefill_cases  # noqa: E402
from burstengine.model import hf_dir  # noqa: E402
from burstengine.model.rope import inv_freq  # noqa: E402
from hf_cases import VOCAB  # noqa: E402

ORIGINAL = 16  # LongRoPE switches to its long factors past 16 tokens here
TOL = 1e-5


def save(path, seed=0, large_embeddings=True, **overrides) -> str:
    """A tiny Phi-3 with LongRoPE over a 64-token context from a 16-token original one, random
    norms; embeddings and LM head N(0, 1) (tests/generate_cases.py: greedy choices far from ties),
    or, without ``large_embeddings``, of transformers' initial scale, so that attention, and with
    it RoPE, moves the logits well above rounding."""
    kw = dict(vocab_size=VOCAB, max_position_embeddings=64, original_max_position_embeddings=ORIGINAL)
    if large_embeddings:
        return gc.save_tiny(path, "phi3", seed, **{**kw, **overrides})
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(gc.tiny_config("phi3", **{**kw, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory):
    return save(tmp_path_factory.mktemp("phi3") / "phi3", seed=2)


def _hf(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()


def _hf_config(cfg: dict):
    from transformers import Phi3Config

    return Phi3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})


# --- config.json --------------------------------------------------------------------------------

def test_phi3_mini_128k_config_both_ways():
    """CONFIGS' Phi-3-mini-128k reads as transformers' Phi3Config has it (LongRoPE's frequencies
    and attention factor on both sides of the switch; its 262144-token window, past the 131072
    context, as none) and writes back with the keys the checkpoint has."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = hf_dir.CONFIGS["phi-3-mini-128k"]
    a = hf_dir.args_from_hf_config(cfg)
    s = a.rope_scaling
    assert (a.arch, a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.ffn_dim, a.vocab_size, a.head_dim, a.norm_eps,
            a.tie_embeddings, a.window) == ("phi3", 3072, 32, 32, 32, 8192, 32064, 96, 1e-5, False, 0)
    assert (s.type, s.factor, s.original_max_position_embeddings, s.attention_factor) == ("longrope", 32.0, 4096, 0)
    assert len(s.short_factor) == len(s.long_factor) == 48 and s.short_factor != s.long_factor
    hf = _hf_config(cfg)
    for seq in (4096, 4097, 131072):
        theirs, their_attn = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=seq)
        ours, attn = inv_freq(a.head_dim, a.rope_theta, s, a.max_position_embeddings, seq)
        assert torch.allclose(ours, theirs.double(), rtol=1e-6, atol=0), seq
        assert attn == pytest.approx(their_attn, rel=1e-12) and attn > 1.0
    short, _ = inv_freq(a.head_dim, a.rope_theta, s, a.max_position_embeddings, 4096)
    assert not torch.allclose(short, inv_freq(a.head_dim, a.rope_theta, s, a.max_position_embeddings, 4097)[0])
    for seq_len in (0, 8192, 262144):  # trained at lengths the window does not reach
        back = hf_dir.hf_config_from_args(a, seq_len=seq_len, base=cfg)
        assert {k: back[k] for k in cfg if k != "rope_scaling"} == {k: v for k, v in cfg.items() if k != "rope_scaling"}
        r = back["rope_scaling"]
        assert (r["rope_type"], r["short_factor"], r["long_factor"], r["original_max_position_embeddings"]) == (
            "longrope", cfg["rope_scaling"]["short_factor"], cfg["rope_scaling"]["long_factor"], 4096)
        assert "factor" not in r and "attention_factor" not in r  # transformers derives them from the context
        assert hf_dir.args_from_hf_config(back) == a
    # a model run past the window: transformers would window such a sequence, ours did not
    assert hf_dir.hf_config_from_args(a, seq_len=262145, base=cfg)["sliding_window"] is None


def test_random_stand_in_of_phi3_mini_128k(tmp_path):
    """write_random_hf_dir makes a Phi-3-mini-128k stand-in (here narrowed to one layer of the
    same head width and factors) that transformers loads with our logits."""
    cfg = dict(hf_dir.CONFIGS["phi-3-mini-128k"], hidden_size=192, num_attention_heads=2, num_key_value_heads=2,
               intermediate_size=64, num_hidden_layers=1, vocab_size=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    hf_dir.write_random_hf_dir(str(tmp_path), cfg, dtype="float32")
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = _hf(str(tmp_path))(input_ids=ids).logits
        ours = hf_dir.load_hf_model(str(tmp_path))
        got = ours.logits(ours(ids, torch.arange(24)))
    assert ((got - ref).abs().max() / ref.abs().max()).item() < TOL


def test_windows_and_original_context_as_transformers_reads_them():
    tiny = dict(architectures=["Phi3ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                num_attention_heads=4, vocab_size=32, max_position_embeddings=4096)
    # Phi-3-mini-4k: a window inside the context is Mistral's window; one at the context is none
    a = hf_dir.args_from_hf_config(dict(tiny, sliding_window=2047))
    assert a.window == 2047 and a.rope_scaling.type == "none"
    assert hf_dir.hf_config_from_args(a, seq_len=0)["sliding_window"] == 2047
    assert hf_dir.args_from_hf_config(dict(tiny, sliding_window=4095)).window == 4095
    assert hf_dir.args_from_hf_config(dict(tiny, sliding_window=4096)).window == 0
    # transformers' Phi3Config lets the top-level original_max_position_embeddings (default 4096)
    # win over the one inside rope_scaling
    rope = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
            "original_max_position_embeddings": 512}
    for top in ({"original_max_position_embeddings": 1024}, {}):
        cfg = dict(tiny, rope_scaling=rope, **top)
        want = _hf_config(cfg).rope_parameters["original_max_position_embeddings"]
        assert hf_dir.args_from_hf_config(cfg).rope_scaling.original_max_position_embeddings == want == \
            top.get("original_max_position_embeddings", 4096)
    # "su", LongRoPE's old name; an explicit factor and attention factor are kept; dropout is not read
    cfg = dict(tiny, rope_scaling=dict(rope, type="su", factor=3.0, attention_factor=1.25), resid_pdrop=0.1)
    s = hf_dir.args_from_hf_config(cfg).rope_scaling
    assert (s.type, s.factor, s.attention_factor) == ("longrope", 3.0, 1.25)
    assert inv_freq(16, 10000.0, s, 4096, 10)[1] == 1.25


@pytest.mark.parametrize("change,match", [
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor != 1 is not supported"),
    ({"rope_scaling": {"rope_type": "longrope", "partial_rotary_factor": 0.75, "short_factor": [1.0] * 6,
                       "long_factor": [1.0] * 6}}, "partial_rotary_factor != 1 is not supported"),
    ({"attention_bias": True}, "attention_bias=true"),
    ({"mlp_bias": True}, "mlp_bias=true"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 7, "long_factor": [1.0] * 8}},
     "longrope rope scaling needs model.rope_scaling.short_factor: 8 numbers > 0 (head dim / 2), got 7 value(s)"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 7 + [-1.0]}},
     "model.rope_scaling.long_factor: 8 numbers > 0"),
])
def test_what_is_refused(change, match):
    cfg = dict(architectures=["Phi3ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=1,
               num_attention_heads=4, vocab_size=32, max_position_embeddings=64, **change)
    with pytest.raises(ValueError, match=re.escape(match)) as e:
        hf_dir.args_from_hf_config(cfg, "phi/config.json")
    assert str(e.value).startswith("phi/config.json: ") and "\n" not in str(e.value)


def test_train_config_carries_the_factors(phi3_dir, tmp_path):
    """init= gives the model LongRoPE's factor lists; a TOML [model.rope_scaling] table takes them
    as arrays and --print-config's TOML reads back to the same config; --set takes a list as
    comma-separated numbers."""
    from burstengine.train.config import load, to_toml

    cfg = load("tiny", [f"init={phi3_dir}"])
    s = cfg.model.rope_scaling
    assert (cfg.model.arch, s.type, s.original_max_position_embeddings, s.long_factor) == (
        "phi3", "longrope", ORIGINAL, gc.longrope()["long_factor"])
    path = tmp_path / "longrope.toml"  # the tiny preset's head dim is 32: 16 factors
    path.write_text('[model]\nmax_position_embeddings = 64\n[model.rope_scaling]\ntype = "longrope"\n'
                    'original_max_position_embeddings = 16\n'
                    f'short_factor = [{", ".join(["1"] * 16)}]\nlong_factor = [{", ".join(["2.5"] * 16)}]\n')
    cfg = load(str(path))
    assert cfg.model.rope_scaling.long_factor == [2.5] * 16
    path.write_text(to_toml(cfg))
    assert "long_factor = [2.5, 2.5," in path.read_text() and load(str(path)) == cfg
    cfg = load("tiny", [f"init={phi3_dir}", "model.rope_scaling.long_factor=" + ",".join(["3"] * 8)])
    assert cfg.model.rope_scaling.long_factor == [3.0] * 8
    with pytest.raises(ValueError, match="model.rope_scaling.long_factor: 8 numbers > 0 .* got 2 value"):
        load("tiny", [f"init={phi3_dir}", "model.rope_scaling.long_factor=3,4"])
    with pytest.raises(ValueError, match="expects numbers separated by commas, got 'x'"):
        load("tiny", [f"init={phi3_dir}", "model.rope_scaling.long_factor=x"])


# --- weights and logits ---------------------------------------------------------------------------

def test_weights_in_and_out_bitwise(phi3_dir):
    """qkv_proj and gate_up_proj split into our projections and joined again give the checkpoint's
    tensors, bit for bit (the loader's FSDP2-sharded reads: tests/model/test_families.py)."""
    from safetensors.torch import load_file

    src = load_file(f"{phi3_dir}/model.safetensors")
    model = hf_dir.load_hf_model(phi3_dir)
    params = dict(model.named_parameters())
    a = model.args
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    qkv = src["model.layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(params["layers.1.attention.wk.weight"], qkv[q:q + kv])
    assert torch.equal(params["layers.1.feed_forward.w3.weight"], src["model.layers.1.mlp.gate_up_proj.weight"][a.ffn_dim:])
    out = hf_dir.hf_tensors(a)
    assert sorted(out.parts) == sorted(src)
    for name, t in src.items():
        assert torch.equal(out.join(name, lambda n: params[n].detach()), t), name


@pytest.fixture(scope="module")
def small_embeddings_dir(tmp_path_factory):
    return save(tmp_path_factory.mktemp("phi3") / "small", seed=3, large_embeddings=False)


@pytest.mark.parametrize("length", [12, ORIGINAL, ORIGINAL + 1, 40])
def test_logits_equal_transformers_in_both_regimes(small_embeddings_dir, length):
    """float32 logits at lengths up to the original context (short factors) and past it (long
    factors); the other regime's factors give other logits, so the switch is where transformers'
    is."""
    path = small_embeddings_dir
    ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        ref = _hf(path)(input_ids=ids).logits
        ours = hf_dir.load_hf_model(path)
        got = ours.logits(ours(ids, torch.arange(length)))
        s = ours.args.rope_scaling
        s.short_factor, s.long_factor = s.long_factor, s.short_factor
        swapped = ours.logits(ours(ids, torch.arange(length)))
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    print(f"phi3 logits, {length} tokens ({'long' if length > ORIGINAL else 'short'} factors): max |ours - "
          f"transformers| = {(got - ref).abs().max().item():.3e}, relative {err:.3e}")
    assert err < TOL, err
    assert ((swapped - ref).abs().max() / ref.abs().max()).item() > 50 * TOL


@pytest.mark.parametrize("world,seq", [(1, 12), (1, 40), (2, 12), (2, 40)])
def test_prefill_logits_and_kv_equal_transformers_cp12(pool, phi3_dir, world, seq):
    """Prefill's next-token logits and every layer's K (after RoPE: the regime's factors and the
    attention factor) and V against transformers' eager model, at CP 1 and 2, in both regimes:
    the length that switches them is the global one on every rank."""
    for rank, (errs, layers, ok_pos, _) in enumerate(pool.run(prefill_cases.prefill_vs_hf, phi3_dir, "zigzag",
                                                              "ours", 4, seq_per_rank=seq // world, world=world)):
        worst = max(errs, key=errs.get)
        assert errs[worst] <= 1e-4, (rank, worst, errs)
        assert layers == 2 and ok_pos


# --- training --------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [1, 2])
def test_first_loss_in_the_short_regime(pool, tmp_path, world):
    """The trainer's first loss from init= equals transformers' on a batch within the original
    context (the long regime, CP 1/2/4: tests/train/test_finetune.py)."""
    path = fc.save_tiny(tmp_path / "phi3", "phi3", seed=3)
    data = fc.token_file(tmp_path / "tokens.bin")
    loss, ref, gmax = pool.run(fc.first_loss, path, data, 16, ["layout=zigzag"], world=world)[0]
    assert abs(loss - ref) <= 2e-6 * ref, (loss, ref)
    assert gmax > 0


# --- generation ------------------------------------------------------------------------------------

def _hf_generate(path, prompt, new):
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = _hf(path).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("world", [1, 2])
def test_greedy_equals_transformers_in_the_short_regime(pool, tmp_path_factory, world):
    path = save(tmp_path_factory.mktemp("short") / "phi3", seed=4, original_max_position_embeddings=128,
                max_position_embeddings=512)
    lengths = (61, 30)  # + 8 new tokens: within the original context
    want = [_hf_generate(path, p, 8) for p in gc.prompts(lengths, 1)]
    for rank, (tokens, _) in enumerate(pool.run(gc.run_generate, path, lengths, 8, 1, world=world)):
        assert tokens == want, (world, rank)


def _hf_steps(path, prompt, tokens):
    """transformers' float64 logits of a prompt and then of each token: fed alone with its cache,
    as its model runs a decode step (LongRoPE switches on the step's position + 1, the keys cached
    before the switch keep the short factors); and with each prefix run afresh, which is what its
    generate for Phi-3 gives (it recomputes the cache at the step that crosses)."""
    from transformers import DynamicCache

    hf = _hf(path, torch.float64)
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), cache=DynamicCache(config=hf.config), use_cache=True)
        cached = [out.logits[0, -1]]
        for i, t in enumerate(tokens[:-1]):
            out = hf(torch.tensor([[t]]), position_ids=torch.tensor([[len(prompt) + i]]), cache=out.cache,
                     use_cache=True)
            cached.append(out.logits[0, -1])
        seq = prompt + tokens[:-1]
        afresh = [hf(torch.tensor([seq[:n]]), use_cache=False).logits[0, -1] for n in range(len(prompt), len(seq) + 1)]
    return torch.stack(cached), torch.stack(afresh)


@pytest.mark.parametrize("world", [1, 2])
def test_generation_across_the_switch(pool, small_embeddings_dir, world):
    """A prompt of 12 tokens and 12 new ones cross the 16-token original context: every step's
    logits (the first from prefill) equal transformers' model stepped with its cache, before and
    after the switch.  transformers' generate for Phi-3 instead recomputes the whole cache with
    the long factors at the step that crosses (its prepare_inputs_for_generation), which moves the
    logits after the switch well beyond rounding, though not the greedy tokens here
    (docs/training.md)."""
    res = pool.run(gc.run_generate_logits, small_embeddings_dir, (12,), 12, 6, prefill=True, world=world)
    tokens, logits = res[0]
    assert len(tokens[0]) == 12 and logits.shape == (1, 12, VOCAB)
    cached, afresh = _hf_steps(small_embeddings_dir, gc.prompts((12,), 6)[0], tokens[0])
    err = (logits[0].double() - cached).abs().amax(-1) / cached.abs().amax(-1)
    other = (logits[0].double() - afresh).abs().amax(-1) / afresh.abs().amax(-1)
    print(f"phi3 generation across the switch (world {world}): max relative step error {err.max().item():.3e}; "
          f"against the whole sequence run afresh (transformers' generate): {other[:5].max().item():.3e} before "
          f"the switch, {other[5:].max().item():.3e} after")
    assert err.max() < TOL, err
    assert cached.argmax(-1).tolist() == tokens[0]
    assert other[:5].max() < TOL and other[5:].min() > 10 * TOL  # steps 0-4 see <= 16 tokens
    # no greedy choice here is near a tie, so the tokens are still those of transformers' generate
    assert tokens[0] == _hf_generate(small_embeddings_dir, gc.prompts((12,), 6)[0], 12)


# --- the commands ------------------------------------------------------------------------------------

def test_commands_accept_a_phi3_directory(pool, phi3_dir, tmp_path):
    """`burstengine train` with init=DIR (one step at lr 0), `export`, `prefill --model` and
    `generate --model` on a Phi-3 directory, through the commands' entry point on the pool's four
    ranks (their group is the job's, as torchrun's would be)."""
    import numpy as np
    from safetensors.torch import load_file

    from burstengine import cli

    run, out = tmp_path / "run", tmp_path / "out"
    sets = fc.overrides(phi3_dir, fc.token_file(tmp_path / "tokens.bin"), 40,
                        ["steps=1", "lr=0", "save_every=1", "warmup_steps=0", f"out_dir={run}"])
    train = ["train", *(a for s in sets for a in ("--set", s))]
    assert pool.run(prefill_cases.run_cli, train, world=4) == [0] * 4
    assert cli.main(["export", str(run), str(out)]) == 0
    a, b = load_file(f"{phi3_dir}/model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Phi3ForCausalLM"] and cfg["original_max_position_embeddings"] == ORIGINAL
    assert cfg["rope_scaling"]["rope_type"] == "longrope" and cfg["max_position_embeddings"] == 64

    logits = tmp_path / "logits.pt"
    argv = ["prefill", "--model", str(out), "--seq", "40", "--layout", "zigzag", "--warmup", "0",
            "--save-logits", str(logits)]
    assert pool.run(prefill_cases.run_cli, argv, world=4) == [0] * 4
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))  # the command's prompt
    with torch.no_grad():
        want = _hf(str(out))(input_ids=ids).logits[:, -1]
    assert (torch.load(logits) - want).abs().max() <= 1e-4 * want.abs().max()

    prompt = gc.prompts((30,), 7)[0]
    np.save(tmp_path / "p.npy", np.array([prompt]))
    argv = ["generate", "--model", str(out), "--prompt-tokens", str(tmp_path / "p.npy"), "--max-new-tokens", "4",
            "--eos", "none", "--output", str(tmp_path / "g.json")]
    assert pool.run(gc.run_cli, argv, world=4) == [0] * 4
    assert json.loads((tmp_path / "g.json").read_text())["tokens"] == [_hf_generate(str(out), prompt, 4)]
