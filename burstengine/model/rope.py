"""Rotary position embeddings and the ways of stretching them to a longer context.

The tables are computed from the *global* positions of the tokens a rank holds (any CP layout,
or positions restarting per packed document), in float64: at positions near 1M a float32
product of position and frequency is off by ~0.1 rad.

Scaling (``ModelArgs.rope_scaling``), each the same function of its parameters as transformers'
``ROPE_INIT_FUNCTIONS`` (modeling_rope_utils.py), which the tests compare against:

* ``linear`` (position interpolation): frequencies / factor.
* ``dynamic`` (NTK-aware): theta raised for a sequence longer than the original context M:
  theta' = theta * (factor * L / M - (factor - 1)) ** (d / (d - 2)) with L = max(length, M).
  transformers recomputes it from max(position_ids) + 1 of the batch it sees; here the length
  is the *global* one, the same on every rank: the longest document when documents are packed
  (what max(position) + 1 is when positions restart per document), else the whole sequence.
* ``yarn``: frequencies blended between interpolated and original over the band of wavelengths
  set by beta_fast / beta_slow, and cos/sin multiplied by an attention factor (0.1 ln(factor) + 1
  unless given, or the DeepSeek mscale / mscale_all_dim form).
* ``llama3`` (Llama 3.1): long wavelengths / factor, short ones kept, a smooth blend between
  (low_freq_factor, high_freq_factor).
* ``longrope`` (Phi-3): each frequency divided by its own factor, from ``long_factor`` when the
  sequence is longer than the original context M, else from ``short_factor`` (head_dim / 2 of
  each); cos/sin multiplied by sqrt(1 + ln(factor) / ln(M)) unless an attention factor is given.
  transformers switches on max(position_ids) + 1 of the batch it sees, so the length is the
  global one here as under ``dynamic``; a decode step switches on its token's position + 1, the
  keys cached before the switch staying as they were.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

ROPE_TYPES = ("none", "linear", "dynamic", "yarn", "llama3", "longrope")
# the types whose frequencies depend on the sequence's length (a decode step recomputes them)
FOLLOW_LENGTH = ("dynamic", "longrope")


@dataclass
class RopeScaling:
    """How RoPE is stretched; ``type="none"`` leaves it alone.  Field names are transformers'
    ``rope_parameters`` keys (0 stands for "not set" where transformers has None)."""

    type: str = "none"                       # none, linear, dynamic, yarn, llama3, longrope
    factor: float = 1.0                      # context stretch (all types; longrope: sets the attention factor)
    original_max_position_embeddings: int = 0  # pretraining context; 0 = model.max_position_embeddings
    low_freq_factor: float = 1.0             # llama3
    high_freq_factor: float = 4.0            # llama3
    beta_fast: float = 32.0                  # yarn: extrapolation edge of the ramp (rotations)
    beta_slow: float = 1.0                   # yarn: interpolation edge of the ramp
    attention_factor: float = 0.0            # yarn, longrope: cos/sin multiplier; 0 = from factor (and mscale)
    mscale: float = 0.0                      # yarn, DeepSeek form (with mscale_all_dim); 0 = unused
    mscale_all_dim: float = 0.0
    truncate: bool = True                    # yarn: round the ramp's edges to whole dimensions
    short_factor: list[float] = field(default_factory=list)  # longrope: per-frequency divisors up to M tokens
    long_factor: list[float] = field(default_factory=list)   # longrope: ... beyond M tokens

    def validate(self, max_position_embeddings: int = 0, head_dim: int = 0) -> None:
        """A ValueError naming the first bad field; ``head_dim`` (when known) sizes longrope's factors."""
        if self.type not in ROPE_TYPES:
            raise ValueError(f"model.rope_scaling.type must be one of {list(ROPE_TYPES)}, got {self.type!r}")
        if self.type == "none":
            return
        if self.type == "longrope":  # its factor only sets the attention factor (1 for a factor <= 1, as transformers)
            if not 0 < self.factor < math.inf:
                raise ValueError(f"model.rope_scaling.factor must be > 0 for 'longrope', got {self.factor}")
        elif not self.factor >= 1.0:
            raise ValueError(f"model.rope_scaling.factor must be >= 1 for {self.type!r}, got {self.factor}")
        if self.type in ("dynamic", "yarn", "llama3", "longrope") and self.original(max_position_embeddings) < 1:
            raise ValueError(f"rope scaling {self.type!r} needs the original context length: set "
                             f"model.rope_scaling.original_max_position_embeddings (or model.max_position_embeddings)")
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(f"llama3 rope scaling needs high_freq_factor > low_freq_factor > 0, got "
                             f"{self.high_freq_factor} and {self.low_freq_factor}")
        if self.type == "yarn" and not self.beta_fast > self.beta_slow > 0:
            raise ValueError(f"yarn rope scaling needs beta_fast > beta_slow > 0, got {self.beta_fast} and "
                             f"{self.beta_slow}")
        if self.type == "longrope":
            self._validate_longrope(head_dim)

    def _validate_longrope(self, head_dim: int) -> None:
        want = head_dim // 2 if head_dim else max(len(self.short_factor), 1)  # one factor per frequency
        for name in ("short_factor", "long_factor"):
            v = getattr(self, name)
            ok = isinstance(v, (list, tuple)) and len(v) == want and all(
                isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf for x in v)
            if not ok:
                got = f"{len(v)} value(s)" if isinstance(v, (list, tuple)) else repr(v)
                raise ValueError(f"longrope rope scaling needs model.rope_scaling.{name}: {want} numbers > 0 (head "
                                 f"dim / 2), got {got}")
        if not 0 <= self.attention_factor < math.inf:
            raise ValueError(f"model.rope_scaling.attention_factor must be >= 0 (0 = from factor), got "
                             f"{self.attention_factor}")

    def original(self, max_position_embeddings: int = 0) -> int:
        return self.original_max_position_embeddings or max_position_embeddings

    @property
    def follows_length(self) -> bool:
        """Whether the frequencies depend on the sequence's length (dynamic, longrope)."""
        return self.type in FOLLOW_LENGTH


def inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None, max_position_embeddings: int = 0,
             seq_len: int = 0, device=None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (head_dim / 2,) float64, attention factor) for RoPE with base ``theta``
    under ``scaling``.  ``seq_len``: the global sequence length (dynamic and longrope scaling only)."""
    d = head_dim
    exps = torch.arange(0, d, 2, device=device, dtype=torch.float64) / d
    kind = "none" if scaling is None else scaling.type
    if kind == "none":
        return 1.0 / theta ** exps, 1.0
    s = scaling
    M = s.original(max_position_embeddings)
    if kind == "linear":
        return 1.0 / theta ** exps / s.factor, 1.0
    if kind == "dynamic":
        L = max(seq_len, M)
        base = theta * ((s.factor * L / M) - (s.factor - 1)) ** (d / (d - 2))
        return 1.0 / base ** exps, 1.0
    if kind == "yarn":
        return _yarn(d, theta, s, M, exps)
    if kind == "llama3":
        inv = 1.0 / theta ** exps
        low_wavelen, high_wavelen = M / s.low_freq_factor, M / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (M / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "longrope":
        ext = torch.tensor(s.long_factor if seq_len > M else s.short_factor, dtype=torch.float64, device=device)
        attn = s.attention_factor or (1.0 if s.factor <= 1 else math.sqrt(1 + math.log(s.factor) / math.log(M)))
        return 1.0 / (ext * theta ** exps), float(attn)
    raise ValueError(f"unknown rope scaling type {kind!r}; expected one of {list(ROPE_TYPES)}")


def _yarn(d: int, theta: float, s: RopeScaling, M: int, exps: torch.Tensor) -> tuple[torch.Tensor, float]:
    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn = s.attention_factor
    if not attn:
        attn = mscale(s.factor, s.mscale) / mscale(s.factor, s.mscale_all_dim) if s.mscale and s.mscale_all_dim \
            else mscale(s.factor)

    def correction_dim(rotations):
        return (d * math.log(M / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = ((torch.arange(d // 2, dtype=torch.float64, device=exps.device) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** exps
    extrapolate = 1 - ramp  # share of the original frequency kept, per dimension pair
    inv = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attn)


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling | None = None,
                max_position_embeddings: int = 0, seq_len: int = 0):
    """cos, sin (float64, shape (n, head_dim)) for integer global ``positions`` (n,), already
    multiplied by the scaling's attention factor (as transformers does)."""
    inv, attn = inv_freq(head_dim, theta, scaling, max_position_embeddings, seq_len, device=positions.device)
    return tables_from_inv(positions, inv, attn)


def tables_from_inv(positions: torch.Tensor, inv: torch.Tensor, attn: float = 1.0):
    """cos, sin (float64, (n, 2 * len(inv))) for ``positions`` (n,) from :func:`inv_freq`'s
    output: what :func:`rope_tables` computes once the frequencies are known (a decode step
    captured in a CUDA graph keeps them in a device buffer)."""
    ang = positions.to(torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=-1)
    if attn == 1.0:
        return ang.cos(), ang.sin()
    return ang.cos() * attn, ang.sin() * attn
