"""Probe: the Gluon backward (kernels/gluon/bwd.py) against float64 and cuDNN, then timed beside
cuDNN at 3B-model shapes (24 q heads, 8 kv heads, d=128, causal).  The variants measured while it
was built (gluon_bwd_*_h200.json) ran from this script at the commits their records name."""
import os, sys, time
import torch
from burstengine.kernels.triton.kernel import TritonKernel
from burstengine.kernels.sdpa import CudnnKernel
from burstengine.timing import timed, median

torch.manual_seed(0)
dev = "cuda"
ours, cud = TritonKernel(), CudnnKernel()
H, HKV, D = 24, 8, 128
scale = D ** -0.5
out_dir = os.environ.get("OUT", "/tmp")


def rnd(*s):
    return torch.randn(*s, device=dev, dtype=torch.bfloat16)


def ref64(q, k, v, do, mask, scale=scale):
    g = q.shape[2] // k.shape[2]
    qd, kd, vd, dod = (t.double().transpose(1, 2) for t in (q, k, v, do))
    kd = kd.repeat_interleave(g, 1).requires_grad_()
    vd = vd.repeat_interleave(g, 1).requires_grad_()
    qd = qd.requires_grad_()
    s = qd @ kd.transpose(-1, -2) * scale
    Sq, Sk = s.shape[-2:]
    i = torch.arange(Sq, device=dev)[:, None]
    j = torch.arange(Sk, device=dev)[None, :]
    if mask == "causal":
        s = s.masked_fill(j > i, float("-inf"))
    elif mask == "strict":
        s = s.masked_fill(j >= i, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    o = p @ vd
    o.backward(dod)
    B = q.shape[0]
    dk = kd.grad.view(B, k.shape[2], g, Sk, k.shape[-1]).sum(2).transpose(1, 2)
    dv = vd.grad.view(B, k.shape[2], g, Sk, k.shape[-1]).sum(2).transpose(1, 2)
    return o.detach().transpose(1, 2), lse.detach(), qd.grad.transpose(1, 2), dk, dv


def err(a, b):
    # relative max error where the reference is finite; inf where a and b disagree on finiteness
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    if not torch.equal(fin, torch.isfinite(a)):
        return float("inf")
    return ((a - b)[fin].abs().max() / b[fin].abs().max().clamp_min(1e-30)).item()


def check():
    res = []
    for S, mask in ((2048, "causal"), (1024, "full"), (1152, "strict"), (384, "causal")):
        q, do = rnd(1, S, H, D), rnd(1, S, H, D)
        k, v = rnd(1, S, HKV, D), rnd(1, S, HKV, D)
        o_r, lse_r, dq_r, dk_r, dv_r = ref64(q, k, v, do, mask)
        o64 = o_r.to(torch.bfloat16)
        lse32 = lse_r.float()
        delta = ours.delta(o64, do)
        if mask != "strict":
            dq, dk, dv = ours.backward(do, q, k, v, lse32, delta, scale, mask)
            res.append(dict(what="bwd", S=S, mask=mask, dq=err(dq, dq_r), dk=err(dk, dk_r), dv=err(dv, dv_r)))
        dq = torch.zeros(1, S, H, D, device=dev)
        dk = torch.zeros(1, S, HKV, D, device=dev)
        dv = torch.zeros(1, S, HKV, D, device=dev)
        ours.backward_into(do, q, k, v, lse32, delta, scale, mask, dq, dk, dv)
        ours.backward_into(do, q, k, v, lse32, delta, scale, mask, dq, dk, dv)  # adds: twice the grads
        res.append(dict(what="bwd_into x2", S=S, mask=mask, dq=err(dq / 2, dq_r), dk=err(dk / 2, dk_r),
                        dv=err(dv / 2, dv_r)))
    for r in res:
        print(r, flush=True)
        bad = [v for kk, v in r.items() if kk in ("dq", "dk", "dv") and not v < 2e-2]
        if bad:
            print("FAIL", r, flush=True)
    return res


def time_rows(S, cands, flops, warmup, iters):
    """One timed row per candidate {name: fn} at length S; ``flops(name)``: its FLOP count."""
    rows = []
    for name, fn in cands.items():
        ts = timed(fn, "cuda", warmup=warmup, iters=iters)
        rows.append(dict(S=S, method=name, times=ts, tflops=flops(name) / median(ts) / 1e12))
        print(f"S={S:>7} {name:<18} {median(ts) * 1e3:9.2f} ms {rows[-1]['tflops']:6.0f} TFLOP/s", flush=True)
    return rows


def bench(seqs, warmup=2, iters=7):
    res = []
    for S in seqs:
        q, do = rnd(1, S, H, D), rnd(1, S, H, D)
        k, v = rnd(1, S, HKV, D), rnd(1, S, HKV, D)
        fl = 4 * S * S * H * D * 0.5
        o, lse = cud.forward(q, k, v, scale, "causal")
        delta = ours.delta(o, do)
        cands = {"cudnn fwd": lambda: cud.forward(q, k, v, scale, "causal")}
        cands["cudnn bwd"] = lambda: cud.backward(do, q, k, v, lse, delta, scale, "causal", out=o)
        cands["gluon bwd"] = lambda: ours.backward(do, q, k, v, lse, delta, scale, "causal")
        if S <= 16384:  # outputs beside cuDNN's at this size
            g1 = ours.backward(do, q, k, v, lse, delta, scale, "causal")
            g0 = cud.backward(do, q, k, v, lse, delta, scale, "causal", out=o)
            res.append(dict(S=S, vs_cudnn=dict(dq=err(g1[0], g0[0]), dk=err(g1[1], g0[1]),
                                               dv=err(g1[2], g0[2]))))
            print(res[-1], flush=True)
        res += time_rows(S, cands, lambda name: fl * (2.5 if "bwd" in name else 1.0), warmup, iters)
        del q, k, v, do, o, lse, delta
        torch.cuda.empty_cache()
    return res


def main(name, check, bench, **extra):
    """Check, then time at argv[1]'s lengths (comma-separated), and write record ``name`` (with
    ``extra``'s fields)."""
    t0 = time.time()
    c = check()
    b = bench([int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "16384,65536,131072").split(",")])
    from burstengine.bench.records import write_record
    print(write_record(name, dict(device=torch.cuda.get_device_name(), check=c, bench=b, seconds=time.time() - t0,
                                  **extra), out_dir=out_dir))


if __name__ == "__main__":
    main("gluon_bwd", check, bench)
