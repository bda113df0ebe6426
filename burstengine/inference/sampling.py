"""Choosing the next token from next-token logits: greedy, or sampling with temperature, top-k
and top-p, in transformers' order (temperature, then top-k, then top-p).

Sampling draws one uniform number per sequence from a CPU generator seeded once per
generation and inverts the cumulative distribution in float64, so the token depends
continuously on the probabilities: logits that differ only by rounding (a different number of
ranks merges the attention in a different order) give the same token unless a draw falls
within that rounding of a boundary.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Sampling:
    """``temperature`` 0 (default) is greedy: the highest logit, the lowest id on ties.  ``top_k``
    0 and ``top_p`` 1.0 keep every token.  ``eos`` ids end a sequence (the stop token is kept
    in its output)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    eos: tuple[int, ...] = field(default_factory=tuple)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def check(self, vocab: int) -> str | None:
        """A message for settings that cannot work with a ``vocab``-token model, else None."""
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            return f"temperature must be a finite number >= 0 (0: greedy), got {t!r}"
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            return f"top_k must be an int >= 0 (0: off), got {self.top_k!r}"
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p <= 1.0:
            return f"top_p must be in (0, 1] (1: off), got {p!r}"
        if self.greedy and (self.top_k or p < 1.0):
            return "top_k / top_p need a temperature > 0 (temperature 0 is greedy)"
        bad = [e for e in self.eos if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < vocab]
        if bad:
            return f"stop token ids must be ints in [0, {vocab}), got {bad}"
        return None

    def generator(self) -> torch.Generator:
        return torch.Generator().manual_seed(self.seed)


def filtered_logits(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """float64 (B, V) logits / temperature with what top-k and top-p remove set to -inf."""
    x = logits.double() / s.temperature
    V = x.shape[-1]
    if s.top_k and s.top_k < V:
        kth = torch.topk(x, s.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if s.top_p < 1.0:
        # keep the smallest set of most likely tokens whose probability reaches top_p: a token
        # stays when the probability of the tokens before it (in descending order) is below top_p
        srt, idx = torch.sort(x, dim=-1, descending=True, stable=True)
        p = torch.softmax(srt, dim=-1)
        before = p.cumsum(-1) - p
        drop = before >= s.top_p
        drop[:, 0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(-1, idx, drop), float("-inf"))
    return x


def choose(logits: torch.Tensor, s: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    """(B,) int64 next tokens (on the CPU) from float (B, V) logits."""
    if s.greedy:  # on the logits' device: B ids cross to the host, not B x V floats
        return logits.detach().argmax(-1).cpu()
    logits = logits.detach().to("cpu")
    x = filtered_logits(logits, s)
    cdf = torch.softmax(x, dim=-1).cumsum(-1)
    u = torch.rand(x.shape[0], 1, generator=gen, dtype=torch.float64) * cdf[:, -1:]
    # the first token whose cumulative probability exceeds u (a removed token adds nothing)
    tok = torch.searchsorted(cdf, u, right=True).squeeze(1)
    return tok.clamp_max(x.shape[-1] - 1)
