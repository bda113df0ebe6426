"""Model families as adapters (burstengine/model/families): the registry is what ModelArgs and the
config help accept and what the errors list; every family maps config.json both ways and refuses
what it cannot write; the loader keeps its error texts; and the weight-name table expresses fused
tensors (one HF tensor split into several of ours, the split from the config): a synthetic
family with Phi-3's fusions loads plain and FSDP2-sharded (each rank reading only its rows) and
exports bitwise."""
import dataclasses
import json
import os
import re
import warnings

import pytest
import torch

import families_cases as fam
from burstengine.model import ModelArgs, RopeScaling, hf_dir
from burstengine.model.families import ARCHS, FAMILIES
from burstengine.model.families.table import entry

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128, max_position_embeddings=32)
# every registered family: (its config.json keys beyond TINY, the ModelArgs options they give)
CASES = {
    "llama": ({"architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True}, {"tie_embeddings": True}),
    "qwen2": ({"architectures": ["Qwen2ForCausalLM"], "attention_bias": True}, {"qkv_bias": True}),
    "qwen3": ({"architectures": ["Qwen3ForCausalLM"], "head_dim": 32}, {"qk_norm": True, "head_size": 32}),
    "mistral": ({"architectures": ["MistralForCausalLM"], "sliding_window": 5}, {"window": 5}),
    "gemma3": ({"architectures": ["Gemma3ForCausalLM"], "head_dim": 32, "sliding_window": 5,
                "layer_types": ["sliding_attention", "full_attention"], "query_pre_attn_scalar": 24,
                "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 2e4},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}},
               {"window": 5, "window_layers": "sf", "local_rope_theta": 500.0, "rope_theta": 2e4, "qk_norm": True,
                "norm_plus_one": True, "sandwich_norm": True, "embed_scale": True, "activation": "gelu_tanh",
                "query_pre_attn_scalar": 24.0, "tie_embeddings": True, "head_size": 32}),
    "phi3": ({"architectures": ["Phi3ForCausalLM"], "sliding_window": 5}, {"window": 5}),
}


# --- the registry ---------------------------------------------------------------------------------

def test_registry_is_what_the_model_accepts():
    from burstengine.model import args as model_args
    from burstengine.train.config import MODEL_HELP

    assert model_args.ARCHS == ARCHS == tuple(FAMILIES) == ("llama", "qwen2", "qwen3", "mistral", "gemma3", "phi3")
    for name, f in FAMILIES.items():
        assert f.name == name and f.model_type and f.title and f.architectures
        assert name in MODEL_HELP["arch"]
    with pytest.raises(ValueError, match=re.escape("model.arch must be one of ['llama', 'qwen2', 'qwen3', 'mistral', "
                                                   "'gemma3', 'phi3'], got 'gpt2'")):
        ModelArgs(arch="gpt2").validate()


def test_unsupported_architecture_lists_the_registry():
    with pytest.raises(ValueError) as e:
        hf_dir.args_from_hf_config(dict(TINY, architectures=["GPTNeoXForCausalLM"]), "x/config.json")
    msg = str(e.value)
    assert msg.startswith("x/config.json: architecture 'GPTNeoXForCausalLM' is not supported; burstengine's model "
                          "reproduces LlamaForCausalLM (model_type 'llama'), "), msg
    for f in FAMILIES.values():
        assert f"{f.architectures[0]} (model_type {f.model_type!r})" in msg
    # no architectures: the model_type picks the family, or is named in the error
    assert hf_dir.args_from_hf_config(dict(TINY, model_type="mistral")).arch == "mistral"
    with pytest.raises(ValueError, match="architecture 'gpt_neox' is not supported"):
        hf_dir.args_from_hf_config(dict(TINY, model_type="gpt_neox"))


@pytest.mark.parametrize("arch", ARCHS)
def test_config_both_ways(arch):
    extra, options = CASES[arch]
    args = hf_dir.args_from_hf_config(dict(TINY, **extra))
    assert args.arch == arch and {k: getattr(args, k) for k in options} == options
    back = hf_dir.hf_config_from_args(args, seq_len=0)
    assert back["architectures"] == extra["architectures"] and back["model_type"] == FAMILIES[arch].model_type
    assert back.get("sliding_window") == extra.get("sliding_window")
    assert back.get("use_sliding_window") is (False if arch.startswith("qwen") else None)
    assert hf_dir.args_from_hf_config(back) == args


@pytest.mark.parametrize("arch,key,value,text", [
    ("llama", "window", 4, "a sliding window (model.window=4) can only be written as a Mistral or Gemma 3 or Phi-3 "
                           "model, not 'llama'"),
    ("qwen3", "qkv_bias", True, "q/k/v biases (model.qkv_bias=True) can only be written as a Qwen2 model, not 'qwen3'"),
    ("mistral", "qk_norm", True, "q/k norms (model.qk_norm=True) can only be written as a Qwen3 or Gemma 3 model, "
                                 "not 'mistral'"),
    ("llama", "activation", "gelu_tanh", "a GeGLU MLP (model.activation=gelu_tanh) can only be written as a Gemma 3 "
                                         "model, not 'llama'"),
    ("qwen3", "norm_plus_one", True, "RMSNorms scaling by 1 + weight (model.norm_plus_one=True) can only be written "
                                     "as a Gemma 3 model, not 'qwen3'"),
    ("gemma3", "qkv_bias", True, "q/k/v biases (model.qkv_bias=True) can only be written as a Qwen2 model, "
                                 "not 'gemma3'"),
    ("llama", "rope_scaling", RopeScaling("longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8,
                                          original_max_position_embeddings=16),
     "longrope rope scaling (model.rope_scaling.type) can only be written as a Phi-3 model, not 'llama'"),
    ("phi3", "rope_scaling", RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16),
     "yarn rope scaling (model.rope_scaling.type) can only be written as a Llama or Qwen2 or Qwen3 or Mistral or "
     "Gemma 3 model, not 'phi3'"),
])
def test_options_a_family_cannot_write_are_refused(arch, key, value, text):
    args = ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=32, ffn_dim=96, arch=arch, **{key: value})
    for write in (hf_dir.hf_config_from_args, hf_dir.hf_tensors):
        with pytest.raises(ValueError, match=re.escape(text)):
            write(args)


def test_loader_errors_keep_their_texts(tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "llama"
    hf_dir.write_random_hf_dir(str(path), dict(TINY, architectures=["LlamaForCausalLM"]), dtype="float32")
    sd = load_file(path / "model.safetensors")
    save_file(dict(sd, **{"model.rotary_emb.inv_freq": torch.ones(8)}), path / "model.safetensors")
    hf_dir.load_hf_model(str(path))  # a buffer our model recomputes is skipped
    # a tensor of another family (Qwen2's bias), and one of none
    save_file(dict(sd, **{"model.layers.0.self_attn.q_proj.bias": torch.ones(64)}), path / "model.safetensors")
    with pytest.raises(ValueError, match=r"holds 1 tensor\(s\) its config.json does not describe, e.g. "
                                         r"\['model.layers.0.self_attn.q_proj.bias'\]"):
        hf_dir.load_hf_model(str(path))
    save_file(dict(sd, **{"layers.0.mlp.extra.weight": torch.ones(64)}), path / "model.safetensors")
    with pytest.raises(ValueError, match=re.escape(
            "unexpected tensor 'model.layers.0.mlp.extra.weight' in the checkpoint: not part of a "
            "LlamaForCausalLM/Qwen2ForCausalLM/Qwen3ForCausalLM/MistralForCausalLM/Gemma3ForCausalLM/Phi3ForCausalLM "
            "model")):
        hf_dir.load_hf_model(str(path))


def test_tied_config_with_a_distinct_head_loads_untied_as_transformers(tmp_path):
    """config.json ties the embeddings but the files hold their own lm_head.weight: transformers
    uses the file's head, and so do we (with a warning), not the embeddings."""
    from transformers import AutoModelForCausalLM

    cfg = dict(TINY, architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False,
               rms_norm_eps=1e-5, rope_theta=10000.0, torch_dtype="float32")
    hf_dir.write_random_hf_dir(str(tmp_path), cfg, seed=1, dtype="float32")
    with open(tmp_path / "config.json") as f:
        tied = dict(json.load(f), tie_word_embeddings=True)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(tied, f)
    with pytest.warns(hf_dir.UntiedHead, match="differs from model.embed_tokens.weight"):
        ours = hf_dir.load_hf_model(str(tmp_path))
    assert not ours.args.tie_embeddings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    assert not torch.equal(theirs.lm_head.weight, theirs.model.embed_tokens.weight)  # a case that can fail
    tokens = torch.randint(0, TINY["vocab_size"], (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(tokens).logits
        got = ours.logits(ours(tokens, torch.arange(tokens.shape[1])))
    torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=1e-4)
    # a model built tied cannot be filled from these files
    with pytest.raises(ValueError, match="lm_head.weight differs from the embeddings"):
        hf_dir.load_weights(hf_dir.Transformer(dataclasses.replace(ours.args, tie_embeddings=True)), str(tmp_path))


# --- fused tensors --------------------------------------------------------------------------------

def test_fused_table_lookups_and_splits():
    t = fam.FusedLlama().table
    qkv = "model.layers.1.self_attn.qkv_proj.weight"
    assert t.ours_of(qkv) == tuple(f"layers.1.attention.{w}.weight" for w in ("wq", "wk", "wv"))
    assert t.hf_of("layers.1.feed_forward.w3.weight") == "model.layers.1.mlp.gate_up_proj.weight"
    assert t.ours_of("model.layers.1.self_attn.q_proj.weight") is None
    a, m = fam.args(), fam.model()
    params = dict(m.named_parameters())
    shapes = {n: tuple(p.shape) for n, p in params.items()}
    ts = t.tensors(a, shapes)
    assert [(p.name, p.start, p.rows) for p in ts.parts[qkv]] == [
        ("layers.1.attention.wq.weight", 0, 96), ("layers.1.attention.wk.weight", 96, 32),
        ("layers.1.attention.wv.weight", 128, 32)]
    assert ts.shapes[qkv] == (160, 96) and ts.shapes["model.layers.0.mlp.gate_up_proj.weight"] == (400, 96)
    assert len(ts.parts) == 3 + 6 * a.n_layers  # embeddings, norm, head; 2 norms, qkv, o, gate_up, down a layer
    oracle = fam.phi3_style(m)
    assert sorted(ts.parts) == sorted(oracle)
    for hf in ts.parts:
        assert torch.equal(ts.join(hf, lambda n: params[n].detach()), oracle[hf]), hf
    # the split comes from the config: parameters that disagree with it are refused
    with pytest.raises(ValueError, match=re.escape("splits into rows [100, 100] by the config, but the model's")):
        t.tensors(dataclasses.replace(a, ffn_dim=100), shapes)
    with pytest.raises(ValueError, match="has 2 of the 3 parameters fused in"):
        t.tensors(a, {k: v for k, v in shapes.items() if k != "layers.0.attention.wv.weight"})
    with pytest.raises(ValueError, match="needs rows"):
        entry("model.fused.weight", "a.weight", "b.weight")


def test_fused_tensors_load_and_export_bitwise(tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from burstengine.train.export import export

    fam.use_fused(monkeypatch)
    oracle = fam.write_phi3_style(tmp_path / "hf", seed=3)
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors.index.json")
    got = dict(hf_dir.load_hf_model(str(tmp_path / "hf")).named_parameters())
    want = fam.model(seed=3)
    for name, p in want.named_parameters():
        assert torch.equal(got[name], p), name
    # a training checkpoint of the model exports as the same fused tensors
    ckpt = tmp_path / "run" / "step_00000001"
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": want.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 1, "config": {"model": dataclasses.asdict(fam.args()),
                                                                      "seq_len": 16}}))
    res = export(str(ckpt), str(tmp_path / "out"), dtype="float32")
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert res["files"] == 1 and sorted(out) == sorted(oracle)
    assert all(torch.equal(out[k], oracle[k]) for k in oracle)


@pytest.mark.parametrize("world", [2, 3])
def test_fused_tensors_load_sharded_reading_only_own_rows(pool, tmp_path, world):
    tensors = fam.write_phi3_style(tmp_path / "hf", seed=4)
    res = pool.run(fam.sharded_load, str(tmp_path / "hf"), 4, world=world)
    assert all(same for same, _, _ in res)
    # every byte of the checkpoint is read once over the ranks: each rank reads only the rows it keeps
    assert sum(read for _, read, _ in res) == sum(t.numel() * t.element_size() for t in tensors.values())
    assert all(read == reported for _, read, reported in res)


# --- Gemma 3: config.json as transformers reads it ------------------------------------------------

GEMMA3_TINY = dict(TINY, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_hidden_layers=7,
                   head_dim=16)
GEMMA3_CONFIGS = {
    # transformers 5: rope_parameters per layer type, explicit layer_types
    "v5": dict(GEMMA3_TINY, sliding_window=6, query_pre_attn_scalar=12,
               layer_types=["sliding_attention", "full_attention"] * 3 + ["sliding_attention"],
               rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    # transformers 4.50's keys (Gemma 3's hub configs): a pattern, rope_theta / rope_local_base_freq, rope_scaling
    "v4": dict(GEMMA3_TINY, sliding_window=4, sliding_window_pattern=3, rope_theta=2e5, rope_local_base_freq=300.0,
               rope_scaling={"rope_type": "linear", "factor": 4.0}, tie_word_embeddings=False),
    # nothing but the shape: the class's defaults (window 4096, pattern 6, bases 1e6 / 1e4, scalar 256, tied)
    "defaults": dict(GEMMA3_TINY),
}


@pytest.mark.parametrize("case", sorted(GEMMA3_CONFIGS))
def test_gemma3_config_as_transformers_reads_it(case):
    """Every Gemma 3 setting read as transformers' Gemma3TextConfig reads it (layer types, each
    type's RoPE, window, attention scale, tied embeddings), in both configs' key styles and from
    the class's defaults; the config we write back reads in transformers as the same model."""
    from transformers import Gemma3TextConfig

    cfg = GEMMA3_CONFIGS[case]

    def read(c):
        hf = Gemma3TextConfig(**{k: v for k, v in c.items() if k != "architectures"})
        full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
        return dict(types=[t[0] for t in hf.layer_types], window=hf.sliding_window, theta=float(full["rope_theta"]),
                    scaling=(full["rope_type"], full.get("factor")), local=(local["rope_type"], local["rope_theta"]),
                    scalar=hf.query_pre_attn_scalar, tied=hf.tie_word_embeddings, head_dim=hf.head_dim)

    hf = read(cfg)
    a = hf_dir.args_from_hf_config(cfg)
    ours = dict(types=list(a.window_layers), window=a.window, theta=a.rope_theta,
                scaling=("default" if a.rope_scaling.type == "none" else a.rope_scaling.type,
                         None if a.rope_scaling.type == "none" else a.rope_scaling.factor),
                local=("default", a.local_rope_theta), scalar=a.query_pre_attn_scalar, tied=a.tie_embeddings,
                head_dim=a.head_dim)
    assert ours == hf, (ours, hf)
    assert "f" in a.window_layers and "s" in a.window_layers and a.arch == "gemma3"
    back = hf_dir.hf_config_from_args(a, seq_len=0, base=cfg)
    assert read(back) == hf and hf_dir.args_from_hf_config(back) == a
    assert "hidden_act" not in back and back["hidden_activation"] == "gelu_pytorch_tanh"


@pytest.mark.parametrize("change,text", [
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0"),
    (dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention=true"),
    (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
    (dict(attention_bias=True), "attention_bias=true"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
     "rope type 'linear' on the sliding layers"),
    (dict(layer_types=["chunked_attention"] * 7), "layer_types ['chunked_attention']"),
])
def test_gemma3_refuses_what_it_does_not_implement(change, text):
    with pytest.raises(ValueError) as e:
        hf_dir.args_from_hf_config(dict(GEMMA3_TINY, **change), "g/config.json")
    msg = str(e.value)
    assert msg == f"g/config.json: this gemma3 checkpoint has {text}, which burstengine's model does not implement"


def test_gemma3_writer_refuses_a_model_it_cannot_describe():
    a = hf_dir.args_from_hf_config(GEMMA3_CONFIGS["v5"])
    with pytest.raises(ValueError, match="a Gemma 3 model has norm_plus_one, sandwich_norm, qk_norm, embed_scale; "
                                         "this one .* lacks sandwich_norm, embed_scale"):
        hf_dir.hf_config_from_args(dataclasses.replace(a, sandwich_norm=False, embed_scale=False))
    with pytest.raises(ValueError, match="gives its sliding layers unscaled RoPE"):
        hf_dir.hf_config_from_args(dataclasses.replace(a, local_rope_theta=0.0))
    with pytest.raises(ValueError, match=re.escape("model.window_layers must be empty or one letter per layer (7)")):
        dataclasses.replace(a, window_layers="sf").validate()
    with pytest.raises(ValueError, match="names sliding layers .* but model.window is 0"):
        dataclasses.replace(a, window=0).validate()


def test_gemma3_1b_stand_in_has_the_real_shape():
    """CONFIGS["gemma-3-1b"] reads as transformers reads it: the same parameter count (999,885,952,
    tied) and five sliding layers of every six."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = hf_dir.CONFIGS["gemma-3-1b"]
    a = hf_dir.args_from_hf_config(cfg)
    with torch.device("meta"):
        hf = Gemma3ForCausalLM(Gemma3TextConfig(**{k: v for k, v in cfg.items() if k != "architectures"}))
    assert a.num_params() == sum(p.numel() for p in hf.parameters()) == 999_885_952
    assert a.window_layers == "sssssf" * 4 + "ss" and a.window == 512 and a.tie_embeddings
    assert (a.head_dim, a.softmax_scale, a.local_rope_theta, a.rope_theta) == (256, 1 / 16, 1e4, 1e6)


def test_gemma3_untied_random_dir_loads_exports_bitwise_and_reads_in_transformers(tmp_path):
    """A random-weight Gemma 3 directory (write_random_hf_dir: norms 0, Gemma's scale 1) with an
    LM head of its own: transformers' logits from it equal ours, and a training checkpoint of the
    model exports as the same tensors bitwise."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from burstengine.train.export import export

    cfg = dict(GEMMA3_CONFIGS["v5"], tie_word_embeddings=False)
    hf_dir.write_random_hf_dir(str(tmp_path / "hf"), cfg, seed=4, dtype="float32")
    src = load_file(tmp_path / "hf" / "model.safetensors")
    assert "lm_head.weight" in src and all(not t.any() for k, t in src.items() if k.endswith("norm.weight"))
    ours = hf_dir.load_hf_model(str(tmp_path / "hf"))
    ids = torch.randint(0, TINY["vocab_size"], (1, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = ours.logits(ours(ids, torch.arange(19)))
        ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32,
                                                   attn_implementation="eager")(input_ids=ids).logits
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max() and ref.abs().max() > 0
    ckpt = tmp_path / "run" / "step_00000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": ours.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 1, "config": {"model": dataclasses.asdict(ours.args),
                                                                      "seq_len": 16}}))
    export(str(ckpt), str(tmp_path / "out"), dtype="float32")
    out = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(out) == sorted(src) and all(torch.equal(out[k], src[k]) for k in src)
