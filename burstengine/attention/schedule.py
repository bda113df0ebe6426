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
(:func:`ring_steps`): no compute and no transfer.  The transfers are trimmed the same way
(:func:`travel_rows`, :func:`partial_rows`): a hop carries only the rows of a shard that its
step and the later ones read, and a travelling gradient partial only the rows remote steps
touched.  Everything here is a function of arguments
every rank shares (layout, pattern, world, local length), never of local data, so all ranks
agree on which steps run.

On a double ring (``nodes`` > 1, see comm/topology.py) the order of the steps changes, not their
set; the double ring runs every step, so sparse patterns that skip steps use the single ring.
"""
from __future__ import annotations

import bisect
import functools
import hashlib
from dataclasses import dataclass, field

import torch

# mask kinds understood by every kernel (kernels/base.py)
FULL = "full"        # every query sees every key
CAUSAL = "causal"    # square block, query i sees keys j <= i (top-left aligned)
STRICT = "strict"    # square block, query i sees keys j < i (striped: key rank after query rank)
MASKS = (FULL, CAUSAL, STRICT)


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


def ring_source(rank: int, step: int, world: int, direction: int = 1, nodes: int = 1) -> int:
    """Rank whose travelling shard ``rank`` holds at ``step`` when data moves r -> r + direction.

    One ring (``nodes`` = 1): the shard of (rank - direction * step) mod world.  Double ring of
    ``nodes`` nodes x m = world / nodes ranks, node-major (rank = node * m + local): step
    s = o * m + i is inner step i of round o, and the shard held is that of
    ((node - direction * o) mod nodes, (local - direction * i) mod m): each round goes once
    around the node, and between rounds the shard a rank started the round with moves on to
    the next node.
    """
    if nodes == 1:
        return (rank - direction * step) % world
    m = world // nodes
    o, i = divmod(step, m)
    node, local = divmod(rank, m)
    return ((node - direction * o) % nodes) * m + (local - direction * i) % m


def block_tasks(layout: str, mask, q_rank: int, kv_rank: int, world: int, n: int) -> list[Task]:
    """Tasks for the q shard of ``q_rank`` against the kv shard of ``kv_rank``; n = local length.

    ``mask``: the causal flag (bool) or a :class:`Pattern`."""
    pattern = as_pattern(mask)
    if pattern.sparse:
        return list(_plan(layout, pattern, world, n).tasks(q_rank, kv_rank))
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
    steps that do not run (see :func:`ring_steps`) have none.  ``nodes`` > 1: the double ring's
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


def ring_steps(layout: str, mask, world: int, n: int) -> tuple[int, ...]:
    """The ring steps the loops run: step 0 and every step at which some rank has work.

    A skipped step costs nothing: the travelling shards jump straight from one step that runs
    to the next (a send ``gap`` ranks on), so a call sends ``len(ring_steps) - 1`` hops."""
    pattern = as_pattern(mask)
    if not pattern.sparse:
        return tuple(range(world))
    work = _step_work(layout, pattern, world, n)
    return (0,) + tuple(s for s in range(1, world) if any(work[s]))


def attention_flops(layout: str, mask, world: int, n: int, batch: int, heads: int, head_dim: int,
                    backward: bool = False) -> list[int]:
    """FLOPs each rank spends on visible pairs in one call: 4·B·H·d per pair forward (QKᵀ and PV),
    2.5 times that more in the backward (fwd+bwd = 3.5x fwd, as in DESIGN.md)."""
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


# --- what travels: the rows of a shard that later steps still read -------------------------------

SIDES = ("kv", "q")  # "kv": K/V travel r -> r+1 (forward, ring backward); "q": the Q side r -> r-1


def read_rows(layout: str, mask, world: int, n: int, side: str = "kv") -> tuple[tuple[tuple[int, int], ...], ...]:
    """rows[j][i] = [lo, hi): the rows of owner j's travelling shard that the rank holding it at
    loop index i (the i-th of :func:`ring_steps`) reads, the bounding box of its tasks' key rows
    (``side`` "kv") or query rows ("q"); (0, 0) when it reads none."""
    return _read_rows(layout, as_pattern(mask), world, n, side)


def travel_rows(layout: str, mask, world: int, n: int, side: str = "kv") -> tuple[tuple[tuple[int, int], ...], ...]:
    """rows[j][i] = [lo, hi): the part of owner j's shard held at loop index i, i.e. what the
    hop into index i (i >= 1) carries: the rows that step and every later one still read (the
    bounding box of their :func:`read_rows`), (0, 0) when none does.  Index 0 holds the whole
    shard; the ranges only shrink hop by hop, so a rank always sends a part of what it holds.
    Dense patterns: the whole shard at every index (nothing is trimmed).

    E.g. ``contiguous`` with a window W <= n: hop 1 of K/V carries the last W - 1 rows; with
    W = 2.5 n the tail shrinks hop by hop.  Depends only on shared arguments, so every rank
    agrees on the size of every message."""
    return _travel_rows(layout, as_pattern(mask), world, n, side)


def partial_rows(layout: str, mask, world: int, n: int, side: str = "kv"):
    """rows[j][i] = [lo, hi): the rows of owner j's travelling gradient partial (dK/dV for
    ``side`` "kv", dQ for "q") after loop index i: the bounding box of what the remote steps
    1..i touched.  Index 0's contribution (the owner's own step) stays home, so its partial is
    empty.  None for dense patterns: there the partial covers the whole shard from index 0
    on and travels with it (the plain scheme, unchanged)."""
    p = as_pattern(mask)
    return _partial_rows(layout, p, world, n, side) if p.sparse else None


def sent_rows(layout: str, mask, world: int, n: int, side: str = "kv") -> tuple[tuple[int, int], ...]:
    """Per rank: (rows of travelling data, rows of gradient partials) it sends in one loop of the
    single ring, the last partial's hop home included; multiply by the bytes of one row of each
    message (burst.hop_bytes with n = 1) for the bytes comm_stats reports."""
    return _sent_rows(layout, as_pattern(mask), world, n, side)


def _holder(owner: int, step: int, world: int, side: str) -> int:
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    return (owner + step) % world if side == "kv" else (owner - step) % world


def _box(ranges):
    ranges = [r for r in ranges if r[1] > r[0]]
    return (min(r[0] for r in ranges), max(r[1] for r in ranges)) if ranges else (0, 0)


@functools.lru_cache(maxsize=64)
def _read_rows(layout, pattern, world, n, side):
    steps = ring_steps(layout, pattern, world, n)
    out = []
    for j in range(world):
        row = []
        for s in steps:
            h = _holder(j, s, world, side)
            tasks = block_tasks(layout, pattern, h, j, world, n) if side == "kv" else \
                block_tasks(layout, pattern, j, h, world, n)
            row.append(_box([(t.k0, t.k1) if side == "kv" else (t.q0, t.q1) for t in tasks]))
        out.append(tuple(row))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _travel_rows(layout, pattern, world, n, side):
    steps = ring_steps(layout, pattern, world, n)
    if not pattern.sparse:
        return tuple(((0, n),) * len(steps) for _ in range(world))
    out = []
    for row in _read_rows(layout, pattern, world, n, side):
        # suffix unions: what index i and every later index read
        held, acc = [], (0, 0)
        for r in reversed(row[1:]):
            acc = _box([acc, r])
            held.append(acc)
        out.append(((0, n),) + tuple(reversed(held)))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _partial_rows(layout, pattern, world, n, side):
    out = []
    for row in _read_rows(layout, pattern, world, n, side):
        acc, spans = (0, 0), [(0, 0)]
        for r in row[1:]:
            acc = _box([acc, r])
            spans.append(acc)
        out.append(tuple(spans))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def _sent_rows(layout, pattern, world, n, side):
    steps = ring_steps(layout, pattern, world, n)
    last = len(steps) - 1
    if world == 1 or last == 0:
        return ((0, 0),) * world
    if not pattern.sparse:
        return ((last * n, (last + 1) * n),) * world
    travel = _travel_rows(layout, pattern, world, n, side)
    partial = _partial_rows(layout, pattern, world, n, side)
    back = -1 if side == "kv" else 1  # the owner held at step s is the holder's rank - s (kv), + s (q)

    def width(r):
        return r[1] - r[0]

    out = []
    for r in range(world):
        src = [(r + back * s) % world for s in steps]
        data = sum(width(travel[src[i]][i + 1]) for i in range(last))
        # the partial finished at index i leaves at index i + 1, the last one goes home
        grad = sum(width(partial[src[i]][i]) for i in range(last + 1))
        out.append((data, grad))
    return tuple(out)


# --- the sparse path ------------------------------------------------------------------------------

_BIG = 1 << 60


def _step_work(layout: str, pattern: Pattern, world: int, n: int) -> tuple[tuple[int, ...], ...]:
    if pattern.sparse:
        return _plan(layout, pattern, world, n).work()
    return _dense_work(layout, pattern.causal, world, n)


@functools.lru_cache(maxsize=64)
def _dense_work(layout, causal, world, n):
    return tuple(
        tuple(sum(t.visible_pairs() for t in block_tasks(layout, causal, r, ring_source(r, s, world), world, n))
              for r in range(world))
        for s in range(world))


class _Plan:
    """The tasks of every (q rank, kv rank) pair for one sparse call, built on first use.

    Plans are cached by (layout, pattern, world, n): every layer of a model and both passes of
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
def _plan(layout: str, pattern: Pattern, world: int, n: int) -> _Plan:
    return _Plan(layout, pattern, world, n)


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
        from ..kernels.base import MaskSpec

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
        from ..kernels.base import MaskSpec

        mask = MaskSpec(causal=p.causal, q_start=qs.start + qs.step * q0, q_step=qs.step,
                        k_start=ks.start + ks.step * k0, k_step=ks.step, block_mask=sub.contiguous(), block_size=L)
    return Task(qs.row0 + q0, qs.row0 + q1, ks.row0 + k0, ks.row0 + k1, mask, total)
