"""fused_linear_cross_entropy against float64 F.cross_entropy(hidden @ weight.T): loss, d(hidden)
and d(weight), both implementations of the per-chunk step, and context-parallel sharding."""
import os

import pytest
import torch
import torch.nn.functional as F

import burstengine as be
import lce_cases
from burstengine.loss.fused_ce_triton import triton_available

TOL = {torch.float64: 1e-12, torch.float32: 2e-5, torch.bfloat16: 1.5e-2}
OPTIONS = {"plain": {}, "softcap_z": {"softcap": 3.0, "z_loss": 1e-2}}


def _upstream(reduction, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if reduction == "none":
        return torch.randn(shape, generator=g, dtype=torch.float64)
    return torch.tensor(1.7, dtype=torch.float64)  # not 1: the backward must scale what the forward made


def _check(impl, dtype, reduction, option, N=37, V=203, d=16, chunk=8, batch=None, seed=0):
    h, w, y = lce_cases.make_inputs(seed, N, d, V, dtype, batch=batch)
    up = _upstream(reduction, y.shape, seed)
    errs = lce_cases.check_once(h, w, y, up, reduction=reduction, chunk_size=chunk, impl=impl, **OPTIONS[option])
    for name, e in zip(("loss", "dh", "dw"), errs):
        assert e <= TOL[dtype], f"{impl} {dtype} {reduction} {option}: {name} err {e:.2e}"


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_torch_path(dtype, reduction, option):
    # V = 203 with tiles of 8 rows x vocab: the last chunk and the chunk sizes do not divide
    _check("torch", dtype, reduction, option, batch=2)


@pytest.fixture
def interpret():
    # these cases use CPU tensors, so they need Triton's interpreter (burstengine bench lce
    # --check covers the compiled kernel on a GPU)
    if not triton_available():
        pytest.skip("triton is not installed")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("TRITON_INTERPRET is not 1 (conftest.py sets it on machines without CUDA)")


# the interpreter runs every program in Python: few rows, V = 200 = one full and one partial tile of 128
@pytest.mark.parametrize("dtype,reduction,option", [
    (torch.float32, "mean", "plain"), (torch.float32, "sum", "softcap_z"), (torch.float32, "none", "softcap_z"),
    (torch.bfloat16, "mean", "softcap_z"), (torch.bfloat16, "none", "plain")], ids=str)
def test_triton_path(interpret, dtype, reduction, option):
    _check("triton", dtype, reduction, option, N=13, V=200, chunk=5)


def test_triton_matches_torch_rows(interpret):
    """The per-chunk kernels side by side on the same logits: losses and gradients agree."""
    from burstengine.loss.fused_ce import ce_rows_torch
    from burstengine.loss.fused_ce_triton import ce_rows_triton

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=g) * 4
    labels = torch.tensor([0, 299, -100, 128, 127, 5])
    scale = torch.rand(6, generator=g) + 0.5
    outs = []
    for fn in (ce_rows_torch, ce_rows_triton):
        buf, loss = logits.clone(), torch.empty(6)
        fn(buf, labels, loss, scale, ignore_index=-100, softcap=2.5, z_loss=0.1, write_grad=True)
        outs.append((buf, loss))
    assert torch.allclose(outs[0][1], outs[1][1], rtol=1e-5, atol=1e-5)
    assert torch.allclose(outs[0][0], outs[1][0], rtol=1e-5, atol=1e-6)
    assert outs[0][0][2].abs().max() == 0 and outs[0][1][2] == 0  # ignored row: no loss, no gradient


def test_default_chunk_and_3d_shapes():
    h, w, y = lce_cases.make_inputs(1, 50, 8, 64, torch.float32, batch=3)
    up = _upstream("none", y.shape, 1)
    errs = lce_cases.check_once(h, w, y, up, reduction="none")
    assert max(errs) <= TOL[torch.float32]
    assert be.fused_linear_cross_entropy(h, w, y, reduction="none").shape == y.shape


def test_frozen_inputs_and_bf16_accumulator():
    h, w, y = lce_cases.make_inputs(2, 40, 16, 100, torch.float32)
    ref, h64, w64 = lce_cases.reference(h, w, y)
    ref.backward()
    hl = h.clone().requires_grad_()
    be.fused_linear_cross_entropy(hl, w, y, chunk_size=9).backward()  # frozen weight: no dW work
    assert torch.allclose(hl.grad.double(), h64.grad, rtol=1e-4, atol=1e-6)
    wl = w.clone().requires_grad_()
    be.fused_linear_cross_entropy(h, wl, y, chunk_size=9).backward()  # frozen hidden (e.g. a probe)
    assert torch.allclose(wl.grad.double(), w64.grad, rtol=1e-4, atol=1e-6)
    hb, wb = h.bfloat16(), w.bfloat16().requires_grad_()
    be.fused_linear_cross_entropy(hb, wb, y, chunk_size=9, accum_dtype=torch.bfloat16).backward()
    ref_b, _, wb64 = lce_cases.reference(hb, wb, y)
    ref_b.backward()
    assert be.testing.fro_err(wb.grad, wb64.grad) < 2e-2


def test_all_ignored_is_nan_with_zero_grads():
    h, w, y = lce_cases.make_inputs(3, 10, 8, 20, torch.float32, ignored=1.0)
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = be.fused_linear_cross_entropy(hl, wl, y)
    ref = F.cross_entropy(h @ w.T, y)
    assert torch.isnan(loss) and torch.isnan(ref)
    loss.backward()
    assert hl.grad.abs().max() == 0 and wl.grad.abs().max() == 0


def test_second_backward_raises():
    h, w, y = lce_cases.make_inputs(4, 10, 8, 20, torch.float32)
    loss = be.fused_linear_cross_entropy(h.requires_grad_(), w, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        loss.backward()


@pytest.mark.parametrize("kw,match", [
    (dict(reduction="avg"), "reduction"),
    (dict(softcap=0.0), "softcap"),
    (dict(z_loss=-1.0), "z_loss"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(total_tokens=0), "total_tokens"),
    (dict(total_tokens=5, reduction="sum"), "total_tokens"),
    (dict(impl="cuda"), "impl"),
    (dict(ignore_index=1.5), "ignore_index"),
    (dict(weight=torch.randn(20, 7)), "weight must be"),
    (dict(weight=torch.randn(20, 8, dtype=torch.float64)), "dtypes differ"),
    (dict(labels=torch.zeros(10)), "integer"),
    (dict(labels=torch.zeros(9, dtype=torch.long)), "labels shape"),
    (dict(labels=torch.full((10,), 20)), "outside"),
    (dict(group="not a group"), "distributed"),
])
def test_bad_input_raises_value_error(kw, match):
    args = dict(hidden=torch.randn(10, 8), weight=torch.randn(20, 8), labels=torch.randint(0, 20, (10,)))
    for k in ("hidden", "weight", "labels"):
        if k in kw:
            args[k] = kw.pop(k)
    with pytest.raises(ValueError, match=match):
        be.fused_linear_cross_entropy(args["hidden"], args["weight"], args["labels"], **kw)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_context_parallel_matches_unsharded(pool, world):
    for i, (reduction, layout, mode) in enumerate([("mean", "zigzag", "group"), ("sum", "striped", "group"),
                                                   ("mean", "contiguous", "total")]):
        for rank, errs in enumerate(pool.run(lce_cases.sharded, 10 * world + i, reduction, layout, mode,
                                             world=world)):
            for name, e in zip(("loss", "dh", "dw"), errs):
                assert e <= TOL[torch.float32], f"world {world} rank {rank} {reduction} {layout} {mode}: {name} {e:.2e}"


def test_bad_label_on_one_rank_raises_everywhere(pool):
    msgs = pool.run(lce_cases.bad_label_on_one_rank, world=4)
    assert all(m is not None and "outside [0, 10)" in m for m in msgs), msgs


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the aten ops that read device values back to the host: .item()/bool()/int()
    (_local_scalar_dense), nonzero, and indexing with a boolean mask (a nonzero inside)."""

    SYNCING = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select")

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else [x])]
        if name.startswith(self.SYNCING) or (name.startswith(("aten.index", "aten._index_put")) and any(
                isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in flat)):
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_no_host_sync_without_label_check(reduction):
    """check_labels=False (the trainer's fused loss): forward and backward read nothing back to the
    host, the mean's token count included; the default check is the one read."""
    h, w, y = lce_cases.make_inputs(0, 37, 16, 203, torch.float32)
    y[3] = -100
    runs = {}
    for check in (False, True):
        hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
        with _HostReads() as reads:
            loss = be.fused_linear_cross_entropy(hl, wl, y, reduction=reduction, chunk_size=8, impl="torch",
                                                 check_labels=check)
            (loss * 1.7).backward()
        runs[check] = (reads.seen, loss.detach(), hl.grad, wl.grad)
    assert runs[False][0] == [], runs[False][0]
    assert runs[True][0] == ["aten._local_scalar_dense"], runs[True][0]
    for a, b in zip(runs[False][1:], runs[True][1:]):
        assert torch.equal(a, b)  # the check changes nothing but the read


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_unchecked_bad_label_is_nan(impl):
    """Without the check a label outside the vocabulary is never read out of bounds: its loss and
    its row's gradient are NaN (loud), the other rows' gradients stay finite."""
    if impl == "triton" and (not triton_available() or os.environ.get("TRITON_INTERPRET") != "1"):
        pytest.skip("needs triton's interpreter")
    h, w, y = lce_cases.make_inputs(1, 13, 16, 200, torch.float32)
    y[4], y[9] = 200, -3
    rows = be.fused_linear_cross_entropy(h, w, y, reduction="none", chunk_size=5, impl=impl, check_labels=False)
    assert rows.isnan().tolist() == [i in (4, 9) for i in range(13)]
    hl = h.clone().requires_grad_()
    loss = be.fused_linear_cross_entropy(hl, w, y, reduction="mean", chunk_size=5, impl=impl, check_labels=False)
    loss.backward()
    assert loss.isnan()
    bad = hl.grad.isnan().all(1)
    assert bad.tolist() == [i in (4, 9) for i in range(13)] and hl.grad[~bad].isfinite().all()
