"""One kernel-level correctness case, shared by the CPU tests (Triton interpreter) and the GPU
check script (burstengine bench lao-check): run ``forward_into`` onto a random running state and
``backward_into`` onto random accumulators, and compare with the float64 reference kernel on
the same (rounded) inputs.

The running state is valid but not empty: rows with lse = -inf have O = 0, except that with
``poison_out`` those the block makes visible hold NaN (a fused merge must ignore O where
lse = -inf; the torch merge relies on the O = 0 that the ring starts from).  K/V
rows that no query can see may be poisoned too, in whole aligned groups of ``poison_kv`` rows
(a multiple of the kernel's k tiles): a kernel that loads a tile it should have skipped turns
0 * NaN into NaN.
"""
from __future__ import annotations

import torch

from ..testing import fro_err
from ..masks import visible_mask
from .base import merge_
from .reference import ReferenceKernel

NAMES = ("out", "lse", "dq", "dk", "dv")


def _running_state(rnd, g, B, Sq, H, D, vis, device, poison_out, empty_frac=0.25):
    """Earlier blocks' (out, lse), some rows still empty (O = 0, lse = -inf): the reference copy
    (out0, lse0) and the kernel's (out_k, lse_k), whose empty rows hold NaN where this block makes
    them visible when ``poison_out``."""
    out0 = rnd(B, Sq, H, D).float()
    lse0 = (rnd(B, H, Sq) + 2.0).float()
    empty = torch.rand(B, H, Sq, generator=g).to(device) < empty_frac
    lse0[empty] = float("-inf")
    out0.transpose(1, 2)[empty] = 0.0
    out_k = out0.clone()
    if poison_out:
        out_k[empty.transpose(1, 2) & vis.any(1)[None, :, None]] = float("nan")
    return out0, lse0, out_k, lse0.clone()


def _merged_errors(out_k, lse_k, out0, lse0, o_blk, l_blk):
    """The float64 merge of the block result (o_blk, l_blk) into (out0, lse0), and the kernel's
    state's normwise errors against it: ((out, lse) errors, merged out, merged lse); lse's error is
    inf when the rows left empty differ."""
    out_r, lse_r = out0.double(), lse0.double()
    merge_(out_r, lse_r, o_blk.double(), l_blk.double())
    fin = torch.isfinite(lse_r)
    same_inf = bool((torch.isinf(lse_k) == ~fin).all())
    errs = (fro_err(out_k, out_r), fro_err(lse_k[fin], lse_r[fin]) if same_inf else float("inf"))
    return errs, out_r, lse_r


def run_case(kernel, B, Sq, Sk, H, Hkv, D, dtype, mask, device, seed=0, poison_kv=0, poison_out=True,
             empty_frac=0.25):
    """-> dict of normwise errors (out, lse, dq, dk, dv; inf on NaN) plus bookkeeping."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device)

    q, k, v = rnd(B, Sq, H, D).to(dtype), rnd(B, Sk, Hkv, D).to(dtype), rnd(B, Sk, Hkv, D).to(dtype)
    do = rnd(B, Sq, H, D).to(dtype)
    scale = D ** -0.5
    vis = visible_mask(mask, Sq, Sk, device)
    vis = torch.ones(Sq, Sk, dtype=torch.bool, device=device) if vis is None else vis
    dead = torch.zeros(Sk, dtype=torch.bool, device=device)
    if poison_kv:
        dead = ~vis.any(0)
        pad = -Sk % poison_kv
        dead = torch.cat([dead, dead.new_ones(pad)]).view(-1, poison_kv).all(1, keepdim=True)
        dead = dead.expand(-1, poison_kv).reshape(-1)[:Sk]
        k[:, dead] = float("nan")
        v[:, dead] = float("nan")
    ref = ReferenceKernel()
    q64, k64, v64, do64 = (t.double().nan_to_num(0.0) for t in (q, k, v, do))

    out0, lse0, out_k, lse_k = _running_state(rnd, g, B, Sq, H, D, vis, device, poison_out, empty_frac)
    kernel.forward_into(q, k, v, scale, mask, out_k, lse_k)
    o_blk, l_blk = ref.forward(q64, k64, v64, scale, mask)
    (out_err, lse_err), out_r, lse_r = _merged_errors(out_k, lse_k, out0, lse0, o_blk, l_blk)

    # backward of the whole (merged) attention restricted to this block, global lse and delta
    delta = (do64 * out_r).sum(-1).transpose(1, 2)
    acc = [rnd(*t.shape).float() for t in (q, k, v)]
    acc_k = [a.clone() for a in acc]
    kernel.backward_into(do, q, k, v, lse_r.float(), delta.float(), scale, mask, *acc_k)
    grads = ref.backward(do64, q64, k64, v64, lse_r, delta, scale, mask)
    refs = [a.double() + gr for a, gr in zip(acc, grads)]
    # compare the increments, so a large accumulator does not hide a wrong gradient
    errs = {"out": out_err, "lse": lse_err}
    for name, a0, ak, r in zip(("dq", "dk", "dv"), acc, acc_k, refs):
        errs[name] = fro_err(ak.double() - a0.double(), r - a0.double())
    errs["nan"] = not all(torch.isfinite(t).all() for t in (out_k, *acc_k)) or bool(torch.isnan(lse_k).any())
    errs["visible_frac"] = vis.float().mean().item()
    errs["poisoned_kv_rows"] = int(dead.sum())
    return errs


def run_forward_case(kernel, B, Sq, Sk, H, Hkv, D, dtype, mask, device, seed=0, oracle=None,
                     poison_out=True) -> dict:
    """A forward-only kernel's case (kernels/fp8.py): ``forward_into`` onto a random running state
    whose empty rows hold NaN where the block makes them visible (``poison_out``: a fused merge
    must not read them; the torch merge needs them 0, as in :func:`run_case`), against the float64 reference
    merged the same way -> {"out", "lse", "nan"}; with ``oracle`` (q, k, v, scale, mask) -> (o, lse),
    a block result to merge instead of the reference's, also {"out_oracle", "lse_oracle"} (the kernel
    against its own arithmetic done in torch)."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device)

    q, k, v = rnd(B, Sq, H, D).to(dtype), rnd(B, Sk, Hkv, D).to(dtype), rnd(B, Sk, Hkv, D).to(dtype)
    scale = D ** -0.5
    vis = visible_mask(mask, Sq, Sk, device)
    vis = torch.ones(Sq, Sk, dtype=torch.bool, device=device) if vis is None else vis
    out0, lse0, out_k, lse_k = _running_state(rnd, g, B, Sq, H, D, vis, device, poison_out)
    kernel.forward_into(q, k, v, scale, mask, out_k, lse_k)
    errs = {"nan": not bool(torch.isfinite(out_k).all()) or bool(torch.isnan(lse_k).any()),
            "visible_frac": vis.float().mean().item()}
    refs = {"": ReferenceKernel().forward(q.double(), k.double(), v.double(), scale, mask)}
    if oracle is not None:
        refs["_oracle"] = oracle(q, k, v, scale, mask)
    for tag, blk in refs.items():
        (errs["out" + tag], errs["lse" + tag]), _, _ = _merged_errors(out_k, lse_k, out0, lse0, *blk)
    return errs


def _plain_inputs(B, S, H, Hkv, D, dtype, device, seed):
    # q, k, v, then dO (drawn last, so q, k, v are the same whether or not dO is used)
    g = torch.Generator(device="cpu").manual_seed(seed)
    return tuple(torch.randn(B, S, h, D, generator=g).to(device=device, dtype=dtype) for h in (H, Hkv, Hkv, H))


def run_plain_forward(kernel, B, S, H, Hkv, D, dtype, mask, device, seed=0) -> dict:
    """Normwise errors of ``kernel.forward`` (a fresh output, no running state) against float64:
    {"fwd_out", "fwd_lse", "fwd_nan"}.  The kernel allocates its output uninitialised, so a row
    it left unwritten holds stale memory: that shows in the errors or as NaN, though not
    with certainty (run_case's poisoned buffers are the sure check for forward_into)."""
    q, k, v, _ = _plain_inputs(B, S, H, Hkv, D, dtype, device, seed)
    scale = D ** -0.5
    out, lse = kernel.forward(q, k, v, scale, mask)
    ro, rl = ReferenceKernel().forward(q.double(), k.double(), v.double(), scale, mask)
    return {"fwd_out": fro_err(out, ro), "fwd_lse": fro_err(lse, rl),
            "fwd_nan": not bool(torch.isfinite(out).all() and torch.isfinite(lse).all())}


def run_plain_backward(kernel, B, S, H, Hkv, D, dtype, mask, device, seed=0) -> dict:
    """Normwise errors of ``kernel.backward`` (fresh gradients, from the global lse and D) against
    float64: {"bwd_dq", "bwd_dk", "bwd_dv", "bwd_nan"}.  The gradients come back in buffers the
    kernel allocated: as in :func:`run_plain_forward`, a row left unwritten shows as an error or
    NaN, though not with certainty."""
    q, k, v, do = _plain_inputs(B, S, H, Hkv, D, dtype, device, seed)
    scale = D ** -0.5
    ref = ReferenceKernel()
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, do))
    o, lse = ref.forward(q64, k64, v64, scale, mask)
    delta = (do64 * o).sum(-1).transpose(1, 2)
    got = kernel.backward(do, q, k, v, lse.float(), delta.float(), scale, mask)
    want = ref.backward(do64, q64, k64, v64, lse, delta, scale, mask)
    errs = {f"bwd_{n}": fro_err(a, r) for n, a, r in zip(("dq", "dk", "dv"), got, want)}
    errs["bwd_nan"] = not all(bool(torch.isfinite(t).all()) for t in got)
    return errs
