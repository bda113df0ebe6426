"""Cases for tests/kernels/test_gemv.py, run under Triton's interpreter in a subprocess
(interp_cases.run): the GEMV kernel (kernels/triton/gemv.py) against float64, for 1-16 rows, odd
N and K (tails of every tile), fp16/bf16, with and without bias, both tile configurations."""
import json
import sys

import torch

# (id, rows, N, K, dtype, bias, config)
CASES = [("m1-bf16", 1, 96, 200, torch.bfloat16, False, (32, 512, 4, 3)),
         ("m3-fp16-bias", 3, 50, 64, torch.float16, True, (32, 512, 4, 3)),
         ("m16-bf16-bias-wide", 16, 133, 300, torch.bfloat16, True, (64, 128, 4, 3)),
         ("m2-bf16-ktail", 2, 64, 1100, torch.bfloat16, False, (32, 512, 4, 3)),
         ("m5-3d-fp16", 5, 31, 96, torch.float16, False, (64, 128, 4, 3))]
CASE_IDS = [c[0] for c in CASES]


def main():
    import triton_interp  # noqa: F401  (before the first triton import)
    from burstengine.kernels.triton import gemv

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    res = {}
    for cid, M, N, K, dt, bias, config in CASES:
        shape = (1, M, K) if cid.endswith("3d-fp16") else (M, K)  # a decode step's (1, B, dim) rows
        x = torch.randn(*shape, generator=g).to(dt)
        w = torch.randn(N, K, generator=g).to(dt)
        b = torch.randn(N, generator=g).to(dt) if bias else None
        y = gemv.gemv(x, w, b, config=config)
        ref = x.double() @ w.double().t() + (b.double() if bias else 0)
        res[cid] = dict(err=float((y.double() - ref).norm() / ref.norm()), dtype=str(y.dtype)[6:],
                        want_dtype=str(dt)[6:], shape=list(y.shape), want_shape=list(ref.shape))
    res["configs"] = {str(n): list(gemv.config_for(n)) for n in (1536, 4096, 12287, 12288, 128256)}
    print(json.dumps(res))


if __name__ == "__main__":
    sys.exit(main())
