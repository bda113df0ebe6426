"""FP8 forward cases for tests/kernels/test_fp8.py.  Run as a script, it runs the Triton FP8 forward
(kernels/fp8.py) under Triton's CPU interpreter and prints one JSON line {case id: errors}: against
float64, and against the same quantization done in torch (kernels/fp8.emulate)."""
import json
import sys

import torch

from triton_cases import MASKS  # noqa: F401  (the tests take them from here)

# (mask, head dim, dtype, batch, kv heads, Sq, Sk, tiles): H = 4.  "one" tiles cover every key in one
# tile, so the kernel's running row maximum is the final one and P rounds exactly as the emulation's;
# "small" tiles (16 rows, 16-row quantization blocks) walk several tiles and several scale blocks.
FP8_CASES = [
    ("full", 64, torch.bfloat16, 2, 4, 37, 37, "one"),
    ("causal", 128, torch.bfloat16, 1, 2, 37, 37, "one"),
    ("strict", 64, torch.float16, 1, 1, 37, 37, "one"),
    ("window", 64, torch.bfloat16, 1, 2, 37, 50, "one"),
    ("docs-causal", 128, torch.bfloat16, 1, 1, 37, 37, "one"),
    ("block", 64, torch.bfloat16, 1, 2, 37, 45, "one"),
    ("full", 128, torch.bfloat16, 1, 2, 37, 29, "small"),
    ("causal", 64, torch.bfloat16, 2, 1, 37, 37, "small"),
    ("strict", 128, torch.bfloat16, 1, 4, 37, 37, "small"),
    ("window-nocausal", 64, torch.float16, 1, 2, 37, 37, "small"),
    ("striped", 64, torch.bfloat16, 1, 4, 37, 29, "small"),
    ("docs", 64, torch.bfloat16, 1, 2, 37, 37, "small"),
    ("block-ragged-causal", 128, torch.bfloat16, 1, 4, 37, 37, "small"),
]
CASE_IDS = [f"{c[0]}-d{c[1]}-{str(c[2])[6:]}-b{c[3]}-kv{c[4]}-{c[5]}x{c[6]}-{c[7]}" for c in FP8_CASES]


def kernels():
    from burstengine.kernels.fp8 import Fp8Kernel
    from burstengine.kernels.triton.kernel import Tiles

    one = Tiles(64, 64, 4, 1, tma=True)
    return {"one": Fp8Kernel(block=64, tiles={64: one, 128: Tiles(64, 64, 4, 1)}),
            "small": Fp8Kernel(block=16, tiles={64: Tiles(16, 16, 4, 1, tma=True), 128: Tiles(16, 16, 4, 1)})}


def main():
    import triton_interp  # noqa: F401  (before the first triton import)
    from burstengine.kernels.fp8 import emulate
    from burstengine.kernels.reference import ReferenceKernel
    from burstengine.kernels.verify import run_forward_case
    from burstengine.testing import fro_err

    torch.set_num_threads(1)
    ks = kernels()
    out = {}
    for cid, (name, D, dtype, B, Hkv, Sq, Sk, tiles) in zip(CASE_IDS, FP8_CASES):
        kern = ks[tiles]

        def oracle(q, k, v, scale, mask, kern=kern):
            return emulate(kern.quantize(q, k, v), scale, mask, q.shape[1], k.shape[1])

        q = torch.empty(B, Sq, 4, D, dtype=dtype)
        k = torch.empty(B, Sk, Hkv, D, dtype=dtype)
        r = run_forward_case(kern, B, Sq, Sk, 4, Hkv, D, dtype, MASKS[name], "cpu", seed=D + Sk + Hkv,
                             oracle=oracle)
        out[cid] = dict(r, ran_triton=kern.runs_triton(q, k, k, MASKS[name]), tiles=tiles)
        if tiles == "one":
            # fresh (no running state to raise the row maximum): P rounds as in the emulation
            g = torch.Generator().manual_seed(Sk)
            q, k, v = (torch.randn(B, s, h, D, generator=g).to(dtype) for s, h in ((Sq, 4), (Sk, Hkv), (Sk, Hkv)))
            o, lse = kern.forward(q, k, v, D ** -0.5, MASKS[name])
            eo, el = oracle(q, k, v, D ** -0.5, MASKS[name])
            fin = torch.isfinite(el)
            out[cid].update(fresh_oracle=fro_err(o.float(), eo), fresh_lse_oracle=fro_err(lse[fin], el[fin]))
    # the plain forward: a fresh bf16 output, rows that see nothing (a whole q tile here) O = 0, lse = -inf
    from burstengine.kernels.base import merge_
    from burstengine.masks import CAUSAL, MaskSpec

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 37, h, 64, generator=g).to(torch.bfloat16) for h in (4, 2, 2))
    spec = MaskSpec(causal=True, k_start=20)
    o, lse = ks["small"].forward(q, k, v, 0.125, spec)
    ro, rl = ReferenceKernel().forward(q.double(), k.double(), v.double(), 0.125, spec)
    seen = torch.isfinite(rl)
    out["plain"] = dict(out=fro_err(o, ro), lse=fro_err(lse[seen], rl[seen]), dtype=str(o.dtype)[6:],
                        unseen_exact=bool((o.transpose(1, 2)[~seen] == 0).all() and (lse[~seen] == -torch.inf).all()),
                        unseen=int((~seen).sum()))
    # onto a running state of large outputs (1e4), a block whose V is all zero in one kv head: the
    # kernel holds the state's O divided by V's scale, which must stay finite
    q, k, v = (torch.randn(1, 37, h, 64, generator=g).to(torch.bfloat16) for h in (4, 2, 2))
    v[:, :, 1] = 0
    out0 = torch.randn(1, 37, 4, 64, generator=g) * 1e4
    lse0 = torch.randn(1, 4, 37, generator=g)
    out_k, lse_k = out0.clone(), lse0.clone()
    ks["small"].forward_into(q, k, v, 0.125, CAUSAL, out_k, lse_k)
    ro, rl = ReferenceKernel().forward(q.double(), k.double(), v.double(), 0.125, CAUSAL)
    out_r, lse_r = out0.double(), lse0.double()
    merge_(out_r, lse_r, ro, rl)
    out["zero_v_head"] = dict(finite=bool(torch.isfinite(out_k).all()), out=fro_err(out_k, out_r),
                              lse=fro_err(lse_k, lse_r))
    # the quantization in kernels/triton/quant.py against the torch expression it replaces
    from burstengine.kernels import fp8

    for i, (S, H, D, dtype, block) in enumerate([(37, 4, 64, torch.bfloat16, 16), (300, 2, 128, torch.float32, 128),
                                                 (129, 3, 64, torch.float16, 64)]):
        g = torch.Generator().manual_seed(i)
        x = (torch.randn(2, S + 5, H, D, generator=g) * 3).to(dtype)[:, 5:]  # a slice, as the ring passes them
        x[:, :block // 2] = 0  # an all-zero half block
        q, k, v = x, x[:, :, :1].contiguous(), x[:, :, 1:].contiguous()
        got = fp8.quantize(q, k, v, block)
        torch_in = fp8._in_triton
        fp8._in_triton = lambda t: False
        try:
            want = fp8.quantize(q, k, v, block)
        finally:
            fp8._in_triton = torch_in
        same = {n: bool(torch.equal(getattr(got, n).view(torch.uint8) if getattr(got, n).dtype == fp8.E4M3
                                    else getattr(got, n), getattr(want, n).view(torch.uint8)
                                    if getattr(want, n).dtype == fp8.E4M3 else getattr(want, n)))
                for n in ("q8", "qs", "k8", "ks", "vt8", "voff", "vu")}
        out[f"quant-{i}"] = dict(same=same, triton=torch_in(q))
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
