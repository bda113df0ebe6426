"""Probe: our attention kernels beside cuDNN at head dims 64, 96, 128 and 256 (the kernels issue
asks >= 1.0x cuDNN at 64, 96, 256 and >= 1.10x at 128): the plain forward and backward, causal
and full, 32 q heads on 8 kv heads, bf16.  "ours" is TritonKernel, which runs the Gluon kernels
where they take the call (forward d 64/128/256, backward d 64/128, lengths multiples of 128), the
Triton ones elsewhere at d 64/128, and cuDNN (its fallback) at other head dims ("triton" in "auto"
below); "auto" names what AutoKernel's rules pick on
this card for these tensors.  Each head dim is
first checked against float64 at 1,152 tokens (forward out and lse, the three gradients).

    python benchmarks/probe_head_dims.py 16384,65536 [64,96,128,256 [32 [5]]]   # seqs dims q-heads iters

Writes probe_head_dims.json to $OUT (or /tmp)."""
import os
import sys
import time

import torch

from burstengine.kernels.gluon import bwd as gluon_bwd
from burstengine.kernels.gluon import fwd as gluon_fwd
from burstengine.kernels.registry import AutoKernel
from burstengine.kernels.sdpa import CudnnKernel
from burstengine.kernels.triton.kernel import TritonKernel
from burstengine.timing import median, timed
from probe_gluon_bwd_variants import ref64, rel  # benchmarks/, beside this script

dev, HKV = "cuda", 8
H = 32  # q heads; argv[3] times several counts
ours, cud, auto = TritonKernel(), CudnnKernel(), AutoKernel()


def rnd(*s):
    return torch.randn(*s, device=dev, dtype=torch.bfloat16)


def check(D, H):
    out = []
    for causal in (True, False):
        S, scale = 1152, D ** -0.5
        q, do, k, v = rnd(1, S, H, D), rnd(1, S, H, D), rnd(1, S, HKV, D), rnd(1, S, HKV, D)
        o_r, lse_r, dq_r, dk_r, dv_r = ref64(q, k, v, do, "causal" if causal else "full", scale)
        mask = "causal" if causal else "full"
        o, lse = ours.forward(q, k, v, scale, mask)
        dq, dk, dv = ours.backward(do, q, k, v, lse, ours.delta(o, do), scale, mask, out=o)
        e = dict(D=D, H=H, mask=mask, out=rel(o, o_r), lse=float((lse - lse_r).abs().max()), dq=rel(dq, dq_r),
                 dk=rel(dk, dk_r), dv=rel(dv, dv_r))
        e["ok"] = max(e["out"], e["dq"], e["dk"], e["dv"]) < 2e-2 and e["lse"] < 1e-2
        print(("" if e["ok"] else "FAIL ") + str(e), flush=True)
        out.append(e)
    return out


def bench(D, H, seqs, warmup=2, iters=5):
    rows, card = [], torch.cuda.get_device_name()
    for S in seqs:
        scale = D ** -0.5
        q, do, k, v = rnd(1, S, H, D), rnd(1, S, H, D), rnd(1, S, HKV, D), rnd(1, S, HKV, D)
        for mask in ("causal", "full"):
            fl = 4 * S * S * H * D * (0.5 if mask == "causal" else 1.0)
            diag = mask == "causal"
            takes = {"forward": lambda: gluon_fwd.supported(q, k, v, diag),
                     "backward": lambda: gluon_bwd.supported(q, k, v, diag, do)}
            picks = {c: auto.choose(c, mask, S, S, card, D, takes=takes[c]) for c in ("forward", "backward")}
            for name, k_ in (("cudnn", cud), ("ours", ours)):
                row = dict(D=D, H=H, S=S, mask=mask, method=name, auto=picks)
                try:
                    o, lse = k_.forward(q, k, v, scale, mask)
                    delta = ours.delta(o, do)
                    row["fwd_s"] = timed(lambda: k_.forward(q, k, v, scale, mask), "cuda", warmup=warmup, iters=iters)
                    row["bwd_s"] = timed(lambda: k_.backward(do, q, k, v, lse, delta, scale, mask, out=o), "cuda",
                                         warmup=warmup, iters=iters)
                    row["fwd_tflops"] = fl / median(row["fwd_s"]) / 1e12
                    row["bwd_tflops"] = 2.5 * fl / median(row["bwd_s"]) / 1e12
                    del o, lse, delta
                except Exception as e:  # noqa: BLE001 (a kernel that cannot run this shape: recorded)
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                rows.append(row)
                print(f"D={D:>3} H={H} S={S:>6} {mask:<6} {name:<5} " + (row.get("error") or
                      f"fwd {row['fwd_tflops']:5.0f} bwd {row['bwd_tflops']:5.0f} TFLOP/s (auto: {picks})"), flush=True)
                torch.cuda.empty_cache()
        del q, do, k, v
        torch.cuda.empty_cache()
    return rows


def main():
    t0 = time.time()
    seqs = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "16384,65536").split(",")]
    dims = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "64,96,128,256").split(",")]
    heads = [int(x) for x in (sys.argv[3] if len(sys.argv) > 3 else str(H)).split(",")]
    iters = int(sys.argv[4]) if len(sys.argv) > 4 else 5
    checks, rows = [], []
    for h in heads:
        for D in dims:
            checks += check(D, h)
            rows += bench(D, h, seqs, iters=iters)
    from burstengine.bench.records import write_record
    print(write_record("probe_head_dims", dict(device=torch.cuda.get_device_name(), heads=heads[0] if len(heads) == 1 else heads, kv_heads=HKV,
                                               check=checks, rows=rows, seconds=time.time() - t0),
                       out_dir=os.environ.get("OUT", "/tmp")))


if __name__ == "__main__":
    main()
