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
    "phi3": ({"architectures": ["Phi3ForCausalLM"], "sliding_window": 5}, {"window": 5}),
}


# --- the registry ---------------------------------------------------------------------------------

def test_registry_is_what_the_model_accepts():
    from burstengine.model import args as model_args
    from burstengine.train.config import MODEL_HELP

    assert model_args.ARCHS == ARCHS == tuple(FAMILIES) == ("llama", "qwen2", "qwen3", "mistral", "phi3")
    for name, f in FAMILIES.items():
        assert f.name == name and f.model_type and f.title and f.architectures
        assert name in MODEL_HELP["arch"]
    with pytest.raises(ValueError, match=re.escape("model.arch must be one of ['llama', 'qwen2', 'qwen3', 'mistral', "
                                                   "'phi3'], got 'gpt2'")):
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
    ("llama", "window", 4, "a sliding window (model.window=4) can only be written as a Mistral or Phi-3 model, not "
                           "'llama'"),
    ("qwen3", "qkv_bias", True, "q/k/v biases (model.qkv_bias=True) can only be written as a Qwen2 model, not 'qwen3'"),
    ("mistral", "qk_norm", True, "q/k norms (model.qk_norm=True) can only be written as a Qwen3 model, not 'mistral'"),
    ("llama", "rope_scaling", RopeScaling("longrope", short_factor=[1.0] * 8, long_factor=[2.0] * 8,
                                          original_max_position_embeddings=16),
     "longrope rope scaling (model.rope_scaling.type) can only be written as a Phi-3 model, not 'llama'"),
    ("phi3", "rope_scaling", RopeScaling("yarn", factor=4.0, original_max_position_embeddings=16),
     "yarn rope scaling (model.rope_scaling.type) can only be written as a Llama or Qwen2 or Qwen3 or Mistral "
     "model, not 'phi3'"),
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
            "LlamaForCausalLM/Qwen2ForCausalLM/Qwen3ForCausalLM/MistralForCausalLM/Phi3ForCausalLM model")):
        hf_dir.load_hf_model(str(path))


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
