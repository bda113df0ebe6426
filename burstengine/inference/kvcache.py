"""A KV cache that stays sharded over the ranks of a context-parallel group.

After a sharded prefill every rank keeps its own prompt tokens' keys and values, for every
layer; nothing is gathered.  A decode step's query attends to each rank's shard there (a
partial output and its log-sum-exp), and :func:`merge` combines the partials exactly: the
online-softmax merge of BurstAttention's ring, over ranks instead of ring steps.  The new
token's K/V go to one rank only, the one :func:`next_owner` names.

Balance.  Every rank knows every shard's length (the prefill's shards follow from the layout
and the prompt lengths, and each step's owner from the lengths), so the owner costs no
communication.  The owner is the rank with the shortest shard, the lowest such rank on ties.
With d the longest minus the shortest shard: a step never makes d larger than max(d, 1), and
while d > 1 every step shortens the gap of the rank it fills, so d reaches 1 after at most the
shards' total deficit (sum over ranks of longest - length) steps and stays <= 1 from then on.
The prefill's shards differ only by the padded slots dropped (below), fewer than 2 x world.

Layout of a layer's buffers: (batch, kv_heads, capacity, head_dim), so the keys a step reads
are one strided view with contiguous rows (a matmul or an attention kernel reads them in
place).  Capacity is the prefill's slots plus exactly the appends this rank will receive in
``max_new_tokens`` steps, so an append never reallocates.  Per slot and sequence the cache
keeps the token's global position (for a sliding window) and whether it is a real token of
that sequence: a batch of prompts of different lengths is padded at the end to one length, and
slots past a sequence's own length hold pad tokens that it must never see.  Slots that are
padding for every sequence are dropped at prefill.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

try:  # the fused kernel that returns the log-sum-exp (CUDA, fp16/bf16); math otherwise
    _flash = torch.ops.aten._scaled_dot_product_flash_attention
except (AttributeError, RuntimeError):  # pragma: no cover
    _flash = None


# torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns there)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def next_owner(lengths: list[int]) -> int:
    """The rank whose shard is shortest (the lowest such rank on ties)."""
    return min(range(len(lengths)), key=lambda r: (lengths[r], r))


def appends(lengths: list[int], steps: int) -> list[int]:
    """How many of ``steps`` appends each rank receives, starting from shard ``lengths``."""
    n = list(lengths)
    got = [0] * len(n)
    for _ in range(steps):
        r = next_owner(n)
        n[r] += 1
        got[r] += 1
    return got


class ShardedKVCache:
    """This rank's shard of every layer's keys and values, and its slots' positions and
    visibility.  ``lengths`` is every rank's shard length (the same list on every rank)."""

    def __init__(self, n_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int, lengths: list[int],
                 rank: int, dtype, device):
        self.rank, self.lengths = rank, list(lengths)
        self.capacity = capacity
        self.k = [torch.empty(batch, kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.empty_like(t) for t in self.k]
        self.pos = torch.zeros(batch, capacity, dtype=torch.int64, device=device)
        self.visible = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        self.all_visible = True   # no slot is hidden from any sequence (the fused kernel needs no mask)
        self.min_pos = None       # the smallest position held here (host int; for the window)
        self.owner = None         # the rank storing the current decode step's token

    @property
    def n(self) -> int:
        return self.lengths[self.rank]

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None) -> None:
        """The prefill's (B, n, kv_heads, head_dim) K/V of this rank's tokens, the slots
        ``keep`` (a row index, None: all) only."""
        if keep is not None:
            k, v = k[:, keep], v[:, keep]
        m = k.shape[1]
        self.k[layer][:, :, :m].copy_(k.transpose(1, 2))
        self.v[layer][:, :, :m].copy_(v.transpose(1, 2))

    def set_slots(self, pos: torch.Tensor, visible: torch.Tensor, all_visible: bool) -> None:
        """Positions (B, n) and visibility (B, n) of the prefill's kept slots."""
        m = pos.shape[1]
        self.pos[:, :m] = pos
        self.visible[:, :m] = visible
        self.all_visible = all_visible
        self.min_pos = int(pos.min()) if m else None

    def begin_step(self, owner: int, pos: torch.Tensor, pos_min: int) -> None:
        """A decode step whose token (positions (B,), the smallest ``pos_min``) ``owner``
        stores, in its slot n."""
        self.owner = owner
        if owner == self.rank:
            self.pos[:, self.n] = pos
            self.visible[:, self.n] = True
            self.min_pos = pos_min if self.min_pos is None else min(self.min_pos, pos_min)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's (B, kv_heads, head_dim) K/V of ``layer``, written on the owner only."""
        if self.owner == self.rank:
            self.k[layer][:, :, self.n].copy_(k)
            self.v[layer][:, :, self.n].copy_(v)

    def end_step(self) -> None:
        self.lengths[self.owner] += 1
        self.owner = None

    def attend(self, layer: int, q: torch.Tensor, qpos: torch.Tensor, qpos_max: int, window: int | None, scale: float):
        """(out (B, H, D) float32, lse (B, H) float32) of the queries (B, H, D) at positions
        ``qpos`` (B,) over this rank's slots; lse = -inf (and out 0) where none is visible."""
        n = self.n + (self.owner == self.rank)  # during a step, its owner's new slot counts
        B, H, D = q.shape
        if n == 0:
            return q.new_zeros(B, H, D, dtype=torch.float32), q.new_full((B, H), float("-inf"), dtype=torch.float32)
        k, v = self.k[layer][:, :, :n], self.v[layer][:, :, :n]
        hidden = not self.all_visible or (window is not None and qpos_max - self.min_pos >= window)
        return shard_attention(q, k, v, None if not hidden else self._mask(n, qpos, window), scale)

    def _mask(self, n, qpos, window):
        vis = self.visible[:, :n]
        if window is not None:
            vis = vis & (qpos[:, None] - self.pos[:, :n] < window)
        return vis


_warned = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        import warnings

        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def shard_attention(q, k, v, visible, scale):
    """Attention of one query per sequence and head, q (B, H, D), over keys k, v
    (B, Hkv, n, D) (grouped-query: query head h reads kv head h // (H / Hkv)), with an
    optional (B, n) boolean ``visible``.  Returns float32 (out (B, H, D), lse (B, H))."""
    B, H, D = q.shape
    Hkv, n = k.shape[1], k.shape[2]
    g = H // Hkv
    # the g query heads that share a kv head are g query rows of one head: the cache is read
    # once per kv head, never expanded
    qg = q.reshape(B, Hkv, g, D)
    if visible is None and _flash is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) \
            and D <= 256 and D % 8 == 0:
        try:
            out, lse = _flash(qg, k, v, 0.0, False, False, scale=scale)[:2]
            return out.float().reshape(B, H, D), lse.float().reshape(B, H)
        except RuntimeError as e:  # this build / device lacks it: the exact math below, slower
            _warn_once(f"fused decode attention unavailable ({str(e).splitlines()[0][:120]}); using the math path")
    # the math path: exact, in float32; on a GPU it reads the shard as float32 copies (slower
    # than the fused kernel; used where a mask is needed: mixed-length batches, windows)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = torch.matmul(qg.to(acc), k.to(acc).transpose(-1, -2)) * scale  # (B, Hkv, g, n)
    if visible is not None:
        s = s.masked_fill(~visible[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = torch.matmul(p, v.to(acc))
    return out.float().reshape(B, H, D), lse.float().reshape(B, H)


def merge(parts: torch.Tensor):
    """Exact merge of per-rank partial attentions packed as (W, B, H, D + 1) float32: out in
    [..., :D], lse in [..., D].  Returns (out (B, H, D), lse (B, H)).  Deterministic: the same
    operations in rank order on every rank, so every rank gets the same bits."""
    out, lse = parts[..., :-1], parts[..., -1]
    m = lse.max(dim=0).values
    m = torch.where(torch.isfinite(m), m, 0.0)
    w = torch.exp(lse - m)                    # (W, B, H); a rank that sees nothing weighs 0
    den = w.sum(dim=0)
    o = (w[..., None] * out).sum(dim=0) / den[..., None]
    return o, m + torch.log(den)


def gather_merge(out: torch.Tensor, lse: torch.Tensor, group=None):
    """The exact attention over every rank's shard from this rank's (out (B, H, D), lse (B, H)):
    one all-gather of B x H x (D + 1) floats per rank."""
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world == 1:  # one shard: its partial is the whole
        return out, lse
    mine = torch.cat([out, lse[..., None]], dim=-1).contiguous()
    parts = mine.new_empty((world * mine.shape[0],) + tuple(mine.shape[1:]))
    _all_gather(parts, mine, group=group)
    return merge(parts.view((world,) + tuple(mine.shape)))
