"""Gemma 3 text (``Gemma3ForCausalLM``, model_type ``gemma3_text``; Gemma 3 1B, and the text
weights of the larger ones saved as a causal LM).

The Llama-like model with every quirk of Gemma's, each a ModelArgs option:

* RMSNorms scale by 1 + weight, in float32 (``norm_plus_one``); the weights are HF's as stored;
* sandwich norms (``sandwich_norm``): HF's ``post_attention_layernorm`` norms the attention's
  output before its residual (``attention_out_norm``, not Llama's ``ffn_norm``), and
  ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` surround the MLP (``ffn_norm``,
  ``ffn_out_norm``);
* q/k norms over each head before RoPE (``qk_norm``), a GeGLU MLP (``hidden_activation``
  gelu_pytorch_tanh: ``activation="gelu_tanh"``), the embedding times sqrt(hidden_size) rounded to
  the weights' dtype (``embed_scale``), attention scores scaled by ``query_pre_attn_scalar ** -0.5``;
* sliding-window and global layers interleaved by ``layer_types`` (or the older
  ``sliding_window_pattern``: every p-th layer global), the sliding ones with ``sliding_window`` =
  W (each query sees the W most recent keys, itself included, as transformers' mask has it:
  ``window``, ``window_layers``) and a RoPE base of their own (``rope_local_base_freq``, or
  ``rope_parameters["sliding_attention"]``: ``local_rope_theta``, unscaled), the global ones
  ``rope_theta`` / ``rope_parameters["full_attention"]`` with its scaling (linear for the larger
  Gemma 3s);
* tied embeddings unless config.json says otherwise.

Refused: attention and final logit soft-capping, bidirectional attention, biases, activations
other than gelu_pytorch_tanh and silu, a sliding layer's RoPE scaling.
"""
from .base import LLAMA_LIKE, Family, layer
from .qwen3 import QK_NORM
from .table import Table

SANDWICH = (
    layer("post_attention_layernorm.weight", "attention_out_norm.weight"),
    layer("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
    layer("post_feedforward_layernorm.weight", "ffn_out_norm.weight"),
)
# Llama's post_attention_layernorm is our ffn_norm; Gemma's is the attention output's norm
GEMMA3 = tuple(e for e in LLAMA_LIKE if "ffn_norm" not in e.ours[0]) + QK_NORM + SANDWICH
ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "silu": "silu"}  # hidden_activation -> ModelArgs.activation
LAYER_TYPES = {"sliding_attention": "s", "full_attention": "f"}  # layer_types -> ModelArgs.window_layers' letters
OPTIONS = ("norm_plus_one", "sandwich_norm", "qk_norm", "embed_scale")  # what every Gemma 3 model has


class Gemma3(Family):
    name = "gemma3"
    model_type = "gemma3_text"
    title = "Gemma 3"
    architectures = ("Gemma3ForCausalLM",)
    expresses = {"qk_norm": "q/k norms", "window": "a sliding window", "window_layers": "per-layer sliding windows",
                 "local_rope_theta": "a RoPE base of the sliding layers", "norm_plus_one": "RMSNorms scaling by 1 + weight",
                 "sandwich_norm": "sandwich norms", "activation": "a GeGLU MLP", "embed_scale": "a scaled embedding",
                 "query_pre_attn_scalar": "an attention scale apart from head_dim"}
    table = Table(GEMMA3)
    # Gemma3TextConfig's defaults
    defaults = {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
                "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
                "sliding_window_pattern": 6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0}

    # --- config.json -> ModelArgs ---------------------------------------------------------------

    def model_fields(self, cfg, where="config.json"):
        return super().model_fields({**self.defaults, **cfg}, where)

    def problems(self, cfg):
        out = []
        if cfg.get("hidden_activation") not in ACTIVATIONS:
            out.append(f"hidden_activation={cfg.get('hidden_activation')!r}")
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if cfg.get(key) is not None:
                out.append(f"{key}={cfg[key]}")
        if cfg.get("use_bidirectional_attention"):
            out.append("use_bidirectional_attention=true")
        types = self._layer_types(cfg)
        if set(types) - set(LAYER_TYPES):
            out.append(f"layer_types {sorted(set(types) - set(LAYER_TYPES))}")
        elif "sliding_attention" in types and not cfg.get("sliding_window"):
            out.append("sliding_attention layers without a sliding_window")
        kind = self._rope_params(cfg)[1].get("rope_type") or "default"
        if kind != "default":
            out.append(f"rope type {kind!r} on the sliding layers")
        return out + self.bias_problems(cfg)

    @staticmethod
    def _layer_types(cfg) -> list:
        if cfg.get("layer_types") is not None:
            return list(cfg["layer_types"])
        p = int(cfg.get("sliding_window_pattern") or 6)
        return ["full_attention" if (i + 1) % p == 0 else "sliding_attention" for i in range(cfg["num_hidden_layers"])]

    @staticmethod
    def _rope_params(cfg) -> tuple[dict, dict]:
        """(the global layers' rope parameters, the sliding layers'), each with its rope_theta:
        transformers 5's rope_parameters per layer type, or 4.x's rope_theta, rope_scaling (the
        global layers') and rope_local_base_freq."""
        params = cfg.get("rope_parameters") or {}
        if "full_attention" in params or "sliding_attention" in params:
            full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
            full.update(cfg.get("rope_scaling") or {})
        else:
            full, local = {**params, **(cfg.get("rope_scaling") or {})}, {}
        full.setdefault("rope_theta", cfg["rope_theta"])
        local.setdefault("rope_theta", cfg["rope_local_base_freq"])
        return full, local

    def rope(self, cfg, where):
        keep = {k: cfg[k] for k in ("max_position_embeddings", "partial_rotary_factor") if k in cfg}
        return super().rope({**keep, "rope_parameters": self._rope_params(cfg)[0]}, where)

    def options(self, cfg):
        window = int(cfg.get("sliding_window") or 0)
        kinds = "".join(LAYER_TYPES[t] for t in self._layer_types(cfg)) if window else ""
        return dict(window=window, window_layers=kinds, local_rope_theta=float(self._rope_params(cfg)[1]["rope_theta"]),
                    norm_plus_one=True, sandwich_norm=True, qk_norm=True, embed_scale=True,
                    activation=ACTIVATIONS[cfg["hidden_activation"]],
                    query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]))

    # --- ModelArgs -> config.json ---------------------------------------------------------------

    def write_options(self, args, cfg):
        lacks = [k for k in OPTIONS if not getattr(args, k)]
        if lacks:
            raise ValueError(f"a Gemma 3 model has {', '.join(OPTIONS)}; this one (model.arch='gemma3') lacks "
                             f"{', '.join(lacks)}")
        local = args.local_rope_theta or args.rope_theta
        if not args.local_rope_theta and args.rope_scaling.type != "none" and any(
                args.sliding(i) for i in range(args.n_layers)):
            raise ValueError("a Gemma 3 config.json gives its sliding layers unscaled RoPE: set "
                             "model.local_rope_theta to write this model's scaled RoPE on every layer")
        types = ["sliding_attention" if args.sliding(i) else "full_attention" for i in range(args.n_layers)]
        cfg.pop("hidden_act", None)
        cfg.update(hidden_activation=next(h for h, ours in ACTIVATIONS.items() if ours == args.activation),
                   query_pre_attn_scalar=_number(args.query_pre_attn_scalar or args.head_dim),
                   sliding_window=args.window or None, rope_local_base_freq=local, layer_types=types,
                   attn_logit_softcapping=None, final_logit_softcapping=None)
        pattern = next((p for p in range(1, args.n_layers + 1) if types == self._layer_types(
            {"sliding_window_pattern": p, "num_hidden_layers": args.n_layers})), None)
        if pattern is None:
            cfg.pop("sliding_window_pattern", None)
        else:  # transformers before layer_types (4.50-4.52) reads the pattern
            cfg["sliding_window_pattern"] = pattern


def _number(v: float):
    """``v`` as config.json has it: an int when whole."""
    return int(v) if float(v).is_integer() else v


FAMILY = Gemma3()
