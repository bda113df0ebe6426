"""Kernel interface (forward_into / backward_into with every mask kind and MaskSpec) on the
reference backend, and our Triton kernels under Triton's CPU interpreter, against float64."""
import sys

import pytest
import torch

import interp_cases
import triton_cases

from burstengine.kernels import KERNELS
from burstengine.masks import MaskSpec
from burstengine.kernels.verify import run_case

MASKS = triton_cases.MASKS


def _check(r, tol):
    assert not r["nan"], r
    for name in ("out", "lse", "dq", "dk", "dv"):
        assert r[name] <= tol, f"{name}: {r[name]:.2e} > {tol:.0e} ({r})"


@pytest.mark.parametrize("name", sorted(MASKS))
def test_reference_interface(name):
    # float32 reference kernel through the default forward_into (torch merge) / backward_into
    r = run_case(KERNELS["reference"], B=2, Sq=37, Sk=37, H=4, Hkv=2, D=16, dtype=torch.float32, mask=MASKS[name],
                 device="cpu", seed=1, poison_out=False)
    _check(r, 1e-5)
    assert 0 < r["visible_frac"] < 1 or name == "full"


def test_reference_empty_block_keeps_state():
    # a window that no (q, k) pair meets: state untouched, no NaN
    r = run_case(KERNELS["reference"], B=1, Sq=8, Sk=8, H=2, Hkv=1, D=8, dtype=torch.float32,
                 mask=MaskSpec(causal=True, q_start=0, k_start=100), device="cpu", poison_out=False)
    assert r["visible_frac"] == 0 and not r["nan"] and r["out"] == 0.0




# --- Triton kernels in the interpreter ------------------------------------------------------------
# They run in one subprocess (tests/triton_cases.py): TRITON_INTERPRET must be set before triton is
# first imported, which this pytest process may already have done.


@pytest.fixture(scope="module")
def triton_results():
    return interp_cases.run("triton_cases.py")


@pytest.mark.parametrize("case", triton_cases.CASE_IDS)
def test_triton_matches_float64(triton_results, case):
    r = triton_results[case]
    assert r["ran_triton"], "the case must run the Triton kernels, not the fallback"
    # bf16 / fp16 rounding of P and dS bound the error: ~4e-3 / ~5e-4 normwise
    _check(r, 1e-2 if r["dtype"] == "bfloat16" else 2e-3)
    if r["poison"]:
        assert r["poisoned_kv_rows"] > 0, "the case must poison a whole skipped tile"


@pytest.mark.parametrize("D", [64, 128])
def test_triton_plain_entry_points(triton_results, D):
    # forward/backward start from an empty state and return the input dtype
    r = triton_results[f"plain-d{D}"]
    assert r["dtypes"] == ["bfloat16"] * 4
    _check(r, 1e-2)


def test_triton_plain_forward_writes_skipped_tiles(triton_results):
    r = triton_results["plain-skipped"]
    _check(r, 1e-2)
    assert r["unseen_rows"] >= 16 * 4 and r["unseen_exact"]


def test_triton_delta(triton_results):
    # one Triton pass, float32, rows padded to 16 bytes for the backward's TMA loads
    r = triton_results["delta"]
    assert r["shape"] == [2, 3, 37] and r["dtype"] == "float32" and r["row_stride"] == 40
    assert r["err"] < 1e-6, r


def test_triton_nothing_visible(triton_results):
    r = triton_results["nothing-visible"]
    assert r["ran_triton"] and r["visible_frac"] == 0 and not r["nan"] and r["out"] == 0.0
    assert r["poisoned_kv_rows"] == 20


@pytest.mark.parametrize("case", ["fallback-fp32", "fallback-d32"])
def test_triton_falls_back(triton_results, case):
    # float32 inputs and head dim 32 are not ours: the reference runs instead, same results
    r = triton_results[case]
    assert not r["ran_triton"]
    _check(r, 1e-5 if r["dtype"] == "float32" else 1e-2)


def test_auto_table_covers_every_call():
    from burstengine.kernels import AUTO_TABLE, KERNELS as K

    for call in ("forward", "forward_into", "backward", "backward_into"):
        for kind in ("full", "causal", "strict", "spec"):
            rules = AUTO_TABLE[(call, kind)]
            assert rules[-1][0] is None and rules[-1][1] != "gluon", "the last rule must take any block size"
            assert all(name in K or name == "gluon" for _, name in rules)


def test_auto_sends_masks_with_large_pieces_to_cudnn():
    """A MaskSpec block goes to cuDNN piece by piece when most of its visible pairs lie in
    large FULL/CAUSAL pieces (wide windows), to Triton otherwise; packed documents always go to
    Triton (their piece shapes change with every batch, and cuDNN plans each new shape)."""
    from burstengine.kernels.registry import AUTO_TABLE, SPEC_PIECE_ROWS, AutoKernel

    auto = AutoKernel()
    n = 8 * SPEC_PIECE_ROWS
    if AUTO_TABLE[("forward", "spec")] != [(None, "triton")]:
        pytest.skip("the table no longer sends masks to triton")
    for d in ("forward", "backward", "backward_into"):
        assert auto.choose(d, MaskSpec(causal=True, window=4 * SPEC_PIECE_ROWS), n, n) == "cudnn"
        assert auto.choose(d, MaskSpec(causal=True, window=SPEC_PIECE_ROWS // 2), n, n) == "triton"
        # the step after the diagonal: only the last W keys of the previous block matter
        prev = MaskSpec(causal=True, window=4 * SPEC_PIECE_ROWS, q_start=n)
        assert auto.choose(d, prev, n, n) == "cudnn"
        few = torch.repeat_interleave(torch.arange(4), n // 4)
        many = torch.repeat_interleave(torch.arange(64), n // 64)
        assert auto.choose(d, MaskSpec(causal=True, q_doc=few, k_doc=few), n, n) == "triton"
        assert auto.choose(d, MaskSpec(causal=True, q_doc=many, k_doc=many), n, n) == "triton"
        wide = MaskSpec(causal=True, window=4 * SPEC_PIECE_ROWS, q_doc=few, k_doc=few)
        assert auto.choose(d, wide, n, n) == "triton"
        # no FULL/CAUSAL cut (different position steps under causal): Triton
        assert auto.choose(d, MaskSpec(causal=True, q_step=2, k_step=3), n, n) == "triton"


def test_auto_picks_by_block_size_and_falls_back_off_cuda(monkeypatch):
    from burstengine.kernels import AutoKernel

    # conftest turns Triton's interpreter on for the whole CPU session, which makes triton
    # "available" on CPU tensors; this test is about a machine where it is not
    monkeypatch.setenv("TRITON_INTERPRET", "0")

    table = {(d, m): [(None, "reference")] for d in ("forward", "backward") for m in ("full", "causal", "strict", "spec")}
    table[("forward", "strict")] = [(8, "reference"), (None, "triton")]
    auto = AutoKernel(table)
    small, large = torch.empty(1, 8, 2, 16), torch.empty(1, 9, 2, 16)
    assert auto.pick("forward", "strict", small, small).name == "reference"
    # the large block picks triton, which cannot run on CPU tensors: a mask kind goes to cuDNN's slot
    assert auto.pick("forward", "strict", large, large).name == "cudnn"
    table[("forward", "spec")] = [(None, "triton")]
    assert AutoKernel(table).pick("forward", MaskSpec(window=3), large, large).name == "reference"
    assert not auto.available("cpu")


def test_auto_ring_step_goes_to_gluon_where_it_takes_the_block(monkeypatch):
    """AutoKernel.forward_into runs a block the Gluon kernel takes there (through TritonKernel,
    which runs it), before the rest of its rules; blocks it does not take follow them.  The Gluon
    kernel itself needs a Hopper GPU, so its check is replaced here by one that takes blocks of a
    length divisible by 128."""
    import burstengine.kernels as kernels
    from burstengine.kernels import AutoKernel, registry

    seen = []

    def gluon(q, *a, **kw):
        return q.shape[1] % 128 == 0

    class Spy:
        def __init__(self, name):
            self.name = name

        def forward_into(self, *a):
            seen.append(self.name)

        def available(self, device):
            return True

    monkeypatch.setattr(registry, "gluon_takes", gluon)
    monkeypatch.setitem(kernels.KERNELS, "cudnn", Spy("cudnn"))
    monkeypatch.setitem(kernels.KERNELS, "triton", Spy("gluon"))
    auto = AutoKernel()
    for n in (256, 200):
        q = torch.empty(1, n, 2, 16)
        auto.forward_into(q, q, q, 1.0, "full", torch.empty(1, n, 2, 16), torch.empty(1, 2, n))
    assert seen == ["gluon", "cudnn"]


def _fake_gluon_backward(monkeypatch, module):
    """A stand-in for kernels/gluon/<module>.py's backward_into (the Gluon kernels need a Hopper
    GPU): it records each call and writes dQ += 1, dK = 2, dV = 3; returns the calls."""
    import types

    import burstengine.kernels.gluon as gluon

    calls = []

    def backward_into(dout, q, k, v, lse2, delta, scale, mask_lo, dq, dk, dv, fresh):
        calls.append(dict(mask_lo=mask_lo, fresh=fresh, dq=dq, zero=bool((dq == 0).all()), lse2=lse2.clone()))
        dq.add_(1.0)
        dk.fill_(2.0)
        dv.fill_(3.0)

    fake = types.SimpleNamespace(backward_into=backward_into)
    monkeypatch.setattr(gluon, module, fake, raising=False)
    monkeypatch.setitem(sys.modules, f"burstengine.kernels.gluon.{module}", fake)
    return calls


def test_triton_backward_goes_to_gluon_where_it_takes_the_block(monkeypatch):
    """TritonKernel hands the backward of a block that kernels/gluon/bwd.py takes to it: the plain
    backward with a fresh, zeroed float32 dQ (returned in q's dtype) and ``fresh`` set, the ring
    step's backward_into with the caller's accumulators, each with its mask's bound.  The Gluon
    kernel needs a Hopper GPU, so a stand-in that takes lengths divisible by 128 answers here."""
    pytest.importorskip("triton")
    import burstengine.kernels.triton.kernel as tk
    from burstengine.masks import CAUSAL, FULL, STRICT

    calls = _fake_gluon_backward(monkeypatch, "bwd")
    monkeypatch.setattr(tk, "gluon_bwd_takes",
                        lambda q, k, v, mask, dout, *g, **kw: mask in (FULL, CAUSAL, STRICT) and q.shape[1] % 128 == 0)
    kern = tk.TritonKernel()
    S, H, D = 256, 2, 64
    q, k, v, do = (torch.randn(1, S, H, D).to(torch.bfloat16) for _ in range(4))
    lse, delta = torch.randn(1, H, S), torch.randn(1, H, S)
    lse[0, 0, 0] = float("-inf")
    dq, dk, dv = kern.backward(do, q, k, v, lse, delta, D ** -0.5, CAUSAL)
    c = calls[-1]
    assert (c["mask_lo"], c["fresh"], c["dq"].dtype, c["zero"]) == (0, True, torch.float32, True)
    # lse reaches the kernel in base 2, +inf where a row saw nothing
    assert c["lse2"][0, 0, 0] == float("inf")
    assert torch.allclose(c["lse2"][0, 1], lse[0, 1] / torch.log(torch.tensor(2.0)))
    assert dq.dtype == q.dtype and bool((dq == 1).all()) and bool((dk == 2).all()) and bool((dv == 3).all())
    acc = [torch.ones(t.shape) for t in (q, k, v)]
    for mask, lo in ((STRICT, 1), (FULL, None)):
        kern.backward_into(do, q, k, v, lse, delta, D ** -0.5, mask, *acc)
        c = calls[-1]
        assert (c["mask_lo"], c["fresh"]) == (lo, False) and c["dq"] is acc[0]
    assert bool((acc[0] == 3).all())


def test_triton_backward_at_d256_goes_to_bwd_wide_or_falls_back(monkeypatch):
    """d=256 (no Triton config): the backward goes to kernels/gluon/bwd_wide.py where Gluon takes
    it, asked with contiguous dK/dV whatever k's strides (a strided k once reached self.config[256]:
    KeyError), and to the fallback, exact, where it does not (stand-ins for the Hopper kernels)."""
    pytest.importorskip("triton")
    import burstengine.kernels.triton.kernel as tk
    from burstengine.kernels.reference import ReferenceKernel
    from burstengine.masks import CAUSAL

    calls = _fake_gluon_backward(monkeypatch, "bwd_wide")
    asked = []

    def takes(q, k, v, mask, dout, dq=None, dk=None, dv=None, **kw):
        # Gluon's rule for its outputs: rows it can write (contiguous here)
        asked.append((dq is None, dk is not None and dk.is_contiguous()))
        return dk is None or (dk.is_contiguous() and dv.is_contiguous())

    monkeypatch.setattr(tk, "gluon_bwd_takes", takes)
    kern = tk.TritonKernel()
    B, S, H, D = 2, 256, 2, 256
    q, do = (torch.randn(B, S, H, D).to(torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(S, B, 1, D).to(torch.bfloat16).transpose(0, 1) for _ in range(2))  # sequence-first
    assert not k.is_contiguous()
    lse, delta = torch.randn(B, H, S), torch.randn(B, H, S)
    dq, dk, dv = kern.backward(do, q, k, v, lse, delta, D ** -0.5, CAUSAL)
    assert len(calls) == 1 and calls[0]["fresh"] and all(c for _, c in asked)
    assert bool((dk == 2).all()) and bool((dv == 3).all())
    # Gluon declines inside (its answer changes with the real dQ): the reference's gradients
    monkeypatch.setattr(tk, "gluon_bwd_takes", lambda q, k, v, mask, dout, dq=None, *g, **kw: dq is None)
    o, lse = ReferenceKernel().forward(q, k, v, D ** -0.5, CAUSAL)
    delta = kern.delta(o, do)
    got = kern.backward(do, q, k, v, lse, delta, D ** -0.5, CAUSAL)
    want = ReferenceKernel().backward(do, q, k, v, lse, delta, D ** -0.5, CAUSAL)
    for a, b in zip(got, want):
        assert torch.allclose(a.float(), b.float(), atol=2e-2, rtol=2e-2)


def test_gluon_backward_declines_what_it_cannot_run():
    """The real check: never on CPU tensors, never for a MaskSpec (those stay in the Triton kernels)."""
    from burstengine.masks import CAUSAL
    from burstengine.kernels.triton.kernel import gluon_bwd_takes

    q = torch.empty(1, 256, 2, 128, dtype=torch.bfloat16)
    assert not gluon_bwd_takes(q, q, q, CAUSAL, q)
    assert not gluon_bwd_takes(q, q, q, MaskSpec(window=8), q)


def test_triton_mask_arguments_built_once_per_spec():
    """The device-side mask arguments (document ids copied to the device, tile bounds) are built
    once per MaskSpec object and shape, not at every launch: the copy waits for the stream, and
    at every layer's launches it left the GPU idle 30% of a packed-document training step."""
    import gc
    import weakref

    pytest.importorskip("triton")
    from burstengine import masks
    from burstengine.kernels.triton.kernel import TritonKernel

    k = TritonKernel()
    cpu = torch.device("cpu")
    qd = torch.tensor([0] * 5 + [1] * 20 + [2] * 12)
    spec = MaskSpec(causal=True, q_doc=qd, k_doc=qd)
    first = k._mask_args(spec, 37, 37, 16, 16, True, cpu)
    built = []
    build = k._build_mask_args
    k._build_mask_args = lambda *a: built.append(a[3:5]) or build(*a)
    assert k._mask_args(spec, 37, 37, 16, 16, True, cpu) is first and not built
    k._mask_args(spec, 37, 37, 32, 16, False, cpu)  # another tile shape: built
    twin = MaskSpec(causal=True, q_doc=qd, k_doc=qd)  # equal fields, another object: built
    k._mask_args(twin, 37, 37, 16, 16, True, cpu)
    assert built == [(32, 16), (16, 16)]
    fresh = build(spec, 37, 37, 16, 16, True, cpu)
    for a, b in zip(first[0], fresh[0]):
        assert (a is b) if not isinstance(a, torch.Tensor) else torch.equal(a, b)
    assert first[1:] == fresh[1:]
    plain = MaskSpec(causal=True)
    k._mask_args(plain, 37, 37, 16, 16, True, cpu)  # no tensors: nothing kept
    assert plain not in masks._DERIVED and twin in masks._DERIVED
    gone = weakref.ref(spec)
    del spec
    gc.collect()
    assert gone() is None and twin in masks._DERIVED  # entries go with their spec
