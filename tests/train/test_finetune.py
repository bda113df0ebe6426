"""Fine-tuning pretrained models: tiny random Llama (plain; llama3 scaling + tied embeddings),
Qwen2, Qwen3, Mistral, Gemma 3 and Phi-3 (fused tensors, LongRoPE in its long regime) made and
saved by transformers are loaded with ``init`` (sharded over
the gloo ranks), give transformers' loss at CP 1/2/4, come back bitwise from init -> 1 step at
lr 0 -> export, and the export loads in transformers with the engine's loss and logits.  Rope
scaling equals transformers' for every type; packed documents give the loss of the documents
run alone."""
import json
import os

import pytest
import torch

pytest.importorskip("transformers")

import finetune_cases as fc  # noqa: E402
from burstengine.model import RopeScaling  # noqa: E402
from burstengine.model.rope import inv_freq, rope_tables  # noqa: E402

TOL = 2e-6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained")
    return {arch: fc.save_tiny(root / arch, arch, seed=i) for i, arch in enumerate(fc.ARCHS)}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    return fc.token_file(tmp_path_factory.mktemp("data") / "tokens.bin")


# --- rope ---------------------------------------------------------------------------------------

ROPES = {
    "none": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    "yarn-betas-af": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16.0,
                      "beta_slow": 2.0, "attention_factor": 1.3},
    "yarn-mscale": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64, "mscale": 0.9,
                    "mscale_all_dim": 0.5, "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 64,
                 "short_factor": [1.0 + 0.03 * i for i in range(32)], "long_factor": [1.2 ** i for i in range(32)]},
}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_rope_matches_transformers(kind):
    """Our float64 frequencies / attention factor equal transformers' ROPE_INIT_FUNCTIONS (float32),
    and our cos/sin its rotary embedding's on the same positions, beyond the original context
    (dynamic, longrope: at a length the model recomputes for).  Llama's config and rotary
    embedding, Phi-3's for longrope (the family that reads it)."""
    from transformers import LlamaConfig, Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    from burstengine.model.hf_dir import args_from_hf_config

    config, rotary, extra = ((Phi3Config, Phi3RotaryEmbedding, {"original_max_position_embeddings": 64})
                             if kind == "longrope" else (LlamaConfig, LlamaRotaryEmbedding, {}))
    hf = config(hidden_size=256, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64, vocab_size=64,
                max_position_embeddings=128, rope_scaling=ROPES[kind], rope_theta=20000.0, **extra)
    args = args_from_hf_config(hf.to_dict())
    assert args.rope_scaling.type == ("none" if kind == "none" else kind.split("-")[0])
    S = 300  # beyond max_position_embeddings and the original context
    seq = S if args.rope_scaling.follows_length else 0
    ours, attn = inv_freq(args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings, seq)
    if kind != "none":
        theirs, their_attn = ROPE_INIT_FUNCTIONS[hf.rope_parameters["rope_type"]](hf, "cpu", seq_len=seq or None)
        assert torch.allclose(ours, theirs.double(), rtol=1e-6, atol=0), (ours, theirs)
        assert attn == pytest.approx(their_attn, rel=1e-12)
        if kind.startswith("yarn") or kind == "longrope":
            assert attn != 1.0
        assert not torch.allclose(ours, inv_freq(args.head_dim, args.rope_theta)[0])  # it did scale
    pos = torch.arange(S)
    cos, sin = rope_tables(pos, args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings, seq)
    rot = rotary(hf)
    hc, hs = rot(torch.zeros(1, S, 8, dtype=torch.float32), pos[None])
    # transformers forms angles in float32: position x frequency is off by ~S * 6e-8
    assert torch.allclose(cos, hc[0].double(), atol=4e-5, rtol=0) and torch.allclose(sin, hs[0].double(), atol=4e-5,
                                                                                      rtol=0)
    # the global positions a rank holds give the rows of the whole table
    from burstengine.layout import position_ids

    idx = position_ids(S - 4, "zigzag", 1, 4)
    c1, _ = rope_tables(idx, args.head_dim, args.rope_theta, args.rope_scaling, args.max_position_embeddings, seq)
    assert torch.equal(c1, cos[idx])


def test_rope_scaling_errors():
    with pytest.raises(ValueError, match="rope_scaling.type must be one of"):
        RopeScaling(type="ntk").validate(128)
    with pytest.raises(ValueError, match="needs the original context length"):
        RopeScaling(type="yarn", factor=4.0).validate(0)
    with pytest.raises(ValueError, match="factor must be >= 1"):
        RopeScaling(type="linear", factor=0.5).validate(128)


# --- model numerics vs transformers (one process) -------------------------------------------------

@pytest.mark.parametrize("arch", sorted(fc.ARCHS))
def test_logits_match_transformers(models, arch):
    from burstengine.model.hf_dir import load_hf_model

    ids = torch.randint(0, fc.VOCAB, (2, 61), generator=torch.Generator().manual_seed(1))  # 61: prime, > context
    ours = load_hf_model(models[arch])
    with torch.no_grad():
        got = ours(ids, torch.arange(61)) @ ours.head_weight.t()
        ref = fc.hf_model(models[arch])(input_ids=ids).logits
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, err
    assert ref.std() > 0.1  # not a degenerate model


def test_mistral_window_is_hf_sliding_window(models):
    """HF's sliding_window W: kv > q - W, so W keys including the query's own: our window=W.
    A window one wider or narrower gives other logits."""
    from burstengine.model.hf_dir import load_hf_model

    ids = torch.randint(0, fc.VOCAB, (1, 23), generator=torch.Generator().manual_seed(2))
    ref = fc.hf_model(models["mistral"])(input_ids=ids).logits
    ours = load_hf_model(models["mistral"])
    assert ours.args.window == 5
    errs = {}
    for w in (4, 5, 6):
        for b in ours.layers:
            b.window = w
        with torch.no_grad():
            errs[w] = ((ours(ids, torch.arange(23)) @ ours.head_weight.t() - ref).abs().max()).item()
    assert errs[5] < 1e-5 and errs[4] > 1e-3 and errs[6] > 1e-3, errs


def test_gemma3_windows_ropes_and_scales_are_hf(models):
    """Gemma 3's sliding_window W is our window W on its sliding layers only (HF: kv > q - W, the
    query's own key included), each layer type reads its own RoPE base, and the embedding and
    attention scales are Gemma's: transformers' logits, which any one of them set otherwise moves."""
    from burstengine.model.hf_dir import load_hf_model

    ids = torch.randint(0, fc.VOCAB, (1, 23), generator=torch.Generator().manual_seed(2))
    ref = fc.hf_model(models["gemma3"])(input_ids=ids).logits
    ours = load_hf_model(models["gemma3"])
    a = ours.args
    assert (a.window, a.window_layers, a.local_rope_theta, a.query_pre_attn_scalar) == (5, "sfs", 500.0, 20.0)
    assert [b.window for b in ours.layers] == [5, 0, 5] and [b.rope_index for b in ours.layers] == [1, 0, 1]

    def err():
        with torch.no_grad():
            return ((ours(ids, torch.arange(23)) @ ours.head_weight.t() - ref).abs().max() / ref.abs().max()).item()

    assert err() < 1e-5
    off = {}
    for name, attr, values in (("window 4", "window", [4, 0, 4]), ("window 6", "window", [6, 0, 6]),
                               ("global layer windowed", "window", [5, 5, 5]),
                               ("one RoPE", "rope_index", [0, 0, 0]), ("head_dim scale", "softmax_scale", [None] * 3)):
        kept = [getattr(b, attr) for b in ours.layers]
        for b, v in zip(ours.layers, values):
            setattr(b, attr, v)
        off[name] = err()
        for b, v in zip(ours.layers, kept):
            setattr(b, attr, v)
    a.embed_scale = False
    off["no embedding scale"] = err()
    assert all(e > 1e-3 for e in off.values()), off


# --- init -> train -> export, on the gloo ranks -------------------------------------------------

@pytest.mark.parametrize("arch", sorted(fc.ARCHS))
def test_first_loss_matches_transformers_cp124(pool, models, tokens, arch):
    """(a) the trainer's first loss = transformers' on the same batch, (d) at CP 1, 2, 4; the
    sequence (56 tokens) is longer than the model's 32-token context."""
    losses = []
    for world, layout in ((1, "contiguous"), (2, "zigzag"), (4, "striped")):
        loss, ref, gmax = pool.run(fc.first_loss, models[arch], tokens, 56, [f"layout={layout}"], world=world)[0]
        assert abs(loss - ref) <= TOL * ref, (world, loss, ref)
        assert gmax > 0
        losses.append(loss)
    assert max(losses) - min(losses) <= TOL * losses[0], losses


def test_gemma3_every_checkpoint_policy_is_exact(pool, models, tokens):
    """Gemma 3 (sandwich norms, GeGLU, per-layer windows and RoPEs) at CP 2 under every checkpoint
    policy: the loss and gradients of keeping everything.  Sequence-level checkpointing runs on the
    global layer (its ring takes the attention scale) and is refused on a sliding one, as for
    Mistral's window; "auto" plans "selective" where it would plan "sequence"."""
    from burstengine.model import recompute as C
    from burstengine.model.hf_dir import args_from_hf_config, read_config
    from burstengine.train import load
    from burstengine.testing import rel_err

    plans = [["none"] * 3, ["full"] * 3, ["selective"] * 3, ["pointwise"] * 3, ["offload"] * 3,
             ["selective", "sequence", "pointwise"], ["offload", "none", "full"]]
    # at 48 local tokens (2 x 48 over CP 2): room for the layers' "sequence" bytes, not "pointwise"'s
    a = args_from_hf_config(read_config(models["gemma3"]))
    per = {k: v * 48 for k, v in C.activation_bytes(a, 4).items()}
    budget = (3 * per["sequence"] + C.transient_bytes(a, 4)["full"] * 48) / 2 ** 30
    (runs, (plan, loss, grads)) = pool.run(fc.policy_variants, models["gemma3"], tokens, 48, plans, ["cp=2"],
                                           auto_gib=budget, world=2)[0]
    (rloss, rgrads) = runs[0]
    assert all(g.abs().max() > 0 for g in rgrads.values())
    assert "selective" in plan and "sequence" not in plan, plan
    for p, (l, g) in zip(plans[1:] + ["auto"], runs[1:] + [(loss, grads)]):
        assert abs(l - rloss) <= TOL * rloss, (p, l, rloss)
        worst = max((rel_err(g[n], rgrads[n]), n) for n in rgrads)
        assert worst[0] <= 1e-5, (p, worst)
    with pytest.raises(ValueError, match=r"'sequence' does not support a sliding window \(model.window=5\)"):
        load("tiny", [f"init={models['gemma3']}", "activation_checkpoint=sequence"])


@pytest.mark.parametrize("arch,extra,world", [
    ("llama", [], 2), ("llama3-tied", [], 4), ("qwen2", [], 2), ("qwen3", [], 3), ("mistral", [], 2), ("gemma3", [], 2),
    ("phi3", [], 2),
    # context extension set on the command line, with the export carrying it
    ("llama", ["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4",
               "model.rope_scaling.original_max_position_embeddings=32"], 2),
    ("qwen2", ["model.rope_scaling.type=dynamic", "model.rope_scaling.factor=2", "model.rope_theta=50000"], 2),
    ("llama3-tied", ["model.rope_scaling.factor=4"], 2),
])
def test_init_step_export_roundtrip(pool, models, tokens, tmp_path, arch, extra, world):
    """(b) init -> 1 step at lr 0 -> export gives back the original tensors bitwise, (c) the export
    loads in transformers with the trainer's loss, and config.json carries the rope settings and
    the trained length."""
    from safetensors.torch import load_file

    src = models[arch]
    out = tmp_path / "export"
    res, loss, hf = pool.run(fc.train_and_export, src, tokens, 48, str(tmp_path / "run"), str(out),
                             [f"cp={world}", "layout=contiguous", *extra], world=world)[0]
    assert res["step"] == 1
    a, b = load_file(os.path.join(src, "model.safetensors")), load_file(out / "model.safetensors")
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert abs(loss - hf) <= TOL * hf, (loss, hf)
    cfg = json.loads((out / "config.json").read_text())
    with open(os.path.join(src, "config.json")) as f:
        assert cfg["architectures"] == json.load(f)["architectures"]
    over = dict(e.split("=", 1) for e in extra)
    if "model.rope_scaling.type" in over:
        assert cfg["rope_scaling"]["rope_type"] == over["model.rope_scaling.type"]
        if over["model.rope_scaling.type"] == "dynamic":
            assert cfg["max_position_embeddings"] == 32 and cfg["rope_theta"] == 50000.0
        else:
            assert cfg["max_position_embeddings"] == 48
    elif arch == "llama3-tied":
        assert cfg["rope_scaling"]["rope_type"] == "llama3"
        assert cfg["rope_scaling"]["factor"] == float(over.get("model.rope_scaling.factor", 8.0))
        assert "lm_head.weight" not in b


def test_sharded_in_and_out(pool, tokens, tmp_path):
    """A sharded input (index + several files) loads; an export above the size limit is sharded
    with an index that transformers reads, and its logits equal ours."""
    from burstengine.model.hf_dir import load_hf_model

    src = fc.save_tiny(tmp_path / "src", "qwen2", max_shard_size="40KB")
    assert os.path.exists(os.path.join(src, "model.safetensors.index.json"))
    out = tmp_path / "out"
    res, loss, hf = pool.run(fc.train_and_export, src, tokens, 40, str(tmp_path / "run"), str(out), ["cp=2"],
                             max_shard_bytes=50_000, world=2)[0]
    assert res["files"] > 1 and (out / "model.safetensors.index.json").exists()
    assert abs(loss - hf) <= TOL * hf
    ids = torch.randint(0, fc.VOCAB, (1, 37), generator=torch.Generator().manual_seed(3))
    ours = load_hf_model(str(out))
    with torch.no_grad():
        got = ours(ids, torch.arange(37)) @ ours.head_weight.t()
        ref = fc.hf_model(str(out))(input_ids=ids).logits
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5


def test_train_and_export_commands_take_a_gemma3_directory(models, tokens, tmp_path):
    """`burstengine train` with init= a Gemma 3 directory (2 ranks, 1 step at lr 0), then
    `burstengine export` of the run: the directory's tensors back bitwise, as a Gemma3ForCausalLM."""
    from safetensors.torch import load_file

    from test_cli import _run

    src, run, out = models["gemma3"], tmp_path / "run", tmp_path / "out"
    sets = [*fc.overrides(src, tokens, 24, ["steps=1", "lr=0", "warmup_steps=0", "save_every=1", f"out_dir={run}"])]
    rc, text, err = _run("train", "--world", "2", *(a for s in sets for a in ("--set", s)))
    assert rc == 0, text + err
    rc, text, err = _run("export", str(run), str(out))
    assert rc == 0, text + err
    a, b = load_file(os.path.join(src, "model.safetensors")), load_file(out / "model.safetensors")
    assert sorted(a) == sorted(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Gemma3ForCausalLM"]


def test_weights_only_checkpoint_exports_and_resumes_fresh(pool, models, tokens, tmp_path):
    """`bench finetune load --save` writes the weights only (an 8B model's AdamW moments would
    triple the file): export reads them back bitwise, and a run resumed from it takes the same
    first step as a run started from init (an optimizer given a state on the way — DCP's
    initialisation sets AdamW's step to 1 — would not)."""
    from safetensors.torch import load_file

    src, out = models["llama"], tmp_path / "export"
    diff, has_optim, meta = pool.run(fc.weights_only_resume, src, tokens, 48, str(tmp_path / "saved"),
                                     str(tmp_path / "fresh"), str(out), world=2)[0]
    assert not has_optim and meta["optimizer"] is False and meta["step"] == 0
    a, b = load_file(os.path.join(src, "model.safetensors")), load_file(out / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert diff == 0.0, diff


# --- packed documents ---------------------------------------------------------------------------

@pytest.mark.parametrize("arch,world,layout", [("llama", 1, "contiguous"), ("llama", 2, "zigzag"),
                                               ("mistral", 2, "striped"), ("qwen3", 4, "contiguous"),
                                               ("gemma3", 2, "zigzag")])
def test_packed_documents_equal_documents_alone(pool, models, arch, world, layout):
    docs = [0, 7, 30, 31, 56]  # boundaries that cross shards, a one-token document
    got, alone = pool.run(fc.packed_vs_alone, models[arch], 56, docs, layout, world=world)[0]
    assert abs(got - alone) <= 1e-5 * abs(alone), (got, alone)


def test_sequence_checkpoint_refuses_masks(models):
    from burstengine.model.hf_dir import load_hf_model

    m = load_hf_model(models["llama"])
    for b in m.layers:
        b.policy = "sequence"
    ids = torch.randint(0, fc.VOCAB, (1, 16))
    with pytest.raises(ValueError, match="checkpoint='sequence' does not support packed documents"):
        m(ids, torch.arange(16), ids, cu_seqlens=[0, 8, 16])


# --- config and errors --------------------------------------------------------------------------

def test_init_config(models, tmp_path):
    from burstengine.train import load

    cfg = load("tiny", [f"init={models['qwen3']}", "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4",
                        "model.rope_theta=20000"])
    m = cfg.model
    assert (m.arch, m.dim, m.head_dim, m.qk_norm, m.max_position_embeddings) == ("qwen3", 64, 32, True, 32)
    assert (m.rope_scaling.type, m.rope_scaling.factor, m.rope_theta) == ("yarn", 4.0, 20000.0)
    toml = tmp_path / "ft.toml"
    toml.write_text(f'init = "{models["mistral"]}"\n[model.rope_scaling]\ntype = "linear"\nfactor = 2.0\n')
    cfg = load(str(toml))
    assert cfg.model.window == 5 and cfg.model.rope_scaling.type == "linear"
    with pytest.raises(ValueError, match="model.n_layers is set, but with init="):
        load("tiny", [f"init={models['llama']}", "model.n_layers=4"])
    with pytest.raises(ValueError, match="needs attention='burst'"):
        load("tiny", [f"init={models['mistral']}", "attention=torch-cp"])


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from burstengine.train import load

    GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(ValueError) as e:
        load("tiny", [f"init={tmp_path / 'gpt2'}"])
    msg = str(e.value)
    assert "architecture 'GPT2LMHeadModel' is not supported" in msg and "config.json" in msg
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert arch in msg
    with pytest.raises(ValueError, match="has no config.json"):
        load("tiny", [f"init={tmp_path}"])
    fc.save_tiny(tmp_path / "q", "qwen2")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    cfg["use_sliding_window"] = True
    (tmp_path / "q" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="use_sliding_window=true"):
        load("tiny", [f"init={tmp_path / 'q'}"])


def test_export_cli_errors(tmp_path, capsys):
    from burstengine.cli import main

    assert main(["export", str(tmp_path), str(tmp_path / "out")]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err


def test_export_copies_the_runs_tokenizer(pool, models, tokens, tmp_path):
    """The tokenizer= a run trained with (here beside data of token ids, over an init directory
    that has none) lands in the export, which transformers' AutoTokenizer then reads as the run
    did; a tokenizer file of another name is copied as tokenizer.json."""
    from tokenizers import Tokenizer, models as tmodels, pre_tokenizers
    from transformers import AutoTokenizer

    from burstengine.model.hf_dir import tokenizer_sources

    tok = Tokenizer(tmodels.WordLevel({w: i for i, w in enumerate(["<unk>", "</s>", "pass", "key", "is"])},
                                      unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "unk_token": "<unk>"}))
    out = tmp_path / "export"
    res, _, _ = pool.run(fc.train_and_export, models["llama"], tokens, 48, str(tmp_path / "run"), str(out),
                         [f"tokenizer={folder / 'tokenizer.json'}"], world=1)[0]
    assert sorted(res["tokenizer_files"]) == ["tokenizer.json", "tokenizer_config.json"]
    assert (out / "tokenizer.json").read_text() == (folder / "tokenizer.json").read_text()
    assert AutoTokenizer.from_pretrained(str(out))("the pass key is").input_ids == tok.encode("the pass key is").ids
    os.rename(folder / "tokenizer.json", folder / "words.json")
    assert tokenizer_sources(str(folder / "words.json")) == {"tokenizer.json": str(folder / "words.json")}
    assert tokenizer_sources(str(folder)) == {"tokenizer_config.json": str(folder / "tokenizer_config.json")}


def test_export_refuses_a_full_folder_and_an_incomplete_checkpoint(pool, models, tokens, tmp_path, capsys):
    """export replaces an earlier export of its own, asks for --overwrite before replacing a
    folder that holds anything else, refuses a file; a checkpoint with a file deleted or cut
    short is refused naming that file, in one line, and nothing is written."""
    from burstengine.cli import main

    run, out = tmp_path / "run", tmp_path / "out"
    pool.run(fc.train_and_export, models["llama"], tokens, 48, str(run), str(out), world=1)

    def refused(argv, *words):
        assert main(["export", *map(str, argv)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        err = [x for x in lines if ": note: " not in x]  # notes name the checkpoints skipped on the way
        assert len(err) == 1 and "error:" in err[0] and all(w in " ".join(lines) for w in words), lines

    assert main(["export", str(run), str(out)]) == 0  # an earlier export: replaced whole
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    refused([run, tmp_path / "mine"], "--overwrite")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    (tmp_path / "file").write_text("x")
    refused([run, tmp_path / "file"], "file")
    step = next((run / "checkpoints").iterdir())
    shard = next(step.glob("*.distcp"))
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    refused([run, tmp_path / "b"], shard.name)
    shard.unlink()
    refused([run, tmp_path / "c"], shard.name)
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
