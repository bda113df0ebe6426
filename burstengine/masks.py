"""The mask vocabulary: what a query may see, in the words every layer shares.

* mask kinds of one block, understood by every kernel: FULL, CAUSAL, STRICT (:data:`MASKS`);
* :class:`Pattern`: the visibility of a whole call over global positions (causal, sliding
  window, packed documents, block-sparse), what the schedule plans from;
* :class:`MaskSpec`: the visibility inside one (q block, kv block) pair for anything the kinds
  cannot say, what the schedule hands the kernels.

Plain data and torch only: the ground floor every other part imports from.
"""
from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass, field

import torch

# mask kinds understood by every kernel (kernels/base.py)
FULL = "full"        # every query sees every key
CAUSAL = "causal"    # square block, query i sees keys j <= i (top-left aligned)
STRICT = "strict"    # square block, query i sees keys j < i (striped: key rank after query rank)
MASKS = (FULL, CAUSAL, STRICT)



@dataclass(frozen=True, eq=False)
class Pattern:
    """Visibility of (query at global position p, key at global position t): all of

    * ``causal``: t <= p
    * ``window`` W (needs causal): p - t < W, i.e. the W most recent keys, the query's own included
    * ``cu_seqlens`` (0 = c_0 <= c_1 <= ... = S, a tuple): p and t in the same document
      [c_i, c_{i+1}); causal within it when ``causal``
    * ``block_mask`` (bool CPU tensor (S/bs, S/bs), bs = ``block_size``): block (p // bs, t // bs)
      is on; may be combined with ``causal`` only

    Two patterns are equal when they describe the same mask (the block mask by content), so
    the schedule can be cached across calls and layers.
    """

    causal: bool = False
    window: int | None = None
    cu_seqlens: tuple[int, ...] | None = None
    block_mask: torch.Tensor | None = None
    block_size: int = 0
    key: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        bm = None
        if self.block_mask is not None:
            m = self.block_mask.to(torch.bool).contiguous()
            object.__setattr__(self, "block_mask", m)
            bm = (tuple(m.shape), hashlib.blake2b(m.numpy().tobytes(), digest_size=16).hexdigest())
        object.__setattr__(self, "key", (self.causal, self.window, self.cu_seqlens, bm, self.block_size))

    def __eq__(self, other):
        return isinstance(other, Pattern) and self.key == other.key

    def __hash__(self):
        return hash(self.key)

    @property
    def sparse(self) -> bool:
        return self.window is not None or self.cu_seqlens is not None or self.block_mask is not None


def as_pattern(mask) -> Pattern:
    """A Pattern from a Pattern or a bool (the causal flag)."""
    return mask if isinstance(mask, Pattern) else Pattern(causal=bool(mask))


@dataclass(frozen=True, eq=False)
class MaskSpec:
    """Visibility of (query row i, key row j) in one block, from global positions.

    Row i of the q block is global position ``q_start + i * q_step``; row j of the k block is
    ``k_start + j * k_step`` (every layout's block pairs are affine in this way, striped
    included).  A pair is visible when all of these hold:

    * ``causal``: q_pos >= k_pos
    * ``window`` W: q_pos - k_pos < W (with causal: the W most recent keys, itself included)
    * ``q_doc``/``k_doc`` (int tensors, one document id per row, non-decreasing): same document
    * ``block_mask`` (bool (ceil(Sq/bs), ceil(Sk/bs)), bs = ``block_size`` local rows): the
      block of (i // bs, j // bs) is on

    FULL is ``MaskSpec()``, CAUSAL ``MaskSpec(causal=True)``, STRICT ``MaskSpec(causal=True,
    k_start=1)``.
    """

    causal: bool = False
    q_start: int = 0
    q_step: int = 1
    k_start: int = 0
    k_step: int = 1
    window: int | None = None
    q_doc: torch.Tensor | None = None
    k_doc: torch.Tensor | None = None
    block_mask: torch.Tensor | None = None
    block_size: int = 0

    def dense(self, sq: int, sk: int, device) -> torch.Tensor | None:
        """Boolean (sq, sk) visibility, None when everything is visible."""
        vis = None

        def both(m):
            return m if vis is None else vis & m

        if self.causal or self.window is not None:
            qp = self.q_start + self.q_step * torch.arange(sq, device=device)
            kp = self.k_start + self.k_step * torch.arange(sk, device=device)
            diff = qp[:, None] - kp[None, :]
            if self.causal:
                vis = both(diff >= 0)
            if self.window is not None:
                vis = both(diff < self.window)
        if self.q_doc is not None:
            vis = both(self.q_doc.to(device)[:, None] == self.k_doc.to(device)[None, :])
        if self.block_mask is not None:
            bs = self.block_size
            bm = self.block_mask.to(device)
            rows = torch.arange(sq, device=device) // bs
            cols = torch.arange(sk, device=device) // bs
            vis = both(bm[rows[:, None], cols[None, :]])
        return vis


def as_spec(mask) -> MaskSpec:
    """The MaskSpec of a mask kind (FULL / CAUSAL / STRICT) or a MaskSpec itself."""
    if isinstance(mask, MaskSpec):
        return mask
    if mask == FULL:
        return MaskSpec()
    if mask == CAUSAL:
        return MaskSpec(causal=True)
    if mask == STRICT:
        return MaskSpec(causal=True, k_start=1)
    raise ValueError(f"unknown mask {mask!r}")


_DERIVED: "weakref.WeakKeyDictionary[MaskSpec, dict]" = weakref.WeakKeyDictionary()


def derived(spec: MaskSpec, key, make):
    """``make()`` for ``spec``, made once per MaskSpec object and ``key`` and kept while the spec
    lives: what kernels derive from a mask (its FULL/CAUSAL pieces, its device-side arguments).
    The schedule caches its tasks, so every layer, pass and step that meets the same block pair
    hands the kernels the same (frozen) spec."""
    per = _DERIVED.setdefault(spec, {})
    if key not in per:
        per[key] = make()
    return per[key]


def visible_mask(mask, sq: int, sk: int, device) -> torch.Tensor | None:
    """Boolean (sq, sk) visibility for a mask kind or MaskSpec, None when everything is visible."""
    if isinstance(mask, MaskSpec):
        return mask.dense(sq, sk, device)
    if mask == FULL:
        return None
    if sq != sk:
        raise ValueError(f"mask {mask!r} needs a square block, got {sq} x {sk}")
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril(0 if mask == CAUSAL else -1)
