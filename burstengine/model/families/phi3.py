"""Phi-3 and Phi-3.5 (``Phi3ForCausalLM``): the Llama-like model with q, k and v fused in one
``qkv_proj`` (q's rows, then k's, then v's) and gate and up in one ``gate_up_proj`` (gate's rows,
then up's), split into our separate projections by the table.

Rope: plain (the 4k models), or LongRoPE (``longrope``, once called "su"; Phi-3's old "yarn",
which transformers 4.40 ran with another attention factor and 5.x reads as longrope, is
refused as ambiguous): per-frequency factors, the long ones for a sequence longer
than ``original_max_position_embeddings``, which Phi-3 keeps at the top level of config.json;
transformers lets that key (default 4096) win over one inside rope_scaling, and so does this.

``sliding_window`` = W has Mistral's meaning (each query sees the W most recent keys, itself
included: transformers' Phi-3 mask is ``kv > q - W``): ``ModelArgs.window``.  A window at least
as long as the model's context (Phi-3-mini-128k's 262144 over 131072 positions) masks nothing the
model is meant to see, so it is read as none (a window costs sequence checkpointing and torch's
CP) and written back as it was unless the model was run at a longer length (a sequence longer
than W, past twice Phi-3-mini-128k's context, is the one place where reading it as none differs
from transformers, which windows it).

Refused: ``partial_rotary_factor`` != 1 (Phi-4-mini), biases, an activation other than SiLU.
Dropout keys (``resid_pdrop``, ``embd_pdrop``, ``attention_dropout``) are not read: burstengine's
model has no dropout.  Other keys (token ids, ...) are kept on export from the source config.
"""
from .base import LLAMA_LIKE, Family, layer
from .table import Table

# Phi3Config's default when config.json lacks the top-level key
ORIGINAL_CONTEXT = 4096
_SPLIT = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")


def qkv_rows(a):
    return a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim, a.n_kv_heads * a.head_dim


FUSED = tuple(e for e in LLAMA_LIKE if not e.hf.endswith(_SPLIT)) + (
    layer("self_attn.qkv_proj.weight", "attention.wq.weight", "attention.wk.weight", "attention.wv.weight",
          rows=qkv_rows),
    layer("mlp.gate_up_proj.weight", "feed_forward.w1.weight", "feed_forward.w3.weight",
          rows=lambda a: (a.ffn_dim, a.ffn_dim)),
)


class Phi3(Family):
    name = model_type = "phi3"
    title = "Phi-3"
    architectures = ("Phi3ForCausalLM",)
    expresses = {"window": "a sliding window"}
    table = Table(FUSED)
    rope_types = {"default": "none", "longrope": "longrope", "su": "longrope"}
    defaults = {"rms_norm_eps": 1e-5, "tie_word_embeddings": False}

    def rope(self, cfg, where):
        params = {**(cfg.get("rope_parameters") or {}), **(cfg.get("rope_scaling") or {})}
        if params:
            params["original_max_position_embeddings"] = cfg.get("original_max_position_embeddings") or ORIGINAL_CONTEXT
            cfg = {**cfg, "rope_parameters": None, "rope_scaling": params}
        return super().rope(cfg, where)

    def options(self, cfg):
        window = int(cfg.get("sliding_window") or 0)
        context = int(cfg.get("max_position_embeddings") or 0)
        return {"window": 0 if context and window >= context else window}

    def hf_config(self, args, seq_len=0, base=None, dtype=None):
        cfg = super().hf_config(args, seq_len, base, dtype)
        if args.rope_scaling.type == "longrope":
            cfg["original_max_position_embeddings"] = args.rope_scaling.original(args.max_position_embeddings)
        # the source's window while it masks nothing the model ran at (transformers would window longer
        # sequences), else ours
        kept = (base or {}).get("sliding_window") or 0
        ran = max(seq_len, cfg["max_position_embeddings"])
        cfg["sliding_window"] = args.window or (kept if kept >= ran else None)
        return cfg


FAMILY = Phi3()
