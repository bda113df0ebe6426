"""kernels/pieces.py: sparse MaskSpec blocks cut into FULL / CAUSAL pieces for SDPA-style kernels.

The cut is checked without attention (every visible pair of the block covered exactly once,
nothing else), then run through a FULL/CAUSAL-only kernel (the reference kernel behind the
PiecewiseMasks mixin, recording the kinds it is given) against the reference kernel with the
dense mask, forward and backward, on the blocks the schedule produces.
"""
import itertools
import random

import pytest
import torch

from burstengine.masks import CAUSAL, FULL, Pattern
from burstengine.schedule import block_tasks, ring_source, run_steps
from burstengine.masks import MaskSpec, visible_mask
from burstengine.kernels.pieces import PiecewiseMasks, band, decompose
from burstengine.kernels.reference import ReferenceKernel
from sparse_cases import random_block_mask

torch.set_num_threads(1)  # tiny tensors: a shared 2-core box spends more on thread hand-offs than on work


def _coverage(pieces, sq, sk):
    cov = torch.zeros(sq, sk, dtype=torch.int64)
    for p in pieces:
        keys = torch.cat([torch.arange(a, b) for a, b in p.kr])
        n = p.q1 - p.q0
        assert n > 0 and len(keys) > 0, p
        if p.kind == FULL:
            m = torch.ones(n, len(keys), dtype=torch.int64)
        else:
            assert p.kind == CAUSAL and len(keys) == n, p
            m = torch.ones(n, n, dtype=torch.int64).tril()
            if p.flip:
                m = m.flip(0).flip(1)
        assert int(m.sum()) == p.pairs()
        cov[p.q0:p.q1][:, keys] += m
    return cov


def test_band_covers_exactly_the_band():
    rnd = random.Random(0)
    for _ in range(3000):
        sq, sk = rnd.randint(1, 24), rnd.randint(1, 24)
        i0 = rnd.randint(0, sq - 1)
        i1 = rnd.randint(i0 + 1, sq)
        j0 = rnd.randint(0, sk - 1)
        j1 = rnd.randint(j0 + 1, sk)
        clo = rnd.choice([None, rnd.randint(-30, 30)])
        chi = rnd.choice([None, rnd.randint(-30, 30)])
        rows = rnd.randint(1, 30)
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        want = (i >= i0) & (i < i1) & (j >= j0) & (j < j1)
        if clo is not None:
            want &= j - i >= clo
        if chi is not None:
            want &= j - i <= chi
        cov = _coverage(band(i0, i1, j0, j1, clo, chi, rows), sq, sk)
        assert torch.equal(cov, want.long()), (sq, sk, i0, i1, j0, j1, clo, chi, rows)


def _patterns(S, world):
    """Sparse patterns of every kind over a global sequence of S tokens."""
    yield Pattern(causal=True, window=3)
    yield Pattern(causal=True, window=S // world + 1)
    yield Pattern(causal=True, cu_seqlens=(0, 1, 2, 5, S // 2 + 1, S))
    yield Pattern(causal=False, cu_seqlens=(0, 3, S - 2, S))
    yield Pattern(causal=True, window=4, cu_seqlens=(0, 7, S))
    for causal in (False, True):
        bs = world * 2
        yield Pattern(causal=causal, block_mask=random_block_mask(S // bs, S + world, 0.5, 1), block_size=bs)


def _schedule_specs():
    """(spec, sq, sk) of every MaskSpec task the schedule makes for a few worlds and layouts."""
    for world, layout in itertools.product((1, 2, 3), ("contiguous", "zigzag", "striped")):
        n = 12 if layout != "contiguous" else 12
        S = n * world
        for p in _patterns(S, world):
            if p.block_mask is not None and layout != "striped":
                # contiguous / zigzag need blocks that divide the local segments
                p = Pattern(causal=p.causal, block_mask=random_block_mask(S // 2, S, 0.5, 1), block_size=2)
            for qr, s in itertools.product(range(world), run_steps(layout, p, world, n)):
                for t in block_tasks(layout, p, qr, ring_source(qr, s, world), world, n):
                    if isinstance(t.mask, MaskSpec):
                        yield t.mask, t.q1 - t.q0, t.k1 - t.k0


def test_schedule_masks_cut_exactly():
    count = 0
    for spec, sq, sk in _schedule_specs():
        for rows in (2, 5, 16384):
            pieces = decompose(spec, sq, sk, rows)
            assert pieces is not None, spec
            assert torch.equal(_coverage(pieces, sq, sk), visible_mask(spec, sq, sk, "cpu").long()), (spec, rows)
        count += 1
    assert count > 50


class _Base(ReferenceKernel):
    """The reference kernel as the FULL/CAUSAL-only kernel behind the cut; records what it gets."""

    def __init__(self):
        self.kinds = set()
        self.sides = []  # min(query rows, keys) of each call

    def forward(self, q, k, v, scale, mask):
        self.kinds.add(mask if isinstance(mask, str) else "spec")
        self.sides.append(min(q.shape[1], k.shape[1]))
        return super().forward(q, k, v, scale, mask)

    def backward(self, dout, q, k, v, lse, delta, scale, mask, out=None):
        self.kinds.add(mask if isinstance(mask, str) else "spec")
        self.sides.append(min(q.shape[1], k.shape[1]))
        return super().backward(dout, q, k, v, lse, delta, scale, mask, out=out)


class _Recording(PiecewiseMasks, _Base):
    def __init__(self, max_rows=16384, min_side=1):
        super().__init__()
        self.max_rows = max_rows
        self.min_side = min_side


def _check_kernel(kern, spec, sq, sk, seed, hkv=2):
    g = torch.Generator().manual_seed(seed)
    B, H, D = 1, 4, 8
    q = torch.randn(B, sq, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, sk, hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, sk, hkv, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, sq, H, D, generator=g, dtype=torch.float64)
    ref = ReferenceKernel()
    o_ref, l_ref = ref.forward(q, k, v, 0.3, spec)
    # a running state from an earlier block, so the merge into it is exercised too
    out0 = torch.randn(B, sq, H, D, generator=g, dtype=torch.float64)
    lse0 = torch.randn(B, H, sq, generator=g, dtype=torch.float64)
    out, lse = out0.clone(), lse0.clone()
    kern.forward_into(q, k, v, 0.3, spec, out, lse)
    want_out, want_lse = out0.clone(), lse0.clone()
    ref.forward_into(q, k, v, 0.3, spec, want_out, want_lse)
    assert torch.allclose(out, want_out, atol=1e-12) and torch.allclose(lse, want_lse, atol=1e-12)
    o, l = kern.forward(q, k, v, 0.3, spec)
    seen = torch.isfinite(l_ref)
    assert torch.equal(torch.isfinite(l), seen)
    assert torch.allclose(o, o_ref, atol=1e-12) and torch.allclose(l[seen], l_ref[seen], atol=1e-12)
    # backward with the block's own lse as if it were the global one (any lse works for the check)
    lse_g = torch.where(seen, l_ref, 0.0)
    delta = torch.randn(B, H, sq, generator=g, dtype=torch.float64)
    want = ref.backward(do, q, k, v, lse_g, delta, 0.3, spec)
    for out_arg in (None, o_ref):
        got = kern.backward(do, q, k, v, lse_g, delta, 0.3, spec, out=out_arg)
        for a, b in zip(got, want):
            assert torch.allclose(a, b, atol=1e-10), spec


def test_piecewise_kernel_matches_reference_on_schedule_masks():
    kern = _Recording(max_rows=5)
    specs = list(_schedule_specs())
    for i, (spec, sq, sk) in enumerate(specs[::3]):
        _check_kernel(kern, spec, sq, sk, i, hkv=(1, 2, 4)[i % 3])
    assert kern.kinds <= {FULL, CAUSAL} and CAUSAL in kern.kinds and FULL in kern.kinds


def test_small_pieces_go_to_the_reference_kernel():
    """Slivers of a window band (down to 1 x 1, which cuDNN refuses) never reach the fused
    kernel, and the result is unchanged."""
    spec = MaskSpec(causal=True, window=7)
    assert min(min(p.q1 - p.q0, p.nk) for p in decompose(spec, 40, 40, 5)) == 1
    kern = _Recording(max_rows=5, min_side=3)
    _check_kernel(kern, spec, 40, 40, 0)
    assert kern.sides and min(kern.sides) >= 3


def test_piecewise_falls_back_to_dense_when_no_cut():
    # q and k positions with different steps under causal: no FULL/CAUSAL cut exists here
    spec = MaskSpec(causal=True, q_start=3, q_step=2, k_start=0, k_step=3)
    assert decompose(spec, 6, 5) is None
    kern = _Recording()
    _check_kernel(kern, spec, 6, 5, 0)
    assert kern.kinds == set()


@pytest.mark.parametrize("window", [1, 2, 7, 40])
def test_window_pieces_do_no_wasted_work(window):
    """A window cut computes exactly the visible pairs: what a FULL/CAUSAL kernel runs is the
    ideal work, not the bounding box."""
    spec = MaskSpec(causal=True, window=window)
    pieces = decompose(spec, 64, 64, 16)
    assert sum(p.pairs() for p in pieces) == int(visible_mask(spec, 64, 64, "cpu").sum())
