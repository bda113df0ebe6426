"""The shape of a decoder (:class:`ModelArgs`) and the named shapes it is built in (:data:`PRESETS`).

The variations of the Llama 2/3, Qwen2/3, Mistral and Gemma 3 families are options of
:class:`ModelArgs` (q/k/v biases, per-head q/k RMSNorm, a head width that is not dim / heads, tied
embeddings, a sliding window on every layer or on some, scaled RoPE: :mod:`.rope`, and Gemma's
RMSNorm, sandwich norms, GeGLU, embedding scale and attention scale), all off by default.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from .families import ARCHS  # ModelArgs.arch's values: the registry's families
from .rope import RopeScaling

_ZERO_MEANS_UNSET = ("head_size", "window", "max_position_embeddings")
ACTIVATIONS = ("silu", "gelu_tanh")  # the MLP's gate: SwiGLU, or GeGLU with GELU's tanh approximation
SLIDING, FULL = "s", "f"  # ModelArgs.window_layers' letters


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    vocab_size: int = 32000
    ffn_dim: int = 11008
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    # the variations of pretrained families (model/hf.py reads them from a config.json)
    arch: str = "llama"              # the HF family the weights are written back as (model/families: ARCHS)
    head_size: int = 0               # width of one head; 0 = dim / n_heads (Qwen3 sets it apart)
    qkv_bias: bool = False           # biases on the q, k, v projections (Qwen2)
    qk_norm: bool = False            # RMSNorm over each head of q and k before RoPE (Qwen3)
    window: int = 0                  # sliding window: each query sees the W most recent keys, itself included
                                     # (Mistral's sliding_window = W); 0 = the whole causal prefix
    window_layers: str = ""          # the layers the window applies to, a letter each: "s" sliding, "f" full
                                     # (Gemma 3's layer_types); "" = every layer
    local_rope_theta: float = 0.0    # RoPE base of the sliding layers, unscaled (Gemma 3's local base); 0 = the
                                     # global RoPE (rope_theta, rope_scaling) on every layer
    norm_plus_one: bool = False      # every RMSNorm scales by 1 + weight (Gemma), not by weight
    sandwich_norm: bool = False      # RMSNorms on the attention and MLP outputs before their residuals (Gemma)
    activation: str = "silu"         # the MLP's gate: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)
    embed_scale: bool = False        # embeddings times sqrt(dim), rounded to the weights' dtype (Gemma)
    query_pre_attn_scalar: float = 0.0  # attention scores scaled by this ** -0.5 (Gemma); 0 = head_dim
    max_position_embeddings: int = 0  # the context the weights were trained for (config.json); 0 = unknown
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)  # context extension (see model/rope.py)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @property
    def softmax_scale(self) -> float | None:
        """The attention scores' scale when it is not head_dim ** -0.5 (None: that default)."""
        return self.query_pre_attn_scalar ** -0.5 if self.query_pre_attn_scalar else None

    def sliding(self, layer: int) -> bool:
        """Whether layer ``layer`` attends within the sliding window (and reads the local RoPE)."""
        return bool(self.window) and (not self.window_layers or self.window_layers[layer] == SLIDING)

    def layer_window(self, layer: int) -> int:
        """The window of layer ``layer`` (0: the whole causal prefix)."""
        return self.window if self.sliding(layer) else 0

    def local_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` reads the sliding layers' RoPE (local_rope_theta)."""
        return bool(self.local_rope_theta) and self.sliding(layer)

    @property
    def context(self) -> int:
        """The longest sequence the weights are meant for: max_position_embeddings, or the original
        context stretched by the RoPE scaling factor when that is longer (a config whose
        max_position_embeddings is the original length); 0 = unknown."""
        m, s = self.max_position_embeddings, self.rope_scaling
        if not m or s.type == "none":
            return m
        return max(m, int(s.factor * s.original(m)))

    @classmethod
    def from_dict(cls, d: dict) -> "ModelArgs":
        """The inverse of dataclasses.asdict (a checkpoint's meta.json); fields it lacks (an older
        checkpoint) keep their defaults."""
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        if isinstance(kw.get("rope_scaling"), dict):
            kw["rope_scaling"] = RopeScaling(**kw["rope_scaling"])
        return cls(**kw)

    def validate(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            least = 0 if f.name in _ZERO_MEANS_UNSET else 1
            if f.type in ("int", int) and v < least:
                raise ValueError(f"model.{f.name} must be >= {least}, got {v}")
        if self.arch not in ARCHS:
            raise ValueError(f"model.arch must be one of {list(ARCHS)}, got {self.arch!r}")
        if not self.head_size and self.dim % self.n_heads:
            raise ValueError(f"model.dim ({self.dim}) must be a multiple of model.n_heads ({self.n_heads}) "
                             f"(or set model.head_size)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head dim = {self.head_dim} must be even for RoPE")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"model.activation must be one of {list(ACTIVATIONS)}, got {self.activation!r}")
        if self.window_layers and (len(self.window_layers) != self.n_layers
                                   or set(self.window_layers) - {SLIDING, FULL}):
            raise ValueError(f"model.window_layers must be empty or one letter per layer ({self.n_layers}), "
                             f"{SLIDING!r} sliding or {FULL!r} full, got {self.window_layers!r}")
        if SLIDING in self.window_layers and not self.window:
            raise ValueError(f"model.window_layers names sliding layers ({self.window_layers!r}) but model.window is 0")
        for name in ("local_rope_theta", "query_pre_attn_scalar"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"model.{name} must be a finite number >= 0 (0 = unset), got {v}")
        self.rope_scaling.validate(self.max_position_embeddings, self.head_dim)

    def num_params(self, embedding: bool = True) -> int:
        d, L, V, f = self.dim, self.n_layers, self.vocab_size, self.ffn_dim
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        block = d * q * 2 + d * kv * 2 + 3 * d * f + 2 * d
        block += (q + 2 * kv) * self.qkv_bias + 2 * self.head_dim * self.qk_norm + 2 * d * self.sandwich_norm
        head = 0 if self.tie_embeddings else V * d
        return L * block + d + head + (V * d if embedding else 0)

    def flops_per_token(self, seq_len: int, causal: bool = True, frozen: bool = False, trained: int = 0) -> float:
        """Training FLOPs per token (forward + backward), as docs/design.md ("FLOP conventions") defines them for MFU:
        6 x (non-embedding params + LM head) + 6 (causal; 12 full) x n_layers x dim x seq.  ``frozen`` (LoRA: the
        base takes no weight gradients): 4 x the base's params + 6 x the ``trained`` (adapter) params."""
        dense = self.num_params(embedding=False) + (self.vocab_size * self.dim if self.tie_embeddings else 0)
        weights = 4.0 * dense + 6.0 * trained if frozen else 6.0 * dense
        return weights + (6.0 if causal else 12.0) * self.n_layers * self.dim * seq_len


# shapes of the BurstEngine paper (§4.1) and of LLaMA-3 8B
PRESETS: dict[str, ModelArgs] = {
    "tiny": ModelArgs(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=352,
                      rope_theta=10000.0),
    # Llama-3.2-3B's shapes
    "llama-3b": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256, ffn_dim=8192,
                          rope_theta=500000.0, tie_embeddings=True),
    "llama-7b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000, ffn_dim=11008),
    "llama-8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256, ffn_dim=14336,
                          rope_theta=500000.0),
    "llama-14b": ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=120000, ffn_dim=13824),
}
