"""The shape of a decoder (:class:`ModelArgs`) and the named shapes it is built in (:data:`PRESETS`).

The variations of the Llama 2/3, Qwen2/3 and Mistral families are options of :class:`ModelArgs`
(q/k/v biases, per-head q/k RMSNorm, a head width that is not dim / heads, tied embeddings, a
sliding window, scaled RoPE: :mod:`.rope`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from .families import ARCHS  # ModelArgs.arch's values: the registry's families
from .rope import RopeScaling

_ZERO_MEANS_UNSET = ("head_size", "window", "max_position_embeddings")


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
    max_position_embeddings: int = 0  # the context the weights were trained for (config.json); 0 = unknown
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)  # context extension (see model/rope.py)

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

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
        self.rope_scaling.validate(self.max_position_embeddings)

    def num_params(self, embedding: bool = True) -> int:
        d, L, V, f = self.dim, self.n_layers, self.vocab_size, self.ffn_dim
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        block = d * q * 2 + d * kv * 2 + 3 * d * f + 2 * d
        block += (q + 2 * kv) * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        head = 0 if self.tie_embeddings else V * d
        return L * block + d + head + (V * d if embedding else 0)

    def flops_per_token(self, seq_len: int, causal: bool = True) -> float:
        """Training FLOPs per token (forward + backward), as docs/design.md ("FLOP conventions") defines them for MFU:
        6 x (non-embedding params + LM head) + 6 (causal; 12 full) x n_layers x dim x seq."""
        dense = self.num_params(embedding=False) + (self.vocab_size * self.dim if self.tie_embeddings else 0)
        return 6.0 * dense + (6.0 if causal else 12.0) * self.n_layers * self.dim * seq_len


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
