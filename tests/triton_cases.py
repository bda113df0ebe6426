"""Kernel cases for tests/kernels/test_kernels.py.  Run as a script, it runs our Triton kernels under
Triton's CPU interpreter on every case and prints one JSON line {case id: errors}."""
import json
import sys

import torch

from burstengine.masks import CAUSAL, FULL, STRICT
from burstengine.masks import MaskSpec

QDOC = torch.tensor([0] * 10 + [1] * 20 + [3] * 7)
KDOC = torch.tensor([0] * 5 + [1] * 11 + [3] * 16 + [4] * 5)  # rows 32.. are a document no query has

MASKS = {
    "full": FULL,
    "causal": CAUSAL,
    "strict": STRICT,
    "window": MaskSpec(causal=True, window=7, q_start=13),
    "window-nocausal": MaskSpec(window=5, q_start=10),
    "striped": MaskSpec(causal=True, q_start=1, q_step=4, k_start=2, k_step=4),
    "docs": MaskSpec(q_doc=QDOC, k_doc=KDOC),
    "docs-causal": MaskSpec(causal=True, q_doc=QDOC, k_doc=KDOC),
    "block": MaskSpec(block_mask=torch.tensor([[1, 0, 1], [0, 0, 1], [1, 0, 0]], dtype=torch.bool), block_size=16),
    "block-ragged-causal": MaskSpec(causal=True, block_mask=torch.tensor(
        [[1, 0, 1, 1], [1, 1, 0, 1], [0, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool), block_size=10),
    "block-docs": MaskSpec(q_doc=QDOC, k_doc=KDOC, block_mask=torch.tensor(
        [[1, 1, 0], [0, 1, 1], [1, 0, 1]], dtype=torch.bool), block_size=16),
}

# (mask, head dim, dtype, batch, kv heads, Sk, poison granularity): Sq = 37, H = 4
TRITON_CASES = [
    ("full", 64, torch.bfloat16, 2, 4, 37, 0),
    ("causal", 64, torch.bfloat16, 1, 2, 37, 0),
    ("strict", 64, torch.float16, 1, 1, 37, 0),
    ("causal", 128, torch.bfloat16, 2, 1, 37, 0),
    ("strict", 128, torch.bfloat16, 1, 4, 37, 0),
    ("full", 128, torch.float16, 1, 2, 29, 0),
    ("window", 64, torch.bfloat16, 1, 2, 50, 0),
    ("window-nocausal", 128, torch.bfloat16, 1, 2, 37, 0),
    ("striped", 64, torch.float16, 1, 4, 29, 0),
    ("docs", 64, torch.bfloat16, 1, 2, 37, 16),
    ("docs-causal", 128, torch.bfloat16, 1, 1, 37, 32),
    ("block", 64, torch.bfloat16, 1, 2, 45, 16),
    ("block-ragged-causal", 128, torch.float16, 1, 4, 37, 0),
    ("block-docs", 64, torch.bfloat16, 1, 1, 37, 16),
]
CASE_IDS = [f"{c[0]}-d{c[1]}-{str(c[2])[6:]}-b{c[3]}-kv{c[4]}-sk{c[5]}" for c in TRITON_CASES]


def kernel():
    from burstengine.kernels.triton.kernel import TileConfig, Tiles, TritonKernel

    # tiny tiles so that 37-row blocks span several tiles and a ragged one; d=64 sends dQ out of
    # the dK/dV kernel with atomics and loads through TMA descriptors, d=128 runs the separate
    # dQ kernel with pointer loads and different tile shapes per kernel (forward_into too)
    t16 = Tiles(16, 16, 4, 1, tma=True)
    return TritonKernel({64: TileConfig(fwd=t16, kv=t16),
                         128: TileConfig(fwd=Tiles(16, 32, 4, 1), kv=Tiles(16, 16, 4, 1), dq=Tiles(32, 16, 4, 1),
                                     fwd_into=Tiles(32, 16, 4, 1))})


def main():
    import triton_interp  # noqa: F401  (before the first triton import)
    from burstengine.kernels.reference import ReferenceKernel
    from burstengine.kernels.verify import run_case
    from burstengine.testing import fro_err

    torch.set_num_threads(1)
    tk = kernel()
    out = {}

    def one(cid, mask, B, Sq, Sk, H, Hkv, D, dtype, poison=0, **kw):
        q = torch.empty(1, Sq, H, D, dtype=dtype)
        k = torch.empty(1, Sk, Hkv, D, dtype=dtype)
        r = run_case(tk, B=B, Sq=Sq, Sk=Sk, H=H, Hkv=Hkv, D=D, dtype=dtype, mask=mask, device="cpu",
                     seed=D + Hkv + Sk, poison_kv=poison, **kw)
        out[cid] = dict(r, ran_triton=tk.supports(q, k, k, mask), dtype=str(dtype)[6:], poison=poison)

    for cid, (name, D, dtype, B, Hkv, Sk, poison) in zip(CASE_IDS, TRITON_CASES):
        one(cid, MASKS[name], B, 37, Sk, 4, Hkv, D, dtype, poison)
    # the plain entry points (fresh outputs in the input dtype) against the reference
    ref = ReferenceKernel()
    for D in (64, 128):
        g = torch.Generator().manual_seed(D)
        q, k, v, do = (torch.randn(2, 37, h, D, generator=g).to(torch.bfloat16) for h in (4, 2, 2, 4))
        o, lse = tk.forward(q, k, v, D ** -0.5, CAUSAL)
        ro, rl = ref.forward(*(t.double() for t in (q, k, v)), D ** -0.5, CAUSAL)
        delta = (do.double() * ro).sum(-1).transpose(1, 2)
        grads = tk.backward(do, q, k, v, rl.float(), delta.float(), D ** -0.5, CAUSAL)
        rgrads = ref.backward(*(t.double() for t in (do, q, k, v)), rl, delta, D ** -0.5, CAUSAL)
        errs = dict(out=fro_err(o, ro), lse=fro_err(lse, rl),
                    **{n: fro_err(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads, rgrads)})
        out[f"plain-d{D}"] = dict(errs, nan=False, ran_triton=True, dtype="bfloat16", poison=0,
                                  dtypes=[str(t.dtype)[6:] for t in (o, *grads)])
    # the plain forward writes every row itself (no zero-filled buffers; NaN-filled here): q tiles
    # that see nothing (rows 0..19 here, one whole 16-row tile) must come out O = 0, lse = -inf
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 37, h, 64, generator=g).to(torch.bfloat16) for h in (4, 2, 2))
    spec = MaskSpec(causal=True, k_start=20)
    o = torch.full_like(q, float("nan"))
    lse = torch.full((1, 4, 37), float("nan"))
    tk._forward(q, k, v, 0.125, spec, o, lse, fresh=True)
    ro, rl = ref.forward(*(t.double() for t in (q, k, v)), 0.125, spec)
    seen = torch.isfinite(rl)
    # and the plain backward into NaN-filled dQ/dK/dV: q tile 0 and k tile 2 get no visible pair
    do = torch.randn(1, 37, 4, 64, generator=g).to(torch.bfloat16)
    delta = (do.double() * ro).sum(-1).transpose(1, 2)
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]
    tk._backward(do, q, k, v, rl.float(), delta.float(), 0.125, spec, *grads, fresh=True)
    rgrads = ref.backward(*(t.double() for t in (do, q, k, v)), rl, delta, 0.125, spec)
    out["plain-skipped"] = dict(out=fro_err(o, ro), lse=fro_err(lse[seen], rl[seen]),
                                **{n: fro_err(a, b) for n, a, b in zip(("dq", "dk", "dv"), grads, rgrads)},
                                nan=bool(torch.isnan(o).any() or torch.isnan(lse).any()
                                         or any(torch.isnan(t).any() for t in grads)), ran_triton=True,
                                dtype="bfloat16", poison=0, unseen_rows=int((~seen).sum()),
                                unseen_exact=bool((o.transpose(1, 2)[~seen] == 0).all()
                                                  and (lse[~seen] == -torch.inf).all()))
    # D = rowsum(dO * O) in one kernel, ragged rows, against float64
    g = torch.Generator().manual_seed(4)
    o, do = (torch.randn(2, 37, 3, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    d = tk.delta(o, do)
    rd = (o.double() * do.double()).sum(-1).transpose(1, 2)
    out["delta"] = dict(err=fro_err(d, rd), shape=list(d.shape), dtype=str(d.dtype)[6:],
                        row_stride=d.stride(1))
    one("nothing-visible", MaskSpec(causal=True, k_start=50), 1, 20, 20, 2, 1, 64, torch.bfloat16, 16)
    one("fallback-fp32", CAUSAL, 1, 9, 9, 2, 2, 64, torch.float32, poison_out=False)
    one("fallback-d32", CAUSAL, 1, 9, 9, 2, 2, 32, torch.bfloat16, poison_out=False)
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
