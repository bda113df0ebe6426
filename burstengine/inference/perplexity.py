"""Perplexity over context length: the loss of a token stream cut into windows of L tokens, each
window prefilled across the ranks as one sequence (BurstAttention; any length the ranks hold).

A window starting at token ``a`` feeds tokens[a : a + L] and predicts tokens[a + 1 : a + L + 1];
the predictions it *scores* are set by the stride s (1 <= s <= L):

* ``s = L`` (the default, non-overlapping windows): every prediction of every window, so each
  token of the stream is scored exactly once, at a cost of one prefill per L tokens; a token's
  context is what precedes it in its window, from 0 to L - 1 tokens (L / 2 on average).
* ``s < L`` (sliding windows, the protocol of the position-interpolation and YaRN papers with
  s = 256): the first window scores all L, every later one (s tokens further) only its last s,
  so every token after the first window is scored once with at least L - s tokens of context,
  at L / s times the cost.

Only full windows are taken (a stream shorter than L + 1 tokens has none at L), so every point of
a curve is measured at its length.  The loss never forms the N x vocab logits: the LM head runs a
chunk of rows at a time (:func:`nll_sum`) on each rank's own tokens, and one sum over the ranks
gives every rank the total.  Perplexity = exp(summed loss / scored tokens).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..comm.dist import rank_of, world_of
from ..layout import position_ids as layout_positions
from ..layout import shard
from .engine import context_parallel, padded_length
from .models import PrefillModel

IGNORE = -100
# float32 logits of one chunk of rows: at most this many bytes (a 128K vocabulary: 512 rows)
LOGITS_BYTES = 256 << 20


def windows(n_tokens: int, length: int, stride: int | None = None, limit: int | None = None) -> list[tuple[int, int]]:
    """(start, scored) of each window of ``length`` over a stream of ``n_tokens``: its inputs are
    tokens[start : start + length], its last ``scored`` predictions count; at most ``limit``
    windows (None: all).  A ValueError when no window fits or the stride is out of [1, length]."""
    stride = length if stride is None else stride
    if not 1 <= stride <= length:
        raise ValueError(f"the stride must be in [1, {length}] (the window's length), got {stride}")
    if n_tokens < length + 1:
        raise ValueError(f"{n_tokens} tokens are fewer than one window of {length} + 1")
    starts = range(0, n_tokens - length, stride)
    out = [(a, length if a == 0 else stride) for a in starts]
    return out if limit is None else out[:limit]


def window_batch(tokens: torch.Tensor, wins: list[tuple[int, int]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels), each (len(wins), length), of windows ``wins`` of the 1-D ``tokens``;
    the labels of predictions a window does not score are IGNORE."""
    ids = torch.stack([tokens[a:a + length] for a, _ in wins])
    labels = torch.stack([tokens[a + 1:a + length + 1] for a, _ in wins]).clone()
    for i, (_, scored) in enumerate(wins):
        labels[i, :length - scored] = IGNORE
    return ids, labels


def nll_sum(model: PrefillModel, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy (float64) of hidden rows ``h`` (N, dim) against ``labels`` (N,),
    the LM head applied a chunk of rows at a time (float32 logits of at most LOGITS_BYTES)."""
    rows = max(1, LOGITS_BYTES // (4 * model.vocab_size))
    total = torch.zeros((), dtype=torch.float64, device=h.device)
    keep = labels != IGNORE
    h, labels = h[keep], labels[keep]  # rows no prediction is scored on never meet the head
    for a in range(0, h.shape[0], rows):
        logits = model.logits(h[a:a + rows])
        total += F.cross_entropy(logits, labels[a:a + rows], reduction="sum").double()
    return total


@torch.no_grad()
def window_nll(model: PrefillModel, ids: torch.Tensor, labels: torch.Tensor, group=None, layout: str = "zigzag",
               kernel: str | None = None, chunk: int | None = None) -> tuple[float, int]:
    """(summed loss, scored predictions) of windows ``ids`` / ``labels`` (B, L), the same on
    every rank of ``group``: each rank runs its shard of every window and scores its own rows."""
    rank, world = rank_of(group), world_of(group)
    B, L = ids.shape
    S = padded_length(L, layout, world)
    if S > L:  # pad at the end: no real token sees a pad token, and pads score nothing
        ids = torch.cat([ids, ids.new_zeros(B, S - L)], dim=1)
        labels = torch.cat([labels, labels.new_full((B, S - L), IGNORE)], dim=1)
    dev = model.device
    pos = layout_positions(S, layout, rank, world).to(dev)
    h = model.hidden(shard(ids, layout, rank, world).to(dev), pos, context_parallel("burst", group, layout,
                                                                                       kernel=kernel), chunk=chunk)
    mine = shard(labels, layout, rank, world).to(dev)
    out = torch.stack([nll_sum(model, h.flatten(0, 1), mine.flatten()),
                       (mine != IGNORE).sum().double()])
    if world > 1:
        dist.all_reduce(out, group=group)
    return float(out[0]), int(out[1])


def perplexity(model: PrefillModel, tokens: torch.Tensor, length: int, stride: int | None = None, batch: int = 1,
               limit: int | None = None, group=None, layout: str = "zigzag", kernel: str | None = None,
               chunk: int | None = None, on_batch=None) -> dict:
    """Perplexity of the 1-D ``tokens`` (the same on every rank) at window ``length``:
    {"length", "stride", "windows", "tokens" (scored), "nll" (summed), "loss" (mean), "ppl"}.
    ``batch`` windows per prefill; ``on_batch(done, total)`` after each."""
    wins = windows(len(tokens), length, stride, limit)
    nll, count = 0.0, 0
    for i in range(0, len(wins), batch):
        ids, labels = window_batch(tokens, wins[i:i + batch], length)
        n, c = window_nll(model, ids, labels, group, layout, kernel, chunk)
        nll, count = nll + n, count + c
        if on_batch is not None:
            on_batch(min(i + batch, len(wins)), len(wins))
    loss = nll / count
    return {"length": length, "stride": stride or length, "windows": len(wins), "tokens": count, "nll": nll,
            "loss": loss, "ppl": math.exp(loss)}


def curve(results: list[dict], path: str, title: str) -> None:
    """Perplexity against window length (log-2 axis), each point annotated; written to ``path``."""
    import matplotlib  # optional dependency (the plot extra): only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency (the plot extra): only for the figure

    xs, ys = [r["length"] for r in results], [r["ppl"] for r in results]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot(xs, ys, "o-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [f"{n >> 10}K" if n % 1024 == 0 else str(n) for n in xs])
    for x, y in zip(xs, ys):
        ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set(xlabel="context length (tokens per window)", ylabel="perplexity")
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
