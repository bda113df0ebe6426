"""Sparse masks for kernels that only know FULL and CAUSAL blocks (SDPA flash / cuDNN).

A :class:`~burstengine.kernels.base.MaskSpec` block is cut into *pieces*, each a rectangle of
query rows against one or more key row ranges that is either fully visible (FULL) or a square
causal triangle (CAUSAL, possibly with rows and keys reversed, which turns the anti-causal
triangles at the lower edge of a sliding window into causal ones).  The pieces cover every
visible (query, key) pair of the block exactly once and nothing else, so a FULL/CAUSAL kernel
computes only visible pairs (up to its own tile rounding) and the results merge exactly:

* window / causal / documents (equal q and k position steps): per document, each query row i
  sees the key interval [L_i, R_i] with L and R non-decreasing and of slope <= 1 (a clipped
  diagonal band).  Rows are cut into tiles no taller than the band is wide; a tile is a FULL
  core that every row sees, plus at most a triangle (and a FULL rectangle where the band is
  clipped) on each side.
* block-sparse (with or without causal): per block row, the fully visible key blocks are
  gathered into one FULL piece (consecutive block rows that see the same key blocks share it);
  blocks cut by the causal diagonal become band pieces.

Anything else (different q and k steps under causal or window, block masks mixed with
windows or documents) returns None and the caller falls back to the reference kernel.
Pure Python on small integers: it can be tested without running attention.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..masks import CAUSAL, FULL, MaskSpec, derived
from .base import Kernel, acc_dtype, merge_
from .reference import ReferenceKernel


# tallest piece: every piece costs one merge pass over its output rows, so pieces are as tall
# as the mask allows (a window's band tiles are at most W rows whatever this is)
MAX_ROWS = 65536
# pieces with fewer query rows or keys than this run on the reference kernel: a launch of a
# fused kernel costs more than such a sliver computes, and cuDNN refuses s_q = s_kv = 1 outright
# (the one-row triangles at the edges of a window band)
MIN_SIDE = 16


@dataclass(frozen=True)
class Piece:
    """Query rows [q0, q1) against the concatenation of key rows ``kr`` = ((k0, k1), ...).

    kind FULL: every pair visible; CAUSAL: square, query u sees keys v <= u; with ``flip`` rows
    and keys are both reversed before the call (query u sees keys v >= u)."""

    q0: int
    q1: int
    kr: tuple[tuple[int, int], ...]
    kind: str
    flip: bool = False

    @property
    def nk(self) -> int:
        return sum(b - a for a, b in self.kr)

    def pairs(self) -> int:
        n = self.q1 - self.q0
        return n * self.nk if self.kind == FULL else n * (n + 1) // 2

    @property
    def side(self) -> int:
        """The smaller of its query rows and keys."""
        return min(self.q1 - self.q0, self.nk)


def band(i0: int, i1: int, j0: int, j1: int, clo: int | None, chi: int | None, max_rows: int) -> list[Piece]:
    """Pieces for rows [i0, i1) x keys [j0, j1) where row i sees keys j with clo <= j - i <= chi
    (None: unbounded on that side)."""
    if j0 >= j1 or i0 >= i1 or (clo is not None and chi is not None and clo > chi):
        return []

    def L(i):
        return j0 if clo is None else max(j0, i + clo)

    def R(i):
        return j1 - 1 if chi is None else min(j1 - 1, i + chi)

    # rows that see anything form one interval: L_i <= R_i
    a, e = i0, i1
    if chi is not None:
        a = max(a, j0 - chi)
    if clo is not None:
        e = min(e, j1 - clo)
    out: list[Piece] = []
    while a < e:
        b = min(e, a + max_rows)
        Ra = R(a)
        if clo is not None:
            # keep the left and right edges apart: L_{b-1} <= R_a + 1
            b = min(b, Ra + 2 - clo)
        La, Lb, Rb = L(a), L(b - 1), R(b - 1)
        core0, core1 = Lb, Ra + 1  # keys every row of the tile sees
        if Ra < Rb:
            # right edge: rows before ihat see keys up to i + chi, rows from ihat all of (Ra, Rb]
            ihat = min(b, max(a, j1 - 1 - chi))
            if core0 < core1:
                # the triangle takes the core's last column, so it starts at row a (CAUSAL incl. diagonal)
                core1 -= 1
                out.append(Piece(a, ihat, ((Ra, Ra + ihat - a),), CAUSAL))
                if ihat < b:
                    out.append(Piece(ihat, b, ((Ra, Rb + 1),), FULL))
            else:
                if ihat - a - 1 > 0:
                    out.append(Piece(a + 1, ihat, ((Ra + 1, Ra + ihat - a),), CAUSAL))
                if ihat < b:
                    out.append(Piece(ihat, b, ((Ra + 1, Rb + 1),), FULL))
        if La < Lb:
            # left edge: rows before istar see all of [La, Lb), rows from istar keys from i + clo
            istar = max(a, j0 - clo)
            if core0 < core1:
                core0 += 1
                if istar > a:
                    out.append(Piece(a, istar, ((La, Lb + 1),), FULL))
                out.append(Piece(istar, b, ((istar + clo, b + clo),), CAUSAL, flip=True))
            else:
                if istar > a:
                    out.append(Piece(a, istar, ((La, Lb),), FULL))
                if b - 1 - istar > 0:
                    out.append(Piece(istar, b - 1, ((istar + clo, b - 1 + clo),), CAUSAL, flip=True))
        if core0 < core1:
            out.append(Piece(a, b, ((core0, core1),), FULL))
        a = b
    return out


def _offsets(spec: MaskSpec):
    """(clo, chi) with row i seeing keys clo <= j - i <= chi, from causal / window and positions
    q_start + s*i, k_start + s*j (equal steps s); None when unbounded."""
    s, d = spec.q_step, spec.q_start - spec.k_start  # q_pos - k_pos = d + s * (i - j)
    chi = d // s if spec.causal else None  # d + s(i - j) >= 0
    clo = (d - spec.window) // s + 1 if spec.window is not None else None  # d + s(i - j) < W
    return clo, chi


def _runs(ids: torch.Tensor):
    """{value: (start, end)} of the runs of a non-decreasing 1-D tensor."""
    vals, counts = torch.unique_consecutive(ids, return_counts=True)
    ends = torch.cumsum(counts, 0).tolist()
    starts = [0] + ends[:-1]
    return {v: (a, b) for v, a, b in zip(vals.tolist(), starts, ends)}


def decompose(spec: MaskSpec, sq: int, sk: int, max_rows: int = MAX_ROWS) -> list[Piece] | None:
    """Pieces covering exactly the visible pairs of an ``sq`` x ``sk`` block, or None if this
    MaskSpec has no such decomposition here (the caller then uses a dense-mask kernel)."""
    positional = spec.causal or spec.window is not None
    if positional and spec.q_step != spec.k_step:
        return None
    if spec.block_mask is not None:
        if spec.window is not None or spec.q_doc is not None:
            return None
        return _block_pieces(spec, sq, sk, max_rows)
    clo, chi = _offsets(spec) if positional else (None, None)
    if spec.q_doc is None:
        return band(0, sq, 0, sk, clo, chi, max_rows)
    out = []
    kruns = _runs(spec.k_doc.cpu())
    for doc, (i0, i1) in _runs(spec.q_doc.cpu()).items():
        if doc in kruns:
            j0, j1 = kruns[doc]
            out += band(i0, i1, j0, j1, clo, chi, max_rows)
    return out


def _block_pieces(spec: MaskSpec, sq: int, sk: int, max_rows: int) -> list[Piece]:
    L = spec.block_size
    bm = spec.block_mask.cpu().tolist()
    chi = _offsets(spec)[1] if spec.causal else None
    out: list[Piece] = []
    group = None  # (row start, row end, key runs) of consecutive block rows sharing their full blocks
    for br, row in enumerate(bm):
        i0, i1 = br * L, min(sq, (br + 1) * L)
        if i0 >= sq:
            break
        full = []
        for bc, on in enumerate(row):
            j0, j1 = bc * L, min(sk, (bc + 1) * L)
            if not on or j0 >= sk:
                continue
            if chi is None or j1 - 1 <= i0 + chi:  # every key of the block at or before every query
                full.append((j0, j1))
            elif j0 <= i1 - 1 + chi:  # the causal diagonal cuts this block
                out += band(i0, i1, j0, j1, None, chi, max_rows)
        runs = []
        for j0, j1 in full:
            if runs and runs[-1][1] == j0:
                runs[-1] = (runs[-1][0], j1)
            else:
                runs.append((j0, j1))
        runs = tuple(runs)
        if group and group[2] == runs and group[1] == i0 and i1 - group[0] <= max_rows:
            group = (group[0], i1, runs)
        else:
            if group and group[2]:
                out.append(Piece(group[0], group[1], group[2], FULL))
            group = (i0, i1, runs)
    if group and group[2]:
        out.append(Piece(group[0], group[1], group[2], FULL))
    return out


def cached_pieces(spec: MaskSpec, sq: int, sk: int, max_rows: int = MAX_ROWS):
    """decompose(), remembered per MaskSpec object."""
    return derived(spec, ("pieces", sq, sk, max_rows), lambda: decompose(spec, sq, sk, max_rows))


def large_pairs(spec: MaskSpec, sq: int, sk: int, min_side: int) -> tuple[int, int]:
    """(visible pairs in pieces with at least ``min_side`` query rows and keys, all visible
    pairs) of cached_pieces(); (0, 0) when there is no cut.  Remembered like it."""
    def count():
        pieces = cached_pieces(spec, sq, sk) or ()
        return sum(p.pairs() for p in pieces if p.side >= min_side), sum(p.pairs() for p in pieces)

    return derived(spec, ("large", sq, sk, min_side), count)


def _gather(x: torch.Tensor, kr) -> torch.Tensor:
    if len(kr) == 1:
        return x[:, kr[0][0]:kr[0][1]]
    return torch.cat([x[:, a:b] for a, b in kr], dim=1)


def _scatter_add(acc: torch.Tensor, g: torch.Tensor, kr) -> None:
    off = 0
    for a, b in kr:
        acc[:, a:b] += g[:, off:off + b - a]
        off += b - a


def _flip(x, dim=1):
    return None if x is None else x.flip(dim)


class PiecewiseMasks(Kernel):
    """Mixin: MaskSpec blocks are run as FULL / CAUSAL pieces on the next kernel in the MRO;
    specs with no decomposition go to the reference kernel (dense mask, float32 on any device)."""

    max_rows = MAX_ROWS
    min_side = MIN_SIDE

    def _pieces(self, mask, sq, sk):
        return cached_pieces(mask, sq, sk, self.max_rows)

    @staticmethod
    def _dense():
        return ReferenceKernel()

    def _small(self, p) -> bool:
        return p.side < self.min_side

    def forward(self, q, k, v, scale, mask):
        if not isinstance(mask, MaskSpec):
            return super().forward(q, k, v, scale, mask)
        B, Sq, H, _ = q.shape
        acc = acc_dtype(q)
        out = torch.zeros(B, Sq, H, v.shape[-1], dtype=acc, device=q.device)
        lse = torch.full((B, H, Sq), float("-inf"), dtype=acc, device=q.device)
        self.forward_into(q, k, v, scale, mask, out, lse)
        return out, lse

    def forward_into(self, q, k, v, scale, mask, out, lse):
        if not isinstance(mask, MaskSpec):
            return super().forward_into(q, k, v, scale, mask, out, lse)
        pieces = self._pieces(mask, q.shape[1], k.shape[1])
        if pieces is None:
            return self._dense().forward_into(q, k, v, scale, mask, out, lse)
        for p in pieces:
            qq, kk, vv = q[:, p.q0:p.q1], _gather(k, p.kr), _gather(v, p.kr)
            if p.flip:
                qq, kk, vv = qq.flip(1), kk.flip(1), vv.flip(1)
            if self._small(p):
                o, l = self._dense().forward(qq, kk, vv, scale, p.kind)
            else:
                o, l = super().forward(qq, kk, vv, scale, p.kind)
            if p.flip:
                o, l = o.flip(1), l.flip(-1)
            merge_(out[:, p.q0:p.q1], lse[:, :, p.q0:p.q1], o, l)

    def backward(self, dout, q, k, v, lse, delta, scale, mask, out=None):
        if not isinstance(mask, MaskSpec):
            return super().backward(dout, q, k, v, lse, delta, scale, mask, out=out)
        acc = acc_dtype(q)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        self.backward_into(dout, q, k, v, lse, delta, scale, mask, dq, dk, dv, out=out)
        return dq, dk, dv

    def backward_into(self, dout, q, k, v, lse, delta, scale, mask, dq, dk, dv, out=None):
        if not isinstance(mask, MaskSpec):
            return super().backward_into(dout, q, k, v, lse, delta, scale, mask, dq, dk, dv, out=out)
        pieces = self._pieces(mask, q.shape[1], k.shape[1])
        if pieces is None:
            return self._dense().backward_into(dout, q, k, v, lse, delta, scale, mask, dq, dk, dv, out=out)
        for p in pieces:
            rows = slice(p.q0, p.q1)
            args = [dout[:, rows], q[:, rows], _gather(k, p.kr), _gather(v, p.kr)]
            l, dl = lse[:, :, rows], delta[:, :, rows]
            o = None if out is None else out[:, rows]
            if p.flip:
                args = [a.flip(1) for a in args]
                l, dl, o = l.flip(-1), dl.flip(-1), _flip(o)
            if self._small(p):
                a, b, c = self._dense().backward(*args, l, dl, scale, p.kind, out=o)
            else:
                a, b, c = super().backward(*args, l, dl, scale, p.kind, out=o)
            if p.flip:
                a, b, c = a.flip(1), b.flip(1), c.flip(1)
            dq[:, rows] += a
            _scatter_add(dk, b, p.kr)
            _scatter_add(dv, c, p.kr)
