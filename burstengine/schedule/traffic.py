"""What travels the ring: the rows of a shard later steps read, and the bytes of each hop.

Rows (:func:`read_rows`, :func:`travel_rows`, :func:`partial_rows`, :func:`sent_rows`) come from
the schedule's tasks; bytes (:func:`hop_bytes`, :func:`forward_bytes`, :func:`backward_bytes`)
multiply them by the size of one row of each message, the same accounting comm_stats reports.
:func:`backward_by_bytes` is the scheme that sends fewer bytes.  A function of shared arguments
only, so every rank agrees on the size of every message.
"""
from __future__ import annotations

import functools

from ..masks import as_pattern
from .blocks import block_tasks, run_steps

SIDES = ("kv", "q")  # "kv": K/V travel r -> r+1 (forward, ring backward); "q": the Q side r -> r-1


def read_rows(layout: str, mask, world: int, n: int, side: str = "kv") -> tuple[tuple[tuple[int, int], ...], ...]:
    """rows[j][i] = [lo, hi): the rows of owner j's travelling shard that the rank holding it at
    loop index i (the i-th of :func:`run_steps`) reads, the bounding box of its tasks' key rows
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
    message (:func:`hop_bytes` with n = 1) for the bytes comm_stats reports."""
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
    steps = run_steps(layout, pattern, world, n)
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
    steps = run_steps(layout, pattern, world, n)
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
    steps = run_steps(layout, pattern, world, n)
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



# --- bytes -----------------------------------------------------------------------------------------

def hop_bytes(scheme: str, B: int, n: int, H: int, Hkv: int, D: int, elem: int) -> tuple[int, int]:
    """(travelling data, travelling gradient partial) bytes one rank sends per hop of one loop.

    scheme "forward": k, v; "burst": q, dout in the input dtype + lse, delta in the accumulator's
    dtype, and dq in it; "ring": k, v, and dk, dv in the accumulator's dtype.  The accumulator is
    float32, float64 for float64 inputs (kernels.acc_dtype).  Whole shards' last partial goes
    home finished, in the input dtype: :func:`home_bytes`."""
    acc = _acc_bytes(elem)
    if scheme == "forward":
        return B * n * Hkv * D * 2 * elem, 0
    if scheme == "burst":
        return B * n * H * (2 * D * elem + 2 * acc), B * n * H * D * acc
    if scheme == "ring":
        return B * n * Hkv * D * 2 * elem, B * n * Hkv * D * 2 * acc
    raise ValueError(f"unknown scheme {scheme!r}")


def _acc_bytes(elem: int) -> int:
    """Bytes of an accumulator element for inputs of ``elem`` bytes (kernels.acc_dtype: float64
    stays float64, everything narrower accumulates in float32)."""
    return 8 if elem == 8 else 4


def home_bytes(scheme: str, B: int, n: int, H: int, Hkv: int, D: int, elem: int) -> int:
    """Bytes of whole shards' last gradient hop, home: the finished dq ("burst") or dk, dv
    ("ring") in the input dtype (comm/rings.py Reducer.home); 0 for "forward"."""
    return hop_bytes(scheme, B, n, H, Hkv, D, elem)[1] * elem // _acc_bytes(elem)


def _trimmed_bytes(scheme: str, B, n, H, Hkv, D, elem, world, layout, mask) -> list[int] | None:
    """Per rank, the bytes of one loop on a sparse mask's single ring (schedule.sent_rows times
    the bytes of one row); None for dense masks."""
    if mask is None or not as_pattern(mask).sparse:
        return None
    if layout is None:
        raise ValueError("the bytes of a sparse mask depend on the layout: pass layout=")
    data, grad = hop_bytes(scheme, B, 1, H, Hkv, D, elem)
    return [d * data + g * grad for d, g in sent_rows(layout, mask, world, n, "q" if scheme == "burst" else "kv")]


def backward_bytes(scheme: str, B: int, n: int, H: int, Hkv: int, D: int, elem: int, world: int,
                   hops: int | None = None, *, layout: str | None = None, mask=None, rank: int = 0) -> int:
    """Bytes one rank sends in the backward of one call (what comm_stats will report).

    Whole shards (dense masks, any ring topology): the data makes ``hops`` hops, the gradient
    partials one more (the last one home, in the input dtype); ``hops``: len(run_steps) - 1, i.e. world - 1
    unless a sparse mask lets the ring skip steps.  With ``layout`` and a sparse ``mask``
    (Pattern): the trimmed messages of the single ring, which differ from rank to rank, for
    rank ``rank`` (``hops`` is then ignored)."""
    trimmed = _trimmed_bytes(scheme, B, n, H, Hkv, D, elem, world, layout, mask)
    if trimmed is not None:
        return trimmed[rank]
    h = world - 1 if hops is None else hops
    if world == 1 or h == 0:
        return 0
    data, grad = hop_bytes(scheme, B, n, H, Hkv, D, elem)
    return h * data + h * grad + home_bytes(scheme, B, n, H, Hkv, D, elem)


def forward_bytes(B: int, n: int, Hkv: int, D: int, elem: int, world: int, hops: int | None = None, *,
                  layout: str | None = None, mask=None, rank: int = 0) -> int:
    """Bytes one rank sends in the forward: K and V, once per ring step that runs after the
    first; with ``layout`` and a sparse ``mask``, just the rows later steps read (see
    :func:`backward_bytes`)."""
    trimmed = _trimmed_bytes("forward", B, n, 0, Hkv, D, elem, world, layout, mask)
    if trimmed is not None:
        return trimmed[rank]
    h = world - 1 if hops is None else hops
    return hop_bytes("forward", B, n, 0, Hkv, D, elem)[0] * h


def backward_by_bytes(B, n, H, Hkv, D, elem, world, hops=None, *, layout=None, mask=None) -> str:
    """The backward scheme that sends fewer bytes (what costmodel.choose_call, the one rule of
    ``backward="auto"``, falls back to when no link figures are known);
    with ``layout`` and a sparse ``mask``, by the busiest rank's trimmed bytes."""
    def most(scheme):
        trimmed = _trimmed_bytes(scheme, B, n, H, Hkv, D, elem, world, layout, mask)
        return max(trimmed) if trimmed is not None else backward_bytes(scheme, B, n, H, Hkv, D, elem, world, hops)

    return "burst" if most("burst") <= most("ring") else "ring"
