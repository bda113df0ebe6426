"""Probe: variants of the Gluon backward against float64 and beside cuDNN in one launch: full and
causal, 32 q heads on 8 kv heads, bf16.  A variant is a bit mask of kernels/gluon/bwd.py's
flags (and gluon/grid.py's): 1 LAG at that head dim, 2 STAGGER, 4 MAX_STEPS off (no split of the
group), 8 MAX_STEPS 1 (one q head a program where the group may split: backward_into onto float32),
16 bwd_wide.py's SDP off (d=256: the warpgroups split S and dP by kv columns);
a suffix cN sets Q_CHUNK to N at that head dim (0: none), the q tiles a program walks on a full
block.  Records made while the variants were bits of a VARIANT
mask (8fe5e90-e09a57d) name them "ours vN": 1 bf16 P for dS, 2 each warpgroup's own dQ, 4 LAG, 12
LAG with the dQ issued after dK.

    python benchmarks/probe_gluon_bwd_variants.py 65536,131072 64:1,3 128:0,2,2c0,2c512 [iters] [--into]

--into times the ring step's backward_into onto float32 gradients (cuDNN: its backward plus the
three gradient adds) instead of the plain backward.

Each variant is first checked against float64 (the plain backward at causal and full, and the ring
step's backward_into twice onto the same float32 gradients at causal, full and strict); a variant
that fails is not timed.  Writes probe_gluon_bwd_variants.json to $OUT (or /tmp)."""
import os
import sys
import time

import torch

from burstengine.kernels.gluon import bwd as gb, bwd_wide as gw, grid as gg
from burstengine.kernels.sdpa import CudnnKernel
from burstengine.kernels.triton.kernel import TritonKernel
from burstengine.timing import median, timed

dev, H, HKV = "cuda", 32, 8
DEFAULT_STEPS = gg.MAX_STEPS  # the kernel's (records before c11f7a3 name 4096, its value then)
DEFAULT_CHUNK = dict(gg.Q_CHUNK)
ours, cud = TritonKernel(), CudnnKernel()


def rnd(*s):
    return torch.randn(*s, device=dev, dtype=torch.bfloat16)


def ref64(q, k, v, do, mask, scale):
    g = q.shape[2] // k.shape[2]
    qd, kd, vd, dod = (t.double().transpose(1, 2) for t in (q, k, v, do))
    kd, vd = (t.repeat_interleave(g, 1).requires_grad_() for t in (kd, vd))
    qd = qd.requires_grad_()
    s = qd @ kd.transpose(-1, -2) * scale
    i = torch.arange(s.shape[-2], device=dev)[:, None]
    j = torch.arange(s.shape[-1], device=dev)[None, :]
    if mask != "full":
        s = s.masked_fill(j > i if mask == "causal" else j >= i, float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1).nan_to_num(0.0) @ vd
    o.backward(dod)
    B, S, Hk, D = k.shape
    dk, dv = (t.grad.view(B, Hk, g, S, D).sum(2).transpose(1, 2) for t in (kd, vd))
    return o.detach().transpose(1, 2), lse.detach(), qd.grad.transpose(1, 2), dk, dv


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def parse(token):
    """A variant: its bits and its Q_CHUNK ("2c512" -> (2, 512); "2" -> (2, None: the kernel's))."""
    bits, _, chunk = token.partition("c")
    return int(bits), int(chunk) if chunk else None


def chunk_of(D, var):
    """The Q_CHUNK a variant runs at head dim ``D``."""
    return DEFAULT_CHUNK[D] if var[1] is None else var[1]


def name(D, var):
    bits, chunk = var[0], chunk_of(D, var)
    steps = "off" if bits & 4 else "1" if bits & 8 else str(DEFAULT_STEPS)
    sdp = f" sdp={int(not bits & 16)}" if D in gw.HEAD_DIMS else ""
    return f"lag={bits & 1} stagger={bits >> 1 & 1} max_steps={steps} chunk={chunk}{sdp}"


def flags(D, var):
    bits = var[0]
    gg.Q_CHUNK[D] = chunk_of(D, var)
    if D in gb.LAG:  # d=256 (bwd_wide.py) has no LAG
        gb.LAG[D] = bool(bits & 1)
    gg.STAGGER = bool(bits & 2)
    gw.SDP = not bits & 16
    gg.MAX_STEPS = 1 << 30 if bits & 4 else 1 if bits & 8 else DEFAULT_STEPS


def check(D, var):
    out = []
    # the last: a full block of 272 q tiles in chunks of 100 (the last short), where the variant
    # cuts q tiles into chunks at all
    chunked = gg.Q_CHUNK[D]
    for S, Sk, mask in ((1152, 1152, "causal"), (1024, 1024, "full"), (1152, 1152, "strict"), (17408, 1024, "full")):
        if S > 1152 and not chunked:
            continue
        gg.Q_CHUNK[D] = 100 if S > 1152 else chunked
        scale = D ** -0.5
        q, do, k, v = rnd(1, S, H, D), rnd(1, S, H, D), rnd(1, Sk, HKV, D), rnd(1, Sk, HKV, D)
        o_r, lse_r, dq_r, dk_r, dv_r = ref64(q, k, v, do, mask, scale)
        o, lse = o_r.to(q.dtype), lse_r.float()
        delta = ours.delta(o, do)
        runs = []
        if mask != "strict":
            runs.append(("backward", ours.backward(do, q, k, v, lse, delta, scale, mask), 1))
        g = (torch.zeros(1, S, H, D, device=dev), torch.zeros(1, Sk, HKV, D, device=dev),
             torch.zeros(1, Sk, HKV, D, device=dev))
        for _ in range(2):
            ours.backward_into(do, q, k, v, lse, delta, scale, mask, *g)
        runs.append(("backward_into x2", g, 2))
        for what, (dq, dk, dv), n in runs:
            e = dict(D=D, variant=var[0], chunk=gg.Q_CHUNK[D], S=S, Sk=Sk, mask=mask, what=what, dq=rel(dq / n, dq_r),
                     dk=rel(dk / n, dk_r), dv=rel(dv / n, dv_r))
            e["ok"] = max(e["dq"], e["dk"], e["dv"]) < 2e-2
            print(("" if e["ok"] else "FAIL ") + str(e), flush=True)
            out.append(e)
    gg.Q_CHUNK[D] = chunked
    return out


def bench(D, variants, seqs, iters, into=False):
    rows = []
    for S in seqs:
        scale = D ** -0.5
        q, do, k, v = rnd(1, S, H, D), rnd(1, S, H, D), rnd(1, S, HKV, D), rnd(1, S, HKV, D)
        for mask in ("causal", "full"):
            fl = 2.5 * 4 * S * S * H * D * (0.5 if mask == "causal" else 1.0)
            o, lse = cud.forward(q, k, v, scale, mask)
            delta = ours.delta(o, do)
            if into:
                acc = (torch.zeros(1, S, H, D, device=dev), torch.zeros(1, S, HKV, D, device=dev),
                       torch.zeros(1, S, HKV, D, device=dev))

                def cudnn_adds():
                    for a, g in zip(acc, cud.backward(do, q, k, v, lse, delta, scale, mask, out=o)):
                        a.add_(g)

                cands = [("cudnn", None, cudnn_adds)]
                cands += [(f"ours {name(D, var)} into", var,
                           lambda: ours.backward_into(do, q, k, v, lse, delta, scale, mask, *acc)) for var in variants]
            else:
                cands = [("cudnn", None, lambda: cud.backward(do, q, k, v, lse, delta, scale, mask, out=o))]
                cands += [(f"ours {name(D, var)}", var, lambda: ours.backward(do, q, k, v, lse, delta, scale, mask))
                          for var in variants]
            call = "backward_into" if into else "backward"
            for label, var, fn in cands:
                if var is not None:
                    flags(D, var)
                ts = timed(fn, "cuda", warmup=2, iters=iters)
                rows.append(dict(D=D, S=S, mask=mask, method=label, variant=var and var[0],
                                 chunk=var and chunk_of(D, var), call=call, times=ts,
                                 tflops=fl / median(ts) / 1e12))
                print(f"D={D:>3} S={S:>6} {mask:<6} {label:<32} {rows[-1]['tflops']:5.0f} TFLOP/s", flush=True)
            del o, lse, delta
            torch.cuda.empty_cache()
        del q, do, k, v
        torch.cuda.empty_cache()
    return rows


def main():
    t0 = time.time()
    seqs = [int(x) for x in sys.argv[1].split(",")]
    specs = [a for a in sys.argv[2:] if ":" in a]
    iters = int(next((a for a in sys.argv[2:] if ":" not in a and not a.startswith("--")), "7"))
    into = "--into" in sys.argv
    checks, rows = [], []
    for spec in specs:
        D, _, vs = spec.partition(":")
        kept = gb.LAG.get(int(D)), gg.STAGGER, gg.MAX_STEPS, gg.Q_CHUNK[int(D)], gw.SDP
        D, good = int(D), []
        for var in (parse(x) for x in vs.split(",")):
            flags(D, var)
            c = check(D, var)
            checks += c
            if all(e["ok"] for e in c):
                good.append(var)
        rows += bench(D, good, seqs, iters, into)
        gg.STAGGER, gg.MAX_STEPS, gg.Q_CHUNK[D], gw.SDP = kept[1:]
        if D in gb.LAG:
            gb.LAG[D] = kept[0]
    from burstengine.bench.records import write_record
    name = os.environ.get("NAME", "probe_gluon_bwd_variants")
    print(write_record(name, dict(device=torch.cuda.get_device_name(), heads=H, kv_heads=HKV, check=checks, rows=rows,
                                  seconds=time.time() - t0), out_dir=os.environ.get("OUT", "/tmp")))


if __name__ == "__main__":
    main()
