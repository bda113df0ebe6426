"""What every model family shares: the Llama-like config mapping and weight table most inherit.

A family adapter is one file of this package holding a :class:`Family` subclass and its
instance ``FAMILY``, registered by one line in registry.py.  It says

* which HF classes and model_type it reads (``architectures``, ``model_type``) and the name
  ``ModelArgs.arch`` gives it (``name``);
* config.json -> ModelArgs fields (:meth:`Family.model_fields`): the shape fields here, what it
  refuses (:meth:`Family.problems`), its own ModelArgs options (:meth:`Family.options`), its
  rope variant (:meth:`Family.rope`), the values its HF config class assumes for absent keys
  (``defaults``);
* ModelArgs -> config.json (:meth:`Family.hf_config`), with its own keys
  (:meth:`Family.write_options`, :meth:`Family.rope_parameters`); ``expresses`` names the
  ModelArgs options its config.json can carry (registry.writer refuses to write a model that
  uses another);
* its weight-name table (``table``, fused tensors included: :mod:`.table`).

A family's block-level quirks (biases, q/k norms, windows, ...) are ModelArgs options that the
model implements; the adapter only maps them to and from config.json and names their tensors.
Families return ModelArgs fields as a dict: ModelArgs checks ``arch`` against the registry, so
this package cannot import it.
"""
from __future__ import annotations

import re

from ..rope import RopeScaling
from .table import Table, entry

ROPE_FROM_HF = {"default": "none", "linear": "linear", "dynamic": "dynamic", "yarn": "yarn", "llama3": "llama3"}
# buffers some checkpoints carry that our model recomputes
IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def layer(hf: str, *ours: str, rows=None):
    """An entry of every decoder layer: ``model.layers.{i}.<hf>`` <-> ``layers.{i}.<ours>``."""
    return entry(f"model.layers.{{i}}.{hf}", *(f"layers.{{i}}.{o}" for o in ours), rows=rows)


# the Llama-like table: embeddings, final norm, LM head, and per layer two norms, q/k/v/o, SwiGLU
LLAMA_LIKE = (
    entry("model.embed_tokens.weight", "tok_embeddings.weight"),
    entry("model.norm.weight", "norm.weight"),
    entry("lm_head.weight", "output.weight"),
    layer("input_layernorm.weight", "attention_norm.weight"),
    layer("self_attn.q_proj.weight", "attention.wq.weight"),
    layer("self_attn.k_proj.weight", "attention.wk.weight"),
    layer("self_attn.v_proj.weight", "attention.wv.weight"),
    layer("self_attn.o_proj.weight", "attention.wo.weight"),
    layer("post_attention_layernorm.weight", "ffn_norm.weight"),
    layer("mlp.gate_proj.weight", "feed_forward.w1.weight"),
    layer("mlp.down_proj.weight", "feed_forward.w2.weight"),
    layer("mlp.up_proj.weight", "feed_forward.w3.weight"),
)


def full_hf_name(name: str) -> str:
    """``name`` as a causal LM's checkpoint spells it (a bare base model's lacks ``model.``)."""
    return name if name.startswith(("model.", "lm_head.")) else "model." + name


def unexpected(name: str, architectures) -> ValueError:
    return ValueError(f"unexpected tensor {name!r} in the checkpoint: not part of a {'/'.join(architectures)} model")


def context_length(args, seq_len: int = 0) -> int:
    """max_position_embeddings to write: the trained length when it is longer than the model's,
    except under dynamic NTK, where transformers reads it as the *original* length, and under
    LongRoPE, where it sets the attention factor (Phi-3 in transformers 4.x reads it from
    max_position_embeddings / original, whatever rope_scaling.factor says)."""
    if args.rope_scaling.type == "dynamic":
        return args.rope_scaling.original(args.max_position_embeddings)
    if args.rope_scaling.type == "longrope" and args.max_position_embeddings:
        return args.max_position_embeddings
    return max(args.max_position_embeddings, seq_len) or seq_len or 4096


class Family:
    """The Llama-like family: the mapping and table as Llama has them; subclasses change parts."""

    name = ""                  # ModelArgs.arch
    model_type = ""            # config.json's model_type
    title = ""                 # how messages name it ("a Mistral model")
    architectures: tuple[str, ...] = ()  # HF classes read; the first is written back
    expresses: dict[str, str] = {}  # ModelArgs options its config.json carries -> what they are, for messages
    table = Table(LLAMA_LIKE)
    rope_types = ROPE_FROM_HF  # HF rope_type -> RopeScaling.type
    # what the HF config class assumes when config.json lacks a key
    defaults = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False}

    # --- config.json -> ModelArgs ---------------------------------------------------------------

    def problems(self, cfg: dict) -> list[str]:
        """What in ``cfg`` burstengine's model does not implement (an empty list: nothing)."""
        out = []
        if cfg.get("hidden_act", "silu") != "silu":
            out.append(f"hidden_act={cfg['hidden_act']!r}")
        if cfg.get("mlp_bias"):
            out.append("mlp_bias=true")
        return out + self.bias_problems(cfg)

    def bias_problems(self, cfg: dict) -> list[str]:
        # Llama's (Qwen3's, Mistral's) attention_bias puts a bias on o_proj too, which ours lacks
        return ["attention_bias=true"] if cfg.get("attention_bias") else []

    def options(self, cfg: dict) -> dict:
        """The family's own ModelArgs fields for ``cfg`` (its keys: ``expresses``)."""
        return {}

    def rope(self, cfg: dict, where: str) -> tuple[float, RopeScaling]:
        """(rope_theta, RopeScaling) of ``cfg``, or a ValueError naming what is not supported."""
        # transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; 4.x wrote rope_theta and
        # rope_scaling at the top level
        params = dict(cfg.get("rope_parameters") or {})
        params.update(cfg.get("rope_scaling") or {})
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        kind = params.get("rope_type") or params.get("type") or "default"
        if kind not in self.rope_types:
            raise ValueError(f"{where}: rope type {kind!r} is not supported; expected one of {sorted(self.rope_types)}")
        if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ValueError(f"{where}: partial_rotary_factor != 1 is not supported")
        s = RopeScaling(type=self.rope_types[kind])
        if s.type == "none":
            return theta, s
        for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor",
                    "mscale", "mscale_all_dim"):
            if params.get(key) is not None:
                setattr(s, key, float(params[key]))
        if params.get("original_max_position_embeddings") is not None:
            s.original_max_position_embeddings = int(params["original_max_position_embeddings"])
        if params.get("truncate") is not None:
            s.truncate = bool(params["truncate"])
        for key in ("short_factor", "long_factor"):
            if params.get(key) is not None:
                setattr(s, key, params[key])  # validated with the model's head dim (ModelArgs.validate)
        if s.type == "longrope" and params.get("factor") is None:
            # transformers: the attention factor's stretch is the context over the original one
            context = int(cfg.get("max_position_embeddings") or 0)
            s.factor = context / max(s.original(context), 1)
        if s.type == "dynamic":  # transformers' dynamic NTK uses max_position_embeddings as the original length
            s.original_max_position_embeddings = int(cfg.get("max_position_embeddings") or 0)
        return theta, s

    def model_fields(self, cfg: dict, where: str = "config.json") -> dict:
        """ModelArgs fields of ``cfg``, or a ValueError saying what is not supported."""
        problems = self.problems(cfg)
        if problems:
            raise ValueError(f"{where}: this {self.name} checkpoint has {', '.join(problems)}, which burstengine's "
                             f"model does not implement")
        theta, scaling = self.rope(cfg, where)
        dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        head = cfg.get("head_dim") or dim // heads
        value = {**self.defaults, **cfg}
        return dict(dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=heads,
                    n_kv_heads=cfg.get("num_key_value_heads") or heads, vocab_size=cfg["vocab_size"],
                    ffn_dim=cfg["intermediate_size"], norm_eps=float(value["rms_norm_eps"]), rope_theta=theta,
                    tie_embeddings=bool(value["tie_word_embeddings"]), arch=self.name,
                    head_size=0 if head * heads == dim else head,
                    max_position_embeddings=int(cfg.get("max_position_embeddings") or 0), rope_scaling=scaling,
                    **self.options(cfg))

    # --- ModelArgs -> config.json ---------------------------------------------------------------

    def rope_parameters(self, args) -> dict | None:
        """transformers' rope_scaling dict for ``args``' scaling (None: plain RoPE)."""
        s = args.rope_scaling
        if s.type == "none":
            return None
        out = {"rope_type": s.type, "factor": s.factor}
        if s.type == "yarn":
            out.update(original_max_position_embeddings=s.original(args.max_position_embeddings),
                       beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate)
            for key in ("attention_factor", "mscale", "mscale_all_dim"):
                if getattr(s, key):
                    out[key] = getattr(s, key)
        elif s.type == "llama3":
            out.update(original_max_position_embeddings=s.original(args.max_position_embeddings),
                       low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
        elif s.type == "longrope":
            M = s.original(args.max_position_embeddings)
            out.update(short_factor=list(s.short_factor), long_factor=list(s.long_factor),
                       original_max_position_embeddings=M)
            if args.max_position_embeddings and s.factor == args.max_position_embeddings / M:
                del out["factor"]  # as checkpoints have it: transformers derives it from the context
            if s.attention_factor:
                out["attention_factor"] = s.attention_factor
        return out

    def write_options(self, args, cfg: dict) -> None:
        """Write the family's own keys for ``args`` into ``cfg``."""

    def hf_config(self, args, seq_len: int = 0, base: dict | None = None, dtype: str | None = None) -> dict:
        """config.json for ``args``: ``base`` (the source directory's config, keeping its token ids
        and other keys) with the shape, rope settings and context written over it.  Rope settings
        are written as ``rope_theta`` / ``rope_scaling``, which transformers 4.x and 5.x both read."""
        cfg = dict(base or {})
        for key in ("rope_parameters", "rope_scaling", "rope_theta", "transformers_version", "torch_dtype", "dtype"):
            cfg.pop(key, None)
        cfg.update(architectures=[self.architectures[0]], model_type=self.model_type, hidden_size=args.dim,
                   num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads,
                   num_key_value_heads=args.n_kv_heads, head_dim=args.head_dim, vocab_size=args.vocab_size,
                   intermediate_size=args.ffn_dim, rms_norm_eps=args.norm_eps, hidden_act="silu",
                   tie_word_embeddings=args.tie_embeddings, rope_theta=args.rope_theta,
                   rope_scaling=self.rope_parameters(args), max_position_embeddings=context_length(args, seq_len))
        self.write_options(args, cfg)
        if dtype:
            cfg["torch_dtype"] = dtype
        return cfg

    # --- tensor names ---------------------------------------------------------------------------

    def ours_of(self, hf_name: str) -> tuple[str, ...] | None:
        """Our parameters HF tensor ``hf_name`` holds (several: a fused one); None: a buffer our
        model recomputes; a ValueError for a tensor this family does not have."""
        name = full_hf_name(hf_name)
        if IGNORED.search(name):
            return None
        ours = self.table.ours_of(name)
        if ours is None:
            raise unexpected(name, self.architectures)
        return ours

    def hf_of(self, name: str) -> str:
        """The HF tensor holding our parameter ``name`` (whole, or a part of a fused one)."""
        hf = self.table.hf_of(name)
        if hf is None:
            raise ValueError(f"no HF name for {name!r}")
        return hf
