"""Hugging Face LLaMA-family checkpoints (config.json + safetensors) -> :class:`burstengine.model.Transformer`.

Only the files are read (json and safetensors; transformers itself is not needed).  The
mapping is one name table: HF's rotary convention (rotate the two halves of each head) is the
one our model uses, so q/k weights are copied as they are, without the permutation that
Meta-format checkpoints need.  Three architectures load: ``llama``, ``mistral`` (its sliding
window, where set, is :attr:`Extras.window`: inference applies it) and ``qwen2`` (q/k/v
biases: the loaded model's q/k/v projections get them).  What our model cannot reproduce
exactly (rope scaling, another activation, a head dim that is not hidden/heads, Qwen2's
per-layer sliding windows, biases elsewhere) is refused with a ValueError naming the field; run
such models through ``--impl hf`` instead.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import torch

# HF parameter name -> ours; {i} is the layer index
_LAYER = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
    # Qwen2's q/k/v biases (the loader gives a model that has them the Linear biases to hold them)
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
}
_TOP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# buffers some checkpoints carry that our model recomputes
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def hf_to_ours(name: str) -> str | None:
    """Our parameter name for an HF LlamaForCausalLM one (None: a buffer we do not keep)."""
    if not name.startswith(("model.", "lm_head.")):
        name = "model." + name  # a bare LlamaModel checkpoint
    if _IGNORED.search(name):
        return None
    if name in _TOP:
        return _TOP[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER:
        return f"layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    raise ValueError(f"unexpected tensor {name!r} in the checkpoint: not part of a LLaMA model")


def ours_to_hf(name: str) -> str:
    """The inverse of :func:`hf_to_ours` (to write our weights as an HF checkpoint)."""
    for hf, ours in _TOP.items():
        if name == ours:
            return hf
    m = re.match(r"^layers\.(\d+)\.(.+)$", name)
    for hf, ours in _LAYER.items():
        if m and m.group(2) == ours:
            return f"model.layers.{m.group(1)}.{hf}"
    raise ValueError(f"no HF name for {name!r}")


def read_config(path: str) -> dict:
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        raise ValueError(f"{path!r} is neither a model preset nor a directory with a config.json")
    with open(f) as fh:
        return json.load(fh)


def _rope(cfg: dict) -> tuple[float, dict | None]:
    # transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; 4.x wrote rope_theta
    # and rope_scaling at the top level
    params = cfg.get("rope_parameters") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    kind = params.get("rope_type") or params.get("type") or (scaling or {}).get("rope_type") or \
        (scaling or {}).get("type") or "default"
    return float(theta), (None if kind == "default" else {"rope_type": kind})


ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class Extras:
    """What a checkpoint adds to the LLaMA that ModelArgs describes: q/k/v biases (Qwen2) and a
    sliding window (Mistral: each query sees the ``window`` most recent keys, itself included,
    transformers' ``kv_idx > q_idx - sliding_window``)."""

    qkv_bias: bool = False
    window: int | None = None


def extras_from_hf_config(cfg: dict) -> Extras:
    kind = cfg.get("model_type")
    window = None
    if kind == "mistral":
        window = cfg.get("sliding_window")
    elif kind == "qwen2":
        # transformers keeps sliding_window only with use_sliding_window, and then only for the
        # layers from max_window_layers on; a per-layer mix is not reproduced here
        types = set(cfg.get("layer_types") or [])
        if cfg.get("use_sliding_window") or "sliding_attention" in types:
            raise ValueError("this Qwen2 checkpoint uses sliding-window layers (use_sliding_window / layer_types), "
                             "which burstengine's LLaMA does not implement; run it with --impl hf")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be a positive int, got {window!r}")
    return Extras(qkv_bias=kind == "qwen2", window=window)


def args_from_hf_config(cfg: dict):
    """ModelArgs for an HF LLaMA-family config.json (a dict), or a ValueError saying what differs
    (what ModelArgs leaves out is in :func:`extras_from_hf_config`)."""
    from ..model import ModelArgs

    kind = cfg.get("model_type")
    if kind not in ARCHITECTURES:
        raise ValueError(f"model_type {kind!r} is not a LLaMA model; our model reproduces {', '.join(ARCHITECTURES)}. "
                         f"Try --impl hf")
    extras_from_hf_config(cfg)
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg['hidden_act']!r}")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            problems.append(f"{key}=true")
    theta, scaling = _rope(cfg)
    if scaling:
        problems.append(f"rope scaling {scaling['rope_type']!r}")
    dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("head_dim") not in (None, dim // heads):
        problems.append(f"head_dim={cfg['head_dim']} (hidden_size / num_attention_heads = {dim // heads})")
    if problems:
        raise ValueError(f"this checkpoint has {', '.join(problems)}, which burstengine's LLaMA does not implement; "
                         f"run it with --impl hf (transformers with attn_implementation='burst')")
    args = ModelArgs(dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=heads,
                     n_kv_heads=cfg.get("num_key_value_heads") or heads, vocab_size=cfg["vocab_size"],
                     ffn_dim=cfg["intermediate_size"], norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                     rope_theta=theta, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)))
    args.validate()
    return args


def hf_config_from_args(args) -> dict:
    """The config.json of an HF LlamaForCausalLM with our model's shape (for ``--impl hf`` on a preset)."""
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=args.dim,
                num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                num_key_value_heads=args.n_kv_heads, vocab_size=args.vocab_size, intermediate_size=args.ffn_dim,
                rms_norm_eps=args.norm_eps, rope_parameters={"rope_type": "default", "rope_theta": args.rope_theta},
                tie_word_embeddings=args.tie_embeddings, hidden_act="silu", head_dim=args.head_dim,
                max_position_embeddings=1 << 22)


def _tensor_files(path: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file holding it."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path!r} (only safetensors "
                         f"checkpoints are read)")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


@torch.no_grad()
def load_hf_llama(path: str, device="cpu", dtype=torch.float32):
    """Our Transformer with the weights of the HF LLaMA-family checkpoint in directory ``path``
    (Qwen2's q/k/v projections get biases; a Mistral sliding window is the model's
    ``sliding_window`` attribute, None without one: inference applies it).

    Parameters are created on the meta device and filled tensor by tensor straight from the
    safetensors files onto ``device``, so a model is never held twice in memory."""
    from safetensors import safe_open

    from ..model import Transformer

    cfg = read_config(path)
    args, extras = args_from_hf_config(cfg), extras_from_hf_config(cfg)
    with torch.device("meta"):
        model = Transformer(args)
        if extras.qkv_bias:
            for b in model.layers:
                a = b.attention
                for name in ("wq", "wk", "wv"):
                    old = getattr(a, name)
                    setattr(a, name, torch.nn.Linear(old.in_features, old.out_features, bias=True))
    model.to(dtype).to_empty(device=device)
    params = dict(model.named_parameters())
    files = _tensor_files(path)
    seen = set()
    for fname in sorted(set(files.values())):
        with safe_open(fname, framework="pt", device=str(torch.device(device))) as f:
            for hf_name in f.keys():
                ours = hf_to_ours(hf_name)
                if ours is None or (ours == "output.weight" and args.tie_embeddings):
                    continue
                p = params.get(ours)
                if p is None:  # e.g. a q_proj bias in a checkpoint whose config says it has none
                    raise ValueError(f"unexpected tensor {hf_name!r} in {fname!r}: config.json describes a model "
                                     f"without it")
                t = f.get_tensor(hf_name)
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"{hf_name}: shape {tuple(t.shape)} in the checkpoint, {tuple(p.shape)} "
                                     f"expected from config.json")
                p.copy_(t)
                seen.add(ours)
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"the checkpoint in {path!r} lacks {len(missing)} tensor(s), e.g. "
                         f"{[ours_to_hf(m) for m in missing[:3]]}")
    model.sliding_window = extras.window
    return model
