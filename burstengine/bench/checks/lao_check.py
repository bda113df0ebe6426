"""Correctness of our Triton LAO kernels on the GPU against the float64 reference, every flag.

    burstengine bench lao-check [--configs lao_configs.json]

Each case runs ``forward_into`` onto a random non-empty running state (rows still empty there
have O poisoned with NaN where this block makes them visible) and ``backward_into`` onto random
float32 accumulators, and compares out, lse and the dQ/dK/dV increments with the float64
reference kernel on the same inputs (burstengine/kernels/verify.py): normwise error <= --tol
(1e-2), no NaN anywhere.  Cases: FULL/CAUSAL/STRICT x GQA 1/2/4/8 x head dim 64/128 (96, 256) x bf16/fp16
at odd and tile-aligned lengths; MaskSpec windows (causal and not), striped positions, Sq != Sk,
documents, block masks (aligned and ragged block sizes), their combinations, and a block that
sees nothing; K/V rows in whole tiles that no query sees are poisoned with NaN, so a kernel
that loads a tile it should skip fails.  Square full/causal cases also run the plain forward and
backward (fresh outputs).  On Hopper the shapes kernels/gluon/fwd.py and gluon/bwd.py take run
there (lengths multiples of 128, d 64, 128 and 256; d=96's forward, its backward cuDNN's): the
record marks each case; four cases are long
enough that the Gluon backward splits a kv head's q heads over programs, four full blocks have
Sq != Sk.
Writes lao_check.json to $BURST_RESULTS or ./burst-results.
"""
from __future__ import annotations

import importlib
import itertools
import math
import os
import time

import torch

from ...kernels.gluon.grid import KV_ROWS, program_split
from ...kernels.triton.kernel import TritonKernel, gluon_bwd_takes, gluon_takes
from ...kernels.verify import NAMES, run_case, run_plain_backward, run_plain_forward
from ...masks import CAUSAL, FULL, MaskSpec, STRICT
from ...testing import suite_on_path
from ..records import write_record
from ..tables import Section, num, table
from ..triton_variants import load_configs, warm_variants
from ..usage import command_parser


def docs(n, seed, mean=150):
    """Sorted document ids for n rows, random lengths around ``mean``."""
    g = torch.Generator().manual_seed(seed)
    lens = (torch.rand(n // 20 + 2, generator=g) * 2 * mean).long() + 1
    return torch.repeat_interleave(torch.arange(lens.numel()), lens)[:n]


def block_mask(nq, nk, seed, p=0.5):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(nq, nk, generator=g) < p


def cases():
    """(name, dict(B, Sq, Sk, H, Hkv, D, dtype, mask))."""
    out = []
    H = 8
    for i, (mask, D, dtype, hkv) in enumerate(itertools.product((FULL, CAUSAL, STRICT), (64, 128),
                                                                (torch.bfloat16, torch.float16), (8, 4, 2, 1))):
        S = (1000, 1024, 777, 1536)[i % 4]
        out.append((f"{mask}-d{D}-{str(dtype)[6:]}-gqa{H // hkv}-S{S}",
                    dict(B=2 if i % 3 == 0 else 1, Sq=S, Sk=S, H=H, Hkv=hkv, D=D, dtype=dtype, mask=mask)))
    S = 1100
    qd = docs(S, 1)
    specs = {
        "window-causal": (S, S, MaskSpec(causal=True, window=300)),
        "window-causal-offset": (S, 900, MaskSpec(causal=True, window=257, q_start=700, k_start=0)),
        "window-nocausal": (S, S, MaskSpec(window=200, q_start=100)),
        "striped-causal": (S, S, MaskSpec(causal=True, q_start=2, q_step=4, k_start=1, k_step=4)),
        "striped-strict": (S, S, MaskSpec(causal=True, q_start=1, q_step=4, k_start=3, k_step=4)),
        "zigzag-half": (S, 550, MaskSpec(causal=True, q_start=550, k_start=0)),
        "docs": (S, S, MaskSpec(q_doc=qd, k_doc=qd)),
        "docs-causal": (S, S, MaskSpec(causal=True, q_doc=qd, k_doc=qd)),
        "docs-causal-window": (S, S, MaskSpec(causal=True, window=100, q_doc=qd, k_doc=qd)),
        "docs-shifted": (S, S, MaskSpec(causal=True, q_start=S, q_doc=docs(S, 2) + 2, k_doc=docs(S, 2))),
        "block128": (S, S, MaskSpec(block_mask=block_mask(9, 9, 3), block_size=128)),
        "block96-causal": (S, S, MaskSpec(causal=True, block_mask=block_mask(12, 12, 4), block_size=96)),
        "block64-docs": (S, S, MaskSpec(q_doc=qd, k_doc=qd, block_mask=block_mask(18, 18, 5, 0.7), block_size=64)),
        "nothing-visible": (S, S, MaskSpec(causal=True, k_start=5000)),
    }
    for i, (name, (sq, sk, spec)) in enumerate(specs.items()):
        for D in (64, 128):
            hkv = (8, 2, 1, 4)[(i + D // 64) % 4]
            out.append((f"{name}-d{D}-gqa{H // hkv}", dict(B=1 + (i % 2), Sq=sq, Sk=sk, H=H, Hkv=hkv, D=D,
                                                           dtype=torch.bfloat16, mask=spec)))
    for mask, D, dtype, hkv in itertools.product((FULL, CAUSAL), (64, 128), (torch.bfloat16, torch.float16), (8, 2)):
        # larger plain-forward shapes for the Gluon kernel (several kv tiles, batch > 1, GQA)
        out.append((f"plain-{mask}-d{D}-{str(dtype)[6:]}-gqa{H // hkv}-S4096",
                    dict(B=2, Sq=4096, Sk=4096, H=H, Hkv=hkv, D=D, dtype=dtype, mask=mask)))
    out.append(("window-causal-d128-fp16", dict(B=1, Sq=S, Sk=S, H=H, Hkv=2, D=128, dtype=torch.float16,
                                                 mask=specs["window-causal"][2])))
    for D in (64, 128):
        # a ring step's full block of fewer query rows than keys, and more (the Gluon backward's
        # programs start their q tiles staggered over Sq / Sk)
        out.append((f"rect-full-d{D}-gqa4-Sq1024-Sk2560", dict(B=1, Sq=1024, Sk=2560, H=8, Hkv=2, D=D,
                                                                dtype=torch.bfloat16, mask=FULL)))
        out.append((f"rect-full-d{D}-gqa2-Sq3072-Sk1280", dict(B=2, Sq=3072, Sk=1280, H=8, Hkv=4, D=D,
                                                                dtype=torch.bfloat16, mask=FULL)))
    for mask, D in itertools.product((FULL, CAUSAL), (64, 128, 256)):
        # long enough (130 q tiles x 8 q heads > gluon/grid.py's MAX_STEPS) that the Gluon backward
        # onto float32 splits a kv head's q heads over programs, adding dK/dV atomically
        out.append((f"split-{mask}-d{D}-gqa8-S8320", dict(B=1, Sq=8320, Sk=8320, H=8, Hkv=1, D=D,
                                                           dtype=torch.bfloat16, mask=mask)))
    for D in (64, 128, 256):
        # a full block of more q tiles (1,040) than gluon/grid.py's Q_CHUNK at each head dim: one
        # head and one chunk of q tiles a program, the last chunk short
        out.append((f"chunks-full-d{D}-gqa4-Sq66560-Sk1024", dict(B=1, Sq=66560, Sk=1024, H=8, Hkv=2, D=D,
                                                                   dtype=torch.bfloat16, mask=FULL)))
    for D in (256, 96):
        # d=256: the Gluon forward's build of 64-row kv tiles and O in halves, bwd_wide.py's backward;
        # d=96: the Gluon forward in column pieces of 64 and 32, cuDNN's backward
        for i, (mask, dtype) in enumerate(itertools.product((FULL, CAUSAL, STRICT), (torch.bfloat16, torch.float16))):
            S = (1024, 1536, 4096)[i % 3]
            out.append((f"{mask}-d{D}-{str(dtype)[6:]}-gqa{(1, 2, 4)[i % 3]}-S{S}",
                        dict(B=2 if i % 2 else 1, Sq=S, Sk=S, H=8, Hkv=8 // (1, 2, 4)[i % 3], D=D, dtype=dtype,
                             mask=mask)))
        out.append((f"rect-full-d{D}-gqa4-Sq1024-Sk2560", dict(B=1, Sq=1024, Sk=2560, H=8, Hkv=2, D=D,
                                                                dtype=torch.bfloat16, mask=FULL)))
    return out


def _interpreter(tests_dir):
    """The CPU smoke run: Triton's interpreter with the test suite's fixes to it
    (tests/triton_interp.py, from a source checkout), switched on before triton loads: it picks
    the interpreter when the kernels are defined, and our Triton kernel modules load on first use."""
    if not os.path.exists(os.path.join(tests_dir, "triton_interp.py")):
        raise SystemExit(f"burstengine bench lao-check --device cpu: no triton_interp.py in "
                         f"{os.path.abspath(tests_dir)}; run it from a source checkout's root or pass --tests DIR")
    suite_on_path(tests_dir)
    importlib.import_module("triton_interp")


def main(argv=None):
    ap = command_parser("burstengine bench lao-check", __doc__)
    ap.add_argument("--configs", default=None, help="JSON from `burstengine bench lao-bench --stage sweep` (default: CONFIGS)")
    ap.add_argument("--tol", type=float, default=1e-2)
    ap.add_argument("--jobs", type=int, default=8)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run under TRITON_INTERPRET=1 (with --limit)")
    ap.add_argument("--limit", type=int, default=0, help="run every n-th case only")
    ap.add_argument("--tests", default="tests",
                    help="with --device cpu: the checkout's tests folder, for its triton_interp.py [tests]")
    ap.add_argument("--small", action="store_true", help="mask-kind cases only, shrunk (with --device cpu)")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        _interpreter(args.tests)
    kern = TritonKernel(load_configs(args.configs))
    t0 = time.time()
    all_cases = cases()
    if args.device == "cpu":
        all_cases = [(n, c) for n, c in all_cases if c["D"] in kern.config]  # d 96, 256 run in Gluon only
    if args.limit:
        all_cases = all_cases[::args.limit]
    if args.small:
        # the interpreter's size: the mask-kind cases at 2 heads and 200 or 256 rows (odd or whole tiles)
        all_cases = [(n, dict(c, H=2, Hkv=min(c["Hkv"], 2), Sq=256 if c["Sq"] % 128 == 0 else 200,
                              Sk=256 if c["Sq"] % 128 == 0 else 200))
                     for n, c in all_cases if not isinstance(c["mask"], MaskSpec)]
    variants = {(c["D"], str(c["dtype"])[6:], isinstance(c["mask"], MaskSpec) and c["mask"].q_doc is not None,
                 isinstance(c["mask"], MaskSpec) and c["mask"].block_mask is not None) for _, c in all_cases}
    errs = warm_variants([dict(config=kern.config[D].to_dict(), D=D, dtype=dt, doc=doc, block=blk)
                          for D, dt, doc, blk in sorted(variants) if D in kern.config],
                         args.jobs) if args.device == "cuda" else []
    print(f"compiled {len(variants)} variants in {time.time() - t0:.0f}s", flush=True)
    for e in errs:
        print("compile error:", e[:500], flush=True)
    rows, failed = [], 0
    for name, c in all_cases:
        D = c["D"]
        t = kern.config.get(D)
        # K/V poisoned in whole kv tiles of the kernels that run (Gluon's alone at d 96 and 256: 128
        # rows, 64 at d=256)
        gran = (math.lcm(t.fwd.block_n, t.kv.block_n, *(x.block_n for x in (t.dq, t.fwd_into) if x)) if t
                else KV_ROWS.get(D, 128))
        q = torch.empty(1, c["Sq"], c["H"], D, dtype=c["dtype"], device=args.device)
        kk = torch.empty(1, c["Sk"], c["Hkv"], D, dtype=c["dtype"], device=args.device)
        try:
            state = (torch.empty(1, c["Sq"], c["H"], D, device=args.device),
                     torch.empty(1, c["H"], c["Sq"], device=args.device))
            # a head dim of the Gluon forward only (256): its forward must run there
            assert kern.supports(q, kk, kk, c["mask"]) or (args.device == "cuda" and gluon_takes(q, kk, kk, c["mask"], *state)), \
                "case would take the fallback"
            r = run_case(kern, device=args.device, seed=len(rows) + 1, poison_kv=gran, **c)
            r["ok"] = not r["nan"] and all(r[n] <= args.tol for n in NAMES)
            r["gluon_into"] = gluon_takes(q, kk, kk, c["mask"], *state)  # forward_into ran in gluon/fwd.py
            grads = (torch.empty(1, c["Sq"], c["H"], D, device=args.device),
                     *(torch.empty(1, c["Sk"], c["Hkv"], D, device=args.device) for _ in range(2)))
            r["gluon_bwd_into"] = gluon_bwd_takes(q, kk, kk, c["mask"], q, *grads)  # backward_into in gluon/bwd.py
            if r["gluon_bwd_into"]:
                # (q heads, q tiles) a program: fewer than the group's or the block's, split over
                # programs, dK/dV added atomically
                r["gluon_bwd_split"] = program_split(q, kk, grads[1], grads[2], fresh=False, diag=c["mask"] != FULL)
            if c["mask"] in (FULL, CAUSAL) and c["Sq"] == c["Sk"]:
                # the plain forward: Gluon on Hopper where the shape allows it (S a multiple of 128)
                p = run_plain_forward(kern, c["B"], c["Sq"], c["H"], c["Hkv"], D, c["dtype"], c["mask"], args.device,
                                      seed=len(rows) + 1)
                p["gluon"] = gluon_takes(q, kk, kk, c["mask"])
                p.update(run_plain_backward(kern, c["B"], c["Sq"], c["H"], c["Hkv"], D, c["dtype"], c["mask"],
                                            args.device, seed=len(rows) + 1))
                p["gluon_bwd"] = gluon_bwd_takes(q, kk, kk, c["mask"], q)
                r.update(p)
                r["ok"] = (r["ok"] and not p["fwd_nan"] and not p["bwd_nan"]
                           and all(p[n] <= args.tol for n in ("fwd_out", "fwd_lse", "bwd_dq", "bwd_dk", "bwd_dv")))
        except Exception as e:
            r = dict(ok=False, error=f"{type(e).__name__}: {e}"[:500])
        failed += not r["ok"]
        rows.append(dict(case=name, **{k: (str(v)[6:] if k == "dtype" else v) for k, v in c.items() if k != "mask"},
                         **r))
        worst = max((r.get(n, float("inf")) for n in NAMES), default=float("inf"))
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {name:<36} worst {worst:.2e} "
              + (f"poisoned {r.get('poisoned_kv_rows', 0)}" if "error" not in r else r["error"][:300]), flush=True)
    print(f"{len(rows) - failed}/{len(rows)} cases within {args.tol:g}, {time.time() - t0:.0f}s", flush=True)
    path = write_record("lao_check", dict(tol=args.tol, passed=len(rows) - failed, total=len(rows),
                                          configs={str(D): c.to_dict() for D, c in kern.config.items()},
                                          compile_errors=errs, rows=rows, seconds=time.time() - t0))
    print("wrote", path)
    return 1 if failed else 0


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    groups: dict = {}
    for r in rec["rows"]:
        groups.setdefault(r["case"].split("-d")[0], []).append(r)
    body = []
    for kind, rs in sorted(groups.items()):
        worst = [num(max(r.get(q) or 0.0 for r in rs)) for q in ("out", "lse", "dq", "dk", "dv")]
        gluon = sum(bool(r.get("gluon") or r.get("gluon_bwd") or r.get("gluon_into") or r.get("gluon_bwd_into"))
                    for r in rs)
        body.append([kind, len(rs), sum(bool(r["ok"]) for r in rs), gluon] + worst)
    head = [f"{rec['passed']}/{rec['total']} cases within {num(rec['tol'])} of float64 "
            f"({len(rec.get('compile_errors') or [])} compile errors).", ""]
    return head + table(["mask kind", "cases", "passed", "ran Gluon", "worst out", "lse", "dQ", "dK", "dV"], body)


SECTIONS = (Section("LAO kernels: correctness", r"^lao_check", render,
                    ("`burstengine bench lao-check`: every mask kind, MaskSpec flag, GQA ratio, head dim and dtype against "
                     "float64.")),)
