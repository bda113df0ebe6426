"""Numerically hard inputs give finite, accurate results; repeated runs are bit-identical.

* fully masked rows (a kernel block, or the merge of an empty block) stay (0, -inf), never NaN;
* scores of +-1e4 in fp32, q/k/v of norm ~1e3 in bf16/fp16, softmax_scale 1e-30, 1e-42
  (subnormal in fp32) and 1e6 through the ring: finite, and within the tolerance below of
  float64.  dq and dk of a saturated softmax are ~0 exactly and rounding noise in any float
  kernel, so they are measured against softmax_scale * |dO| * |V| * |K| (|Q|), the size of the
  terms that make them (see numerics_cases.extreme);
* deterministic mode: the same call repeated under torch.use_deterministic_algorithms(True)
  gives bit-identical out, lse and gradients on every rank.
"""
import pytest
import torch

import numerics_cases
from burstengine.kernels.base import merge_
from burstengine.masks import MaskSpec
from burstengine.kernels.reference import ReferenceKernel

TOL = {"logits_1e4": 1e-4, "bf16_large": 2e-2, "f16_large": 5e-3, "scale_tiny": 1e-5, "scale_subnormal": 1e-3,
       "scale_huge": 1e-5}


@pytest.mark.parametrize("world", [2, 4])
def test_extreme_inputs_through_the_ring(pool, world):
    assert set(TOL) == set(numerics_cases.KINDS)
    for rank, rows in enumerate(pool.run(numerics_cases.extreme_all, world=world)):
        for r in rows:
            where = f"rank {rank} {r['kind']} {r['layout']} {r['backward']}"
            assert r["finite"], where
            for key in ("out", "lse", "dq", "dk", "dv"):
                assert r[key] <= TOL[r["kind"]], f"{where}: {key} error {r[key]:.2e}"


@pytest.mark.parametrize("world", [2, 4])
def test_repeated_runs_are_bit_identical(pool, world):
    for rank, rows in enumerate(pool.run(numerics_cases.repeat_all, world=world)):
        for r in rows:
            assert all(r["same"]), (rank, r)


def _qkv(Sq=6, Sk=5, H=2, Hkv=1, D=8, scale=1.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(1, s, h, D, generator=g) * scale).to(dtype) for s, h in ((Sq, H), (Sk, Hkv), (Sk, Hkv))]


@pytest.mark.parametrize("logit_scale", [1.0, 100.0])
def test_fully_masked_rows_in_a_block(logit_scale):
    """Rows 0 and 3 see no key of the block (block mask off for them): out 0, lse -inf, no NaN
    in the forward, and zero gradients for them in the backward."""
    q, k, v = _qkv(scale=logit_scale)
    bm = torch.ones(6, 5, dtype=torch.bool)
    bm[[0, 3]] = False
    spec = MaskSpec(block_mask=bm, block_size=1)
    kern = ReferenceKernel()
    out, lse = kern.forward(q, k, v, 0.35, spec)
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, [0, 3]], torch.zeros_like(out[:, [0, 3]]))
    assert torch.isneginf(lse[:, :, [0, 3]]).all() and torch.isfinite(lse[:, :, [1, 2, 4, 5]]).all()
    dout = torch.randn_like(out)
    delta = (dout * out).sum(-1).transpose(1, 2)
    dq, dk, dv = kern.backward(dout, q, k, v, lse, delta, 0.35, spec)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    assert torch.equal(dq[:, [0, 3]], torch.zeros_like(dq[:, [0, 3]]))
    # the visible rows match a plain softmax over their keys
    s = q[0, 1].double() @ k[0, :, 0].double().T * 0.35  # (heads, keys): both q heads use kv head 0
    assert torch.allclose(lse[0, :, 1].double(), torch.logsumexp(s[:, bm[1]], -1), rtol=1e-6)


def test_merge_with_empty_sides_is_exact():
    """Merging an all-masked block (0, -inf) into a running result leaves it bit-identical;
    merging into an empty running result gives exactly the block; empty with empty stays
    (0, -inf)."""
    g = torch.Generator().manual_seed(1)
    o = torch.randn(1, 4, 2, 8, generator=g)
    l = torch.randn(1, 2, 4, generator=g) * 1e4  # extreme lse values too
    empty_o, empty_l = torch.zeros_like(o), torch.full_like(l, float("-inf"))
    out, lse = o.clone(), l.clone()
    merge_(out, lse, empty_o, empty_l)
    assert torch.equal(out, o) and torch.equal(lse, l)
    out, lse = empty_o.clone(), empty_l.clone()
    merge_(out, lse, o, l)
    assert torch.equal(out, o) and torch.equal(lse, l)
    out, lse = empty_o.clone(), empty_l.clone()
    merge_(out, lse, empty_o, empty_l)
    assert torch.equal(out, empty_o) and torch.isneginf(lse).all()
