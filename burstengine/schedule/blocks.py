"""Which query rows meet which key rows at each ring step: plain Python, no attention.

At ring step s of a G-rank ring, rank r holds the K/V shard of rank (r - s) mod G in the
forward and the ring backward, and the Q-side shard of rank (r + s) mod G in the burst
backward (the Q side travels the other way, so that step s pairs the same (q rank, kv rank)
blocks in all three loops and a step skipped in one is skipped in all).  Whether the block
pair (q shard of rank qr, kv shard of rank kr) is fully visible, causal, strictly causal,
sparse or skipped depends only on the layout and the mask :class:`Pattern`, and is described
here as a list of :class:`Task` items so that tests can count the work of every rank at every
step without running attention.

Sparse patterns (sliding window, packed documents, block-sparse) go through one path: every
rank's shard is a few affine *segments* of global positions (one for contiguous and striped,
two for zigzag); for each (q segment, kv segment) pair the visible pairs are counted exactly,
the task is trimmed to the bounding box of its visible rows and keys, and a pair with nothing
visible gives no task.  Steps at which no rank has work are not run at all
(:func:`run_steps`): no compute and no transfer.  The transfers are trimmed the same way
(schedule/traffic.py: :func:`travel_rows`, :func:`partial_rows`): a hop carries only the rows of a shard that its
step and the later ones read, and a travelling gradient partial only the rows remote steps
touched.  Everything here is a function of arguments
every rank shares (layout, pattern, world, local length), never of local data, so all ranks
agree on which steps run.

On a double ring (``nodes`` > 1, see comm/rings.py) the order of the steps changes, not their
set; the double ring runs every step, so sparse patterns that skip steps use the single ring.
"""
from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

import torch

from ..masks import CAUSAL, FULL, STRICT, MaskSpec, Pattern, as_pattern
from .order import ring_source

@dataclass(frozen=True)
class Task:
    """Query rows [q0, q1) of the local q shard meet key rows [k0, k1) of the kv shard.

    ``mask`` is a kind from MASKS or a kernels.base.MaskSpec; ``pairs`` is the number of
    visible (query, key) pairs, set by the schedule for MaskSpec tasks."""

    q0: int
    q1: int
    k0: int
    k1: int
    mask: object
    pairs: int | None = None

    def visible_pairs(self) -> int:
        if self.pairs is not None:
            return self.pairs
        nq, nk = self.q1 - self.q0, self.k1 - self.k0
        if self.mask == FULL:
            return nq * nk
        if self.mask == CAUSAL:
            return nq * (nq + 1) // 2
        return nq * (nq - 1) // 2


@dataclass(frozen=True)
class Segment:
    """Local rows [row0, row0 + length) hold global positions start, start + step, ..."""

    row0: int
    length: int
    start: int
    step: int

    def positions(self) -> torch.Tensor:
        return self.start + self.step * torch.arange(self.length)


def segments(layout: str, rank: int, world: int, n: int) -> tuple[Segment, ...]:
    """A rank's shard as affine runs of global positions (matches layout.position_ids)."""
    if layout == "contiguous":
        return (Segment(0, n, rank * n, 1),)
    if layout == "striped":
        return (Segment(0, n, rank, world),)
    if layout == "zigzag":
        c = n // 2
        return (Segment(0, c, rank * c, 1), Segment(c, c, (2 * world - 1 - rank) * c, 1))
    raise ValueError(f"unknown layout {layout!r}")


def block_tasks(layout: str, mask, q_rank: int, kv_rank: int, world: int, n: int) -> list[Task]:
    """Tasks for the q shard of ``q_rank`` against the kv shard of ``kv_rank``; n = local length.

    ``mask``: the causal flag (bool) or a :class:`Pattern`."""
    pattern = as_pattern(mask)
    if pattern.sparse:
        return list(_sparse_tasks(layout, pattern, world, n).tasks(q_rank, kv_rank))
    if not pattern.causal:
        return [Task(0, n, 0, n, FULL)]
    if q_rank == kv_rank:
        return [Task(0, n, 0, n, CAUSAL)]
    if layout == "contiguous":
        return [Task(0, n, 0, n, FULL)] if kv_rank < q_rank else []
    if layout == "zigzag":
        h = n // 2
        if kv_rank < q_rank:
            # both q chunks come after the kv rank's early chunk; its late chunk is after both
            return [Task(0, n, 0, h, FULL)]
        # only the q rank's late chunk comes after the kv rank's two chunks
        return [Task(h, n, 0, n, FULL)]
    if layout == "striped":
        # q index i is global i*G + q_rank, kv index j is j*G + kv_rank
        return [Task(0, n, 0, n, CAUSAL if kv_rank < q_rank else STRICT)]
    raise ValueError(f"unknown layout {layout!r}")


def forward_schedule(layout: str, mask, rank: int, world: int, n: int, nodes: int = 1) -> list[list[Task]]:
    """Per step, the tasks rank ``rank`` computes in the forward (its q vs travelling kv); the
    steps that do not run (see :func:`run_steps`) have none.  ``nodes`` > 1: the double ring's
    order of steps."""
    return [block_tasks(layout, mask, rank, ring_source(rank, s, world, nodes=nodes), world, n)
            for s in range(world)]


def step_work(layout: str, mask, world: int, n: int, nodes: int = 1) -> list[list[int]]:
    """Visible (query, key) pairs computed by each rank at each step: work[step][rank], all G
    steps (those that do not run are all zero).  ``nodes`` > 1: the double ring's order."""
    if nodes == 1:
        return [list(row) for row in _step_work(layout, as_pattern(mask), world, n)]
    return [[sum(t.visible_pairs() for t in block_tasks(layout, mask, r, ring_source(r, s, world, nodes=nodes),
                                                        world, n)) for r in range(world)] for s in range(world)]


def run_steps(layout: str, mask, world: int, n: int) -> tuple[int, ...]:
    """The ring steps the loops run: step 0 and every step at which some rank has work.

    A skipped step costs nothing: the travelling shards jump straight from one step that runs
    to the next (a send ``gap`` ranks on), so a call sends ``len(run_steps) - 1`` hops."""
    pattern = as_pattern(mask)
    if not pattern.sparse:
        return tuple(range(world))
    work = _step_work(layout, pattern, world, n)
    return (0,) + tuple(s for s in range(1, world) if any(work[s]))


def attention_flops(layout: str, mask, world: int, n: int, batch: int, heads: int, head_dim: int,
                    backward: bool = False) -> list[int]:
    """FLOPs each rank spends on visible pairs in one call: 4·B·H·d per pair forward (QKᵀ and PV),
    2.5 times that more in the backward (fwd+bwd = 3.5x fwd, docs/design.md "FLOP conventions")."""
    work = _step_work(layout, as_pattern(mask), world, n)
    per_rank = [sum(work[s][r] for s in range(world)) for r in range(world)]
    f = 4 * batch * heads * head_dim
    return [p * f * 7 // 2 if backward else p * f for p in per_rank]


def visible_pairs(seq_len: int, mask) -> int:
    """Visible (query, key) pairs of the whole sequence, from the pattern alone (no schedule):
    the ideal work of a mask, what a sparse speedup is measured against."""
    p = as_pattern(mask)
    if p.block_mask is not None:
        bm, bs = p.block_mask, p.block_size
        if not p.causal:
            return int(bm.sum()) * bs * bs
        below = torch.ones(bm.shape, dtype=torch.bool).tril(-1)
        return int((bm & below).sum()) * bs * bs + int(bm.diagonal().sum()) * bs * (bs + 1) // 2
    docs = p.cu_seqlens or (0, seq_len)
    total = 0
    for a, b in zip(docs[:-1], docs[1:]):
        L = b - a
        if not p.causal:
            total += L * L
        elif p.window is None or p.window >= L:
            total += L * (L + 1) // 2
        else:
            W = p.window
            total += W * (W + 1) // 2 + (L - W) * W
    return total


# --- the sparse path ------------------------------------------------------------------------------

_BIG = 1 << 60


def _step_work(layout: str, pattern: Pattern, world: int, n: int) -> tuple[tuple[int, ...], ...]:
    if pattern.sparse:
        return _sparse_tasks(layout, pattern, world, n).work()
    return _dense_work(layout, pattern.causal, world, n)


@functools.lru_cache(maxsize=64)
def _dense_work(layout, causal, world, n):
    return tuple(
        tuple(sum(t.visible_pairs() for t in block_tasks(layout, causal, r, ring_source(r, s, world), world, n))
              for r in range(world))
        for s in range(world))


class _SparseTasks:
    """The tasks of every (q rank, kv rank) pair for one sparse call, built on first use.

    These tables are cached by (layout, pattern, world, n): every layer of a model and both passes of
    a call share one, and the MaskSpecs in it are the same objects each time (kernels may cache
    per spec).  Only a few are kept, since packed documents change from batch to batch."""

    def __init__(self, layout: str, pattern: Pattern, world: int, n: int):
        self.layout, self.pattern, self.world, self.n = layout, pattern, world, n
        self._tasks: dict[tuple[int, int], tuple[Task, ...]] = {}
        self._docs: dict[int, torch.Tensor] = {}
        self._work = None

    def docs(self, rank: int) -> torch.Tensor:
        """Document index of every local row of ``rank`` (int64, CPU); MaskSpecs hold views of it."""
        if rank not in self._docs:
            cu = torch.tensor(self.pattern.cu_seqlens, dtype=torch.int64)
            pos = torch.cat([s.positions() for s in segments(self.layout, rank, self.world, self.n)])
            self._docs[rank] = torch.searchsorted(cu, pos, right=True) - 1
        return self._docs[rank]

    def tasks(self, q_rank: int, kv_rank: int) -> tuple[Task, ...]:
        key = (q_rank, kv_rank)
        if key not in self._tasks:
            p, out = self.pattern, []
            for qs in segments(self.layout, q_rank, self.world, self.n):
                for ks in segments(self.layout, kv_rank, self.world, self.n):
                    if p.block_mask is not None:
                        t = _block_task(p, qs, ks)
                    else:
                        docs = None if p.cu_seqlens is None else (self.docs(q_rank), self.docs(kv_rank))
                        t = _interval_task(p, qs, ks, docs)
                    if t is not None:
                        out.append(t)
            self._tasks[key] = tuple(out)
        return self._tasks[key]

    def work(self) -> tuple[tuple[int, ...], ...]:
        if self._work is None:
            G = self.world
            self._work = tuple(
                tuple(sum(t.visible_pairs() for t in self.tasks(r, ring_source(r, s, G))) for r in range(G))
                for s in range(G))
        return self._work


@functools.lru_cache(maxsize=8)
def _sparse_tasks(layout: str, pattern: Pattern, world: int, n: int) -> _SparseTasks:
    return _SparseTasks(layout, pattern, world, n)


def _nothing_visible(p: Pattern, qs: Segment, ks: Segment) -> bool:
    """Cheap whole-segment test from the end positions (skips the per-row work for most pairs)."""
    q_lo, q_hi = qs.start, qs.start + qs.step * (qs.length - 1)
    k_lo, k_hi = ks.start, ks.start + ks.step * (ks.length - 1)
    if p.causal and k_lo > q_hi:
        return True
    if p.window is not None and q_lo - k_hi >= p.window:
        return True
    if p.cu_seqlens is not None:
        cu = p.cu_seqlens
        # documents spanned by each segment; disjoint spans share no document
        qd = (bisect.bisect_right(cu, q_lo), bisect.bisect_right(cu, q_hi))
        kd = (bisect.bisect_right(cu, k_lo), bisect.bisect_right(cu, k_hi))
        if qd[1] < kd[0] or kd[1] < qd[0]:
            return True
    return False


def _interval_task(p: Pattern, qs: Segment, ks: Segment, docs) -> Task | None:
    """Causal / window / document masks: each query sees one interval of global key positions."""
    if _nothing_visible(p, qs, ks):
        return None
    qpos = qs.positions()
    lo = torch.full_like(qpos, -_BIG)
    hi = torch.full_like(qpos, _BIG)
    if p.causal:
        hi = qpos
    if p.window is not None:
        lo = qpos - (p.window - 1)
    qdoc = kdoc = None
    if docs is not None:
        cu = torch.tensor(p.cu_seqlens, dtype=torch.int64)
        qdoc = docs[0][qs.row0:qs.row0 + qs.length]
        kdoc = docs[1][ks.row0:ks.row0 + ks.length]
        lo = torch.maximum(lo, cu[qdoc])
        hi = torch.minimum(hi, cu[qdoc + 1] - 1)
    # local key rows j with lo <= ks.start + ks.step * j <= hi
    jlo = (-torch.div(ks.start - lo, ks.step, rounding_mode="floor")).clamp(min=0)
    jhi = torch.div(hi - ks.start, ks.step, rounding_mode="floor").clamp(max=ks.length - 1)
    cnt = (jhi - jlo + 1).clamp(min=0)
    total = int(cnt.sum())
    if total == 0:
        return None
    rows = torch.nonzero(cnt).flatten()
    q0, q1 = int(rows[0]), int(rows[-1]) + 1
    k0, k1 = int(jlo[rows].min()), int(jhi[rows].max()) + 1
    jlo, jhi = jlo[q0:q1], jhi[q0:q1]
    nq, nk = q1 - q0, k1 - k0
    if bool((jlo == k0).all() and (jhi == k1 - 1).all()):
        mask = FULL
    elif nq == nk and bool((jlo == k0).all() and (jhi == k0 + torch.arange(nq)).all()):
        mask = CAUSAL
    else:
        mask = MaskSpec(causal=p.causal, q_start=qs.start + qs.step * q0, q_step=qs.step,
                        k_start=ks.start + ks.step * k0, k_step=ks.step, window=p.window,
                        q_doc=None if qdoc is None else qdoc[q0:q1], k_doc=None if kdoc is None else kdoc[k0:k1])
    return Task(qs.row0 + q0, qs.row0 + q1, ks.row0 + k0, ks.row0 + k1, mask, total)


def _block_task(p: Pattern, qs: Segment, ks: Segment) -> Task | None:
    """Block-sparse (optionally causal): segments hold whole blocks, ``bs / step`` rows each."""
    bs = p.block_size
    L = bs // qs.step
    qb0, kb0 = qs.start // bs, ks.start // bs
    nbq, nbk = qs.length // L, ks.length // L
    on = p.block_mask[qb0:qb0 + nbq, kb0:kb0 + nbk]
    diag_pairs = 0
    if p.causal:
        gq = torch.arange(qb0, qb0 + nbq)[:, None]
        gk = torch.arange(kb0, kb0 + nbk)[None, :]
        full = on & (gq > gk)
        diag = on & (gq == gk)
        # a block against itself: positions differ by (oq - ok) + step * (i - j) with o the
        # offsets of the segments inside their blocks (0, or the rank under striped)
        off = (qs.start - qb0 * bs) - (ks.start - kb0 * bs)
        i = torch.arange(L)
        diag_pairs = int((torch.div(off + qs.step * i, qs.step, rounding_mode="floor") + 1).clamp(0, L).sum())
        on = full | diag
        total = int(full.sum()) * L * L + int(diag.sum()) * diag_pairs
    else:
        total = int(on.sum()) * L * L
    if total == 0:
        return None
    br = torch.nonzero(on.any(1)).flatten()
    bc = torch.nonzero(on.any(0)).flatten()
    b0, b1, c0, c1 = int(br[0]), int(br[-1]) + 1, int(bc[0]), int(bc[-1]) + 1
    sub = on[b0:b1, c0:c1]
    q0, q1, k0, k1 = b0 * L, b1 * L, c0 * L, c1 * L
    if total == (q1 - q0) * (k1 - k0):
        mask = FULL
    elif (q1 - q0, k1 - k0) == (L, L) and diag_pairs == L * (L + 1) // 2 and total == diag_pairs:
        mask = CAUSAL
    else:
        mask = MaskSpec(causal=p.causal, q_start=qs.start + qs.step * q0, q_step=qs.step,
                        k_start=ks.start + ks.step * k0, k_step=ks.step, block_mask=sub.contiguous(), block_size=L)
    return Task(qs.row0 + q0, qs.row0 + q1, ks.row0 + k0, ks.row0 + k1, mask, total)
