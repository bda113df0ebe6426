"""The CPU flash kernel (kernels/cpu_flash.py: torch's CPU flash attention op) against the
float64 reference kernel: forward, forward_into onto a running state, backward and
backward_into, on random inputs with GQA, lengths that divide nothing and every mask kind."""
import pytest
import torch

import triton_cases

from burstengine.masks import CAUSAL, FULL, STRICT, MaskSpec
from burstengine.kernels import cpu_flash
from burstengine.kernels.cpu_flash import CpuFlashKernel
from burstengine.kernels.reference import ReferenceKernel
from burstengine.kernels.verify import run_case
from burstengine.testing import fro_err

KERNEL = CpuFlashKernel()
MASKS = triton_cases.MASKS
# normwise error bounds: float32 accumulates like the reference; bf16 / fp16 round P and dS
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2, torch.float16: 3e-3}


class _Spy:
    """Stands in for torch.ops.aten in cpu_flash and counts the calls of the two ops."""

    def __init__(self):
        self.calls = {"fwd": 0, "bwd": 0}

    def __getattr__(self, name):
        op = getattr(torch.ops.aten, name)
        key = "bwd" if name.endswith("_backward") else "fwd"

        def counted(*a, **kw):
            self.calls[key] += 1
            return op(*a, **kw)

        return counted


@pytest.fixture
def spy(monkeypatch):
    s = _Spy()
    monkeypatch.setattr(cpu_flash, "aten", s)
    return s


def _check(r, tol):
    assert not r["nan"], r
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert r[name] <= tol, f"{name}: {r[name]:.2e} > {tol:.0e} ({r})"


# (mask name, dtype, batch, kv heads, Sk); Sq = 37, H = 4, D = 16: lengths that divide nothing
CASES = [
    ("full", torch.float32, 2, 2, 29),
    ("causal", torch.float32, 2, 1, 37),
    ("strict", torch.float32, 1, 2, 37),
    ("causal", torch.bfloat16, 1, 4, 37),
    ("strict", torch.float16, 2, 2, 37),
    ("full", torch.bfloat16, 1, 1, 53),
    ("window", torch.float32, 1, 2, 50),
    ("window-nocausal", torch.bfloat16, 1, 2, 37),
    ("striped", torch.float32, 1, 4, 29),
    ("docs", torch.float32, 1, 2, 37),
    ("docs-causal", torch.bfloat16, 1, 1, 37),
    ("block", torch.float32, 1, 2, 45),
    ("block-ragged-causal", torch.float16, 1, 4, 37),
    ("block-docs", torch.float32, 1, 2, 37),
]


@pytest.mark.parametrize("name,dtype,B,Hkv,Sk", CASES, ids=[f"{c[0]}-{str(c[1])[6:]}-b{c[2]}-kv{c[3]}-sk{c[4]}"
                                                              for c in CASES])
def test_into_matches_float64(spy, name, dtype, B, Hkv, Sk):
    # min_side 1: even the slivers of a sparse mask run on the op, so the op is what is checked
    kern = CpuFlashKernel()
    kern.min_side = 1
    r = run_case(kern, B=B, Sq=37, Sk=Sk, H=4, Hkv=Hkv, D=16, dtype=dtype, mask=MASKS[name], device="cpu",
                 seed=Sk + Hkv, poison_out=False)
    _check(r, TOL[dtype])
    if name != "block-docs":  # a block mask with documents has no FULL/CAUSAL cut: the reference runs
        assert spy.calls["fwd"] > 0 and spy.calls["bwd"] > 0, spy.calls


@pytest.mark.parametrize("mask", [FULL, CAUSAL, STRICT])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_entry_points(spy, mask, dtype):
    # forward: fresh (out, lse) in the inputs' dtype / float32; STRICT's row 0 is (0, -inf)
    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(2, 45, 6, 32, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(2, 45, 2, 32, generator=g).to(dtype) for _ in range(2))
    scale = 32 ** -0.5
    out, lse = KERNEL.forward(q, k, v, scale, mask)
    ref = ReferenceKernel()
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, do))
    ro, rl = ref.forward(q64, k64, v64, scale, mask)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl)) and not torch.isnan(lse).any()
    fin = torch.isfinite(rl)
    assert torch.isfinite(out).all()
    assert fro_err(out, ro) <= TOL[dtype] and fro_err(lse[fin], rl[fin]) <= TOL[dtype]
    # backward from the global lse and D, without and with the global out
    delta = (do64 * ro).sum(-1).transpose(1, 2)
    want = ref.backward(do64, q64, k64, v64, rl, delta, scale, mask)
    for o in (None, ro.to(dtype)):
        got = KERNEL.backward(do, q, k, v, rl.float(), delta.float(), scale, mask, out=o)
        for name, a, w in zip(("dq", "dk", "dv"), got, want):
            assert a.shape == w.shape and torch.isfinite(a).all(), name
            assert fro_err(a, w) <= TOL[dtype], (name, fro_err(a, w))
    assert spy.calls == {"fwd": 1, "bwd": 2}


def test_strict_row_zero_sees_nothing():
    q = torch.randn(1, 5, 2, 8)
    k, v = torch.randn(1, 5, 1, 8), torch.randn(1, 5, 1, 8)
    out, lse = KERNEL.forward(q, k, v, 0.3, STRICT)
    assert torch.isneginf(lse[:, :, 0]).all() and (out[:, 0] == 0).all()
    assert torch.isfinite(lse[:, :, 1:]).all() and torch.isfinite(out).all()
    # one row: nothing visible at all, and the op is never called on an empty block
    out, lse = KERNEL.forward(q[:, :1], k[:, :1], v[:, :1], 0.3, STRICT)
    assert torch.isneginf(lse).all() and (out == 0).all()


def test_nothing_visible_keeps_state():
    r = run_case(KERNEL, B=1, Sq=8, Sk=8, H=2, Hkv=1, D=8, dtype=torch.float32,
                 mask=MaskSpec(causal=True, q_start=0, k_start=100), device="cpu", poison_out=False)
    assert r["visible_frac"] == 0 and not r["nan"] and r["out"] == 0.0


def test_float64_and_odd_value_dims_run_the_reference(spy):
    # float64 is the oracle's dtype: the reference runs it, bit for bit
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 9, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    got = KERNEL.forward(q, k, v, 0.5, CAUSAL)
    want = ReferenceKernel().forward(q, k, v, 0.5, CAUSAL)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # a value head dim other than the query's is not the op's
    v2 = torch.randn(1, 9, 2, 12, generator=g)
    out, _ = KERNEL.forward(q.float(), k.float(), v2, 0.5, FULL)
    assert out.shape == (1, 9, 2, 12)
    assert spy.calls == {"fwd": 0, "bwd": 0}


def test_available_on_cpu_only():
    assert KERNEL.available("cpu") and not KERNEL.available("meta")
