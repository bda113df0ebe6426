"""Probe: the Gluon forward (kernels/gluon/fwd.py) checked against float64 (plain forward and the
ring step's merge, causal / full / strict, a positive and a negative scale: the two builds of its
softmax; with the kernel's PIPE variant flag, both builds) and timed beside cuDNN's forward at
3B-model shapes (24 q heads, 8 kv heads, d=128), causal and full.

    python benchmarks/probe_gluon_fwd.py 16384,65536,131072 [--d 64] [--into]

--d: the head dim (128); --into: the ring step's forward_into timed too, beside cuDNN's (its
forward and the torch merge).  Writes gluon_fwd.json to $OUT (or /tmp).  gluon_fwd_poly_d64_h200.json
came from it at 8793396 with --poly (fwd.py's POLY then: one exponential in 2, 4 or 8 on the FMA
pipe), dropped after it.  gluon_fwd_variants_h200.json came from this script at
commit 29508cb, which also timed measurement variants since dropped (an exponential in 4 or 8 by
an FMA-pipe polynomial: slower)."""
import sys

import torch
from burstengine.kernels.gluon import fwd as gf
from burstengine.kernels.sdpa import CudnnKernel
from probe_gluon import D, H, HKV, dev, err, main, ref64, rnd, time_rows  # the backward's probe


# --d N after the lengths (main reads them from argv[1])
if len(sys.argv) > 1 and sys.argv[1].startswith("--"):
    raise SystemExit("usage: python benchmarks/probe_gluon_fwd.py SEQS [--d 64] [--into] (the lengths first)")
D = int(sys.argv[sys.argv.index("--d") + 1]) if "--d" in sys.argv else D
INTO = "--into" in sys.argv
scale = D ** -0.5
PIPES = (False, True) if hasattr(gf, "PIPE") else (False, )  # the variant flag, where the kernel has it


def check():
    res = []
    for pipe in PIPES:
        kw = dict(pipe=pipe) if len(PIPES) > 1 else {}
        for S, mask, sc in ((2048, "causal", scale), (1024, "full", scale), (1152, "strict", scale),
                            (384, "causal", scale), (640, "causal", -scale), (512, "strict", -scale),
                            (1280, "full", scale), (896, "causal", scale)):
            q, k, v = rnd(1, S, H, D), rnd(1, S, HKV, D), rnd(1, S, HKV, D)
            o_r, lse_r = ref64(q, k, v, torch.zeros_like(q), mask, sc)[:2]
            if mask != "strict":
                o, lse = gf.forward(q, k, v, sc, mask == "causal", **kw)
                res.append(dict(what="forward", pipe=pipe, D=D, S=S, mask=mask, scale=sc, o=err(o, o_r),
                                lse=err(lse, lse_r)))
            # the ring step: merge the keys' work into an empty running state
            out = torch.zeros(1, S, H, D, device=dev)
            lse = torch.full((1, H, S), float("-inf"), device=dev)
            lo = {"causal": 0, "strict": 1, "full": None}[mask]
            gf.forward_into(q, k, v, sc, lo, out, lse, **kw)
            res.append(dict(what="forward_into", pipe=pipe, D=D, S=S, mask=mask, scale=sc,
                            o=err(out, o_r), lse=err(lse, lse_r)))
            if mask == "full":
                # onto a state that is not empty: the keys in two blocks, merged one after the other
                out = torch.zeros(1, S, H, D, device=dev)
                lse = torch.full((1, H, S), float("-inf"), device=dev)
                for a, b in ((0, S // 2 // 128 * 128), (S // 2 // 128 * 128, S)):
                    gf.forward_into(q, k[:, a:b], v[:, a:b], sc, None, out, lse, **kw)
                res.append(dict(what="forward_into x2", pipe=pipe, D=D, S=S, mask=mask, scale=sc,
                                o=err(out, o_r), lse=err(lse, lse_r)))
    for r in res:
        r["ok"] = r["o"] < 2e-2 and r["lse"] < 1e-3
        print(("" if r["ok"] else "FAIL ") + str(r), flush=True)
    return res


def bench(seqs, warmup=2, iters=7):
    cud = CudnnKernel()
    res = []
    for S in seqs:
        q, k, v = rnd(1, S, H, D), rnd(1, S, HKV, D), rnd(1, S, HKV, D)
        for causal in (True, False):
            fl = 4 * S * S * H * D * (0.5 if causal else 1.0)
            tag = "causal" if causal else "full"
            cands = {f"cudnn {tag}": lambda: cud.forward(q, k, v, scale, tag)}
            for pipe in PIPES:
                kw = dict(pipe=pipe) if len(PIPES) > 1 else {}
                cands[f"gluon{' pipe' if pipe else ''} {tag}"] = lambda kw=kw: gf.forward(q, k, v, scale, causal, **kw)
            if INTO:
                # onto a running float32 state (merging the block again and again: lse grows, O stays)
                out = torch.zeros(1, S, H, D, device=dev)
                lse = torch.full((1, H, S), float("-inf"), device=dev)
                cands[f"cudnn-into {tag}"] = lambda: cud.forward_into(q, k, v, scale, tag, out, lse)
                cands[f"gluon-into {tag}"] = lambda: gf.forward_into(q, k, v, scale, 0 if causal else None, out, lse)
            res += [dict(r, mask=tag) for r in time_rows(S, cands, lambda name: fl, warmup, iters)]
        del q, k, v
        torch.cuda.empty_cache()
    return res


if __name__ == "__main__":
    main("gluon_fwd", check, bench, head_dim=D)
