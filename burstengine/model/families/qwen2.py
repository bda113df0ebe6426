"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): the Llama-like model with biases on q, k and v.

The biases are built in (no config key; ``attention_bias`` means nothing to Qwen2), so every
model of this family has ``ModelArgs.qkv_bias``.  Per-layer windows (``use_sliding_window``, with
``max_window_layers`` and ``sliding_window``) are refused, here and in Qwen3 (:class:`Qwen`).
"""
from .base import LLAMA_LIKE, Family, layer
from .table import Table

QKV_BIAS = (
    layer("self_attn.q_proj.bias", "attention.wq.bias"),
    layer("self_attn.k_proj.bias", "attention.wk.bias"),
    layer("self_attn.v_proj.bias", "attention.wv.bias"),
)


class Qwen(Family):
    """What Qwen2 and Qwen3 configs share: per-layer sliding windows, which our model (one window
    for all layers) lacks, refused on the way in and written off on the way back."""

    def problems(self, cfg):
        windows = ["use_sliding_window=true (per-layer windows)"] if cfg.get("use_sliding_window") else []
        return super().problems(cfg) + windows

    def write_options(self, args, cfg):
        cfg.setdefault("use_sliding_window", False)


class Qwen2(Qwen):
    name = model_type = "qwen2"
    title = "Qwen2"
    architectures = ("Qwen2ForCausalLM",)
    expresses = {"qkv_bias": "q/k/v biases"}
    table = Table(LLAMA_LIKE + QKV_BIAS)

    def bias_problems(self, cfg):
        return []  # q/k/v biases whatever attention_bias says, and none on o_proj

    def options(self, cfg):
        return {"qkv_bias": True}


FAMILY = Qwen2()
