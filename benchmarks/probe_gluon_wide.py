"""Probe: the Gluon forward's wide kv tiles for full blocks (kernels/gluon/fwd.py, ``block_n``)
checked against float64 and timed beside cuDNN in one launch.

    python benchmarks/probe_gluon_wide.py 16384,32768,65536,131072 --widths 144,160

Check, at 128 and each width: the plain forward and forward_into (two key chunks merged into a
running state that starts as NaN / -inf) on full blocks, key lengths that are and are not
multiples of the width (always of 128, as ``supported`` requires), batches of 1 and 2 (a ragged
last tile then reads the next batch's rows, or past the tensor's end), MHA and GQA 4, both signs
of the scale (the two builds of the softmax); plus a causal call with ``block_n`` set (diagonal
blocks keep 128-key tiles).  Then the plain full forward at each length (32 q / 8 kv heads,
d=128, bf16: the 8B model's) for cuDNN, ours at 128 and at each width, and forward_into on one
full block of the middle length's keys against cuDNN plus the torch merge.  Writes
gluon_wide.json to $OUT (or /tmp); about 2 minutes on one H200."""
import argparse
import time

import torch
from burstengine.kernels.base import merge_
from burstengine.kernels.gluon import fwd as gf
from probe_gluon import D, cud, dev, err, out_dir, rnd, time_rows  # the backward's probe

H, HKV = 32, 8
scale = D ** -0.5


def ref(q, k, v, sc, causal=False):
    # float64 (out (B, Sq, H, D), lse (B, H, Sq)) of the full (or causal) block
    g = q.shape[2] // k.shape[2]
    qd, kd, vd = (t.double().transpose(1, 2) for t in (q, k, v))
    s = qd @ kd.repeat_interleave(g, 1).transpose(-1, -2) * sc
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=dev).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ vd.repeat_interleave(g, 1)).transpose(1, 2), torch.logsumexp(s, -1)


def check(widths):
    # (B, Sq, Sk, q heads, kv heads, scale): Sk 1152 = 8 x 144 = 7 x 160 + 32, 1280 = 8 x 160,
    # 128: less than one tile, 640 = 4 x 160
    cases = ((1, 1152, 1152, H, HKV, scale), (2, 256, 1280, HKV, HKV, scale), (1, 384, 128, H, HKV, -scale),
             (2, 640, 640, H, HKV, scale), (2, 512, 1152, HKV, HKV, -scale))
    res = []
    for B, Sq, Sk, Hq, Hk, sc in cases:
        q, k, v = rnd(B, Sq, Hq, D), rnd(B, Sk, Hk, D), rnd(B, Sk, Hk, D)
        o_r, lse_r = ref(q, k, v, sc)
        cut = Sk // 256 * 128  # forward_into: keys [0, cut) then [cut, Sk) (all at once when cut is 0)
        for n in widths:
            row = dict(B=B, Sq=Sq, Sk=Sk, heads=f"{Hq}/{Hk}", scale=sc, block_n=n)
            o, lse = gf.forward(q, k, v, sc, False, block_n=n)
            res.append(dict(what="forward", **row, o=err(o, o_r), lse=err(lse, lse_r)))
            out = torch.full((B, Sq, Hq, D), float("nan"), device=dev)  # an empty state's O may hold anything
            lse = torch.full((B, Hq, Sq), float("-inf"), device=dev)
            for lo, hi in ((0, cut), (cut, Sk)) if cut else ((0, Sk), ):
                gf.forward_into(q, k[:, lo:hi], v[:, lo:hi], sc, None, out, lse, block_n=n)
            res.append(dict(what="forward_into", **row, cut=cut, o=err(out, o_r), lse=err(lse, lse_r)))
    S = 1152
    q, k, v = rnd(1, S, H, D), rnd(1, S, HKV, D), rnd(1, S, HKV, D)
    o_r, lse_r = ref(q, k, v, scale, causal=True)
    for n in widths:
        o, lse = gf.forward(q, k, v, scale, True, block_n=n)
        res.append(dict(what="forward causal", B=1, Sq=S, Sk=S, block_n=n, o=err(o, o_r), lse=err(lse, lse_r)))
    bad = 0
    for r in res:
        ok = r["o"] < 2e-2 and r["lse"] < 1e-3
        bad += not ok
        print(("" if ok else "FAIL ") + str(r), flush=True)
    print(f"check: {len(res) - bad} of {len(res)} within 2e-2 (out) and 1e-3 (lse) of float64", flush=True)
    return res, bad


def bench(seqs, widths, warmup=2, iters=7):
    res = []
    for S in seqs:
        q, k, v = rnd(1, S, H, D), rnd(1, S, HKV, D), rnd(1, S, HKV, D)
        fl = 4 * S * S * H * D
        cands = {"cudnn": lambda: cud.forward(q, k, v, scale, "full")}
        for n in widths:
            cands[f"gluon n={n}"] = lambda n=n: gf.forward(q, k, v, scale, False, block_n=n)
        res += time_rows(S, cands, lambda name: fl, warmup, 5 if S > 65536 else iters)
        del q, k, v
        torch.cuda.empty_cache()
    S = seqs[len(seqs) // 2]
    q, k, v = rnd(1, S, H, D), rnd(1, S, HKV, D), rnd(1, S, HKV, D)
    out = torch.zeros(1, S, H, D, device=dev)
    lse = torch.zeros(1, H, S, device=dev)  # a running state with some weight: each call merges once more

    def cudnn_merge():
        merge_(out, lse, *cud.forward(q, k, v, scale, "full"))

    cands = {"cudnn + merge into": cudnn_merge}
    for n in widths:
        cands[f"gluon into n={n}"] = lambda n=n: gf.forward_into(q, k, v, scale, None, out, lse, block_n=n)
    res += time_rows(S, cands, lambda name: 4 * S * S * H * D, warmup, iters)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("seqs", nargs="?", default="16384,32768,65536,131072")
    ap.add_argument("--widths", default="144,160", help="kv tile widths besides 128 (of gf.BLOCK_NS)")
    a = ap.parse_args()
    widths = [128] + [int(x) for x in a.widths.split(",") if int(x) != 128]
    seqs = [int(x) for x in a.seqs.split(",")]
    t0 = time.time()
    c, bad = check(widths)
    t1 = time.time()
    b = bench(seqs, widths)
    print("\nTFLOP/s (plain full forward; last row: forward_into on one full block)")
    names = list(dict.fromkeys(r["method"] for r in b))
    print(f"{'S':>7} " + " ".join(f"{m:>18}" for m in names))
    for S in dict.fromkeys(r["S"] for r in b):
        got = {r["method"]: r["tflops"] for r in b if r["S"] == S}
        print(f"{S:>7} " + " ".join(f"{got[m]:>18.0f}" if m in got else " " * 18 for m in names))
    from burstengine.bench.records import write_record
    print(write_record("gluon_wide", dict(device=torch.cuda.get_device_name(), widths=widths, check=c,
                                          check_failures=bad, bench=b, check_seconds=t1 - t0,
                                          seconds=time.time() - t0), out_dir=out_dir))


if __name__ == "__main__":
    main()
