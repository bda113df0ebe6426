"""Qwen3 (``Qwen3ForCausalLM``): the Llama-like model with an RMSNorm over each head of q and k
before RoPE (``ModelArgs.qk_norm``), and a head width usually apart from hidden / heads
(``head_dim``, read by the shared mapping).  Per-layer windows are refused as Qwen2's are.
"""
from .base import LLAMA_LIKE, layer
from .qwen2 import Qwen
from .table import Table

QK_NORM = (
    layer("self_attn.q_norm.weight", "attention.q_norm.weight"),
    layer("self_attn.k_norm.weight", "attention.k_norm.weight"),
)


class Qwen3(Qwen):
    name = model_type = "qwen3"
    title = "Qwen3"
    architectures = ("Qwen3ForCausalLM",)
    expresses = {"qk_norm": "q/k norms"}
    table = Table(LLAMA_LIKE + QK_NORM)

    def options(self, cfg):
        return {"qk_norm": True}


FAMILY = Qwen3()
