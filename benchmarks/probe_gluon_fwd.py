"""Probe: the Gluon forward (kernels/gluon/fwd.py) checked against float64 (plain forward and the
ring step's merge, causal / full / strict, a positive and a negative scale: the two builds of its
softmax) and timed beside cuDNN's forward at 3B-model shapes (24 q heads, 8 kv heads, d=128,
causal).

    python benchmarks/probe_gluon_fwd.py 16384,65536,131072

Writes gluon_fwd.json to $OUT (or /tmp).  gluon_fwd_variants_h200.json came from this script at
commit 29508cb, which also timed measurement variants since dropped (an exponential in 4 or 8 by
an FMA-pipe polynomial: slower)."""
import os, sys, time
import torch
from burstengine.kernels.gluon import fwd as gf
from burstengine.kernels.sdpa import CudnnKernel
from burstengine.timing import timed, median

torch.manual_seed(0)
dev = "cuda"
H, HKV, D = 24, 8, 128
scale = D ** -0.5
out_dir = os.environ.get("OUT", "/tmp")


def rnd(*s):
    return torch.randn(*s, device=dev, dtype=torch.bfloat16)


def ref64(q, k, v, mask, scale=scale):
    g = q.shape[2] // k.shape[2]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(g, 1), vd.repeat_interleave(g, 1)
    s = qd @ kd.transpose(-1, -2) * scale
    i = torch.arange(s.shape[-2], device=dev)[:, None]
    j = torch.arange(s.shape[-1], device=dev)[None, :]
    if mask == "causal":
        s = s.masked_fill(j > i, float("-inf"))
    elif mask == "strict":
        s = s.masked_fill(j >= i, float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1).nan_to_num(0.0) @ vd).transpose(1, 2), lse


def err(a, b):
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    if not torch.equal(fin, torch.isfinite(a)):
        return float("inf")
    return ((a - b)[fin].abs().max() / b[fin].abs().max().clamp_min(1e-30)).item()


def check():
    res = []
    for S, mask, sc in ((2048, "causal", scale), (1024, "full", scale), (1152, "strict", scale),
                        (384, "causal", scale), (640, "causal", -scale), (512, "strict", -scale)):
        q, k, v = rnd(1, S, H, D), rnd(1, S, HKV, D), rnd(1, S, HKV, D)
        o_r, lse_r = ref64(q, k, v, mask, sc)
        if mask != "strict":
            o, lse = gf.forward(q, k, v, sc, mask == "causal")
            res.append(dict(what="forward", S=S, mask=mask, scale=sc, o=err(o, o_r), lse=err(lse, lse_r)))
        # the ring step: merge two halves of the keys' work into a running state (two calls)
        out = torch.zeros(1, S, H, D, device=dev)
        lse = torch.full((1, H, S), float("-inf"), device=dev)
        lo = {"causal": 0, "strict": 1, "full": None}[mask]
        gf.forward_into(q, k, v, sc, lo, out, lse)
        res.append(dict(what="forward_into", S=S, mask=mask, scale=sc, o=err(out, o_r), lse=err(lse, lse_r)))
    for r in res:
        ok = r["o"] < 2e-2 and r["lse"] < 1e-3
        print(("" if ok else "FAIL ") + str(r), flush=True)
    return res


def bench(seqs, warmup=2, iters=7):
    cud = CudnnKernel()
    res = []
    for S in seqs:
        q, k, v = rnd(1, S, H, D), rnd(1, S, HKV, D), rnd(1, S, HKV, D)
        fl = 4 * S * S * H * D * 0.5
        cands = {"cudnn": lambda: cud.forward(q, k, v, scale, "causal"),
                 "gluon": lambda: gf.forward(q, k, v, scale, True)}
        for name, fn in cands.items():
            ts = timed(fn, "cuda", warmup=warmup, iters=iters)
            res.append(dict(S=S, method=name, times=ts, tflops=fl / median(ts) / 1e12))
            print(f"S={S:>7} {name:<14} {median(ts) * 1e3:9.2f} ms {res[-1]['tflops']:6.0f} TFLOP/s", flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    return res


if __name__ == "__main__":
    t0 = time.time()
    c = check()
    b = bench([int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "16384,65536,131072").split(",")])
    from burstengine.records import write_record
    print(write_record("gluon_fwd", dict(device=torch.cuda.get_device_name(), check=c, bench=b,
                                         seconds=time.time() - t0), out_dir=out_dir))
