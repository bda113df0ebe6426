"""Speed of our Triton LAO kernels on one GPU against SDPA cuDNN, SDPA flash and FlexAttention.

    burstengine bench lao-bench --stage sweep --configs-out lao_configs.json
    burstengine bench lao-bench --stage main --configs lao_configs.json

``sweep``: tile shapes, warps, pipeline depth and register caps per kernel part (forward, dK/dV
with the separate dQ kernel, dK/dV with dQ by atomics, the dQ kernel), all compiled in parallel
first, each spot-checked against float64 and timed on its own at S=16K (32 heads, bf16, full +
causal), the best three per part again at 64K (d=128), with cuDNN's times in the same process;
the fastest correct per part (and the faster dQ scheme) is written to --configs-out and becomes
the CONFIGS table.
``main``: with those configs, one launch over the whole sequence at --seqs (d=128, 32 heads,
bf16, full and causal): forward and forward+backward TFLOP/s of ours, cuDNN, flash and
compiled FlexAttention (4*S^2*H*d FLOPs forward, halved for causal, x3.5 for fwd+bwd), and
the ring step: our fused ``forward_into`` / ``backward_into`` against cuDNN + the torch merge
(forward) and cuDNN fed an `out` rebuilt from D (backward), per mask and GQA ratio.  Medians of
5 timings after 2 warm-ups (sweep: 5 after 1 at 16K, 2 after 1 at 64K).  Writes lao_bench.json to
$BURST_RESULTS or ./burst-results, the sweep included.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...kernels import KERNELS
from ...kernels.triton.kernel import CONFIGS, TileConfig, Tiles, TritonKernel, bwd_rows, gluon_bwd_takes, gluon_takes
from ...kernels.verify import NAMES, run_case
from ...masks import CAUSAL, FULL, MaskSpec, STRICT
from ...timing import median, timed
from ..harness import attn_flops
from ..records import write_record
from ..tables import Section, device_of, keyed, med, ms, num, ratio, record, span, table
from ..triton_variants import load_configs, log, warm_variants
from ..usage import command_parser

T = Tiles
# candidates per head dim, each timed on its own: forward tiles; dK/dV tiles with dQ from the
# separate kernel ("kv") or by atomics from the same program ("atomic"); the dQ kernel ("dq").
# Registers/shared memory per program decide how many programs share an SM (sm_90 builds:
# forward 64x64/4w 168 regs, 116 KB -> 2; 128x64/8w capped at 128 regs, 98 KB -> 2; 128x128/8w
# 245 regs -> 1; dK/dV 64x128/8w 255 regs -> 1).  Earlier rounds on H200 (16K, full/causal
# TFLOP/s of the part alone) dropped: forward 128x32/8w (354/347), 64x32/4w (462/393),
# 128x128/8w/2 stages (412/401), 16 warps x 256 rows (401/376), a lazy rescale (443 vs 523);
# dK/dV 32-row q tiles (398-591), 64x64/8w (298); dQ by atomics (TMA reduce-add: 252-319).
SWEEP = {
    128: dict(
        fwd=[T(128, 128, 8, 3, tma=True), T(64, 64, 4, 3, tma=True), T(128, 64, 8, 2, tma=True, maxnreg=128),
             T(128, 64, 8, 3, tma=True), T(256, 32, 16, 3, tma=True, maxnreg=128),
             T(256, 32, 16, 4, tma=True, maxnreg=128), T(256, 64, 16, 2, tma=True, maxnreg=128)],
        kv=[T(64, 128, 8, 3, tma=True), T(64, 64, 4, 2, tma=True)],
        atomic=[],
        dq=[T(128, 64, 8, 3, tma=True), T(64, 64, 4, 2, tma=True)]),
    64: dict(fwd=[T(64, 64, 4, 3, tma=True)], kv=[T(64, 64, 4, 2, tma=True)], dq=[T(64, 64, 4, 2, tma=True)],
             atomic=[]),
}


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape, device="cuda", dtype=dtype)


# --- sweep -------------------------------------------------------------------------------------


def _candidates(D):
    """(part, tiles, TileConfig that runs them) for every candidate of head dim D."""
    base, s = CONFIGS[D], SWEEP[D]
    dq0 = base.dq or T(128, 64, 8, 2, tma=True)
    out = [("fwd", t, TileConfig(fwd=t, kv=base.kv, dq=base.dq)) for t in s["fwd"]]
    out += [("kv", t, TileConfig(fwd=base.fwd, kv=t, dq=dq0)) for t in s["kv"]]
    out += [("atomic", t, TileConfig(fwd=base.fwd, kv=t, dq=None)) for t in s["atomic"]]
    out += [("dq", t, TileConfig(fwd=base.fwd, kv=base.kv, dq=t)) for t in s["dq"]]
    return out


def _spot_check(kern, D):
    """Worst normwise error of forward_into/backward_into against float64 on a ragged GQA block,
    causal and a sliding window (NaN counts as inf)."""

    worst = 0.0
    for i, mask in enumerate((CAUSAL, MaskSpec(causal=True, window=300, q_start=100))):
        r = run_case(kern, B=1, Sq=777, Sk=777, H=8, Hkv=2, D=D, dtype=torch.bfloat16, mask=mask, device="cuda",
                     seed=D + i)
        worst = max([worst] + [float("inf") if r["nan"] else r[n] for n in NAMES])
    return worst


def _part_fn(part, kern, tiles, S, D, mask, data):
    q, k, v, do, lse, delta, bufs = data
    scale = D ** -0.5
    if part == "fwd":
        return lambda: kern.forward(q, k, v, scale, mask)
    if part == "atomic":
        return lambda: kern.backward(do, q, k, v, lse, delta, scale, mask)
    # the backward's two launches on their own, from the rows they read (made once per call)
    lse2, delta2 = bwd_rows(lse, delta)
    if part == "kv":
        return lambda: kern._launch_kv(tiles, False, do, q, k, v, lse2, delta2, scale, mask, *bufs)
    return lambda: kern._launch_dq(tiles, do, q, k, v, lse2, delta2, scale, mask, bufs[0])


def _sweep_data(S, D, H=32):
    q, k, v, do = (rand(1, S, H, D) for _ in range(4))
    ref = KERNELS["cudnn"]
    per_mask = {}
    for mask in (FULL, CAUSAL):
        o, lse = ref.forward(q, k, v, D ** -0.5, mask)
        delta = (do.float() * o.float()).sum(-1).transpose(1, 2).contiguous()
        bufs = [torch.zeros_like(t) for t in (q, k, v)]
        per_mask[mask] = (q, k, v, do, lse, delta, bufs)
    return per_mask


def _cudnn_rows(S, D, H=32):
    """cuDNN forward and forward+backward TFLOP/s at S (the ratios' denominators)."""
    f = sdpa_fn("cudnn")
    q, k, v, do = (rand(1, S, H, D) for _ in range(4))
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = {}
    for mask in (FULL, CAUSAL):
        causal = mask == CAUSAL
        fl = attn_flops(1, S, S, H, D, 0.5 if causal else 1.0)
        with torch.no_grad():
            tf = median(timed(lambda: f(q, k, v, causal), "cuda", warmup=1, iters=5))
        tfb = median(timed(lambda: backward(f(qg, kg, vg, causal), do, (qg, kg, vg)), "cuda", warmup=1, iters=5))
        out[mask] = dict(fwd_s=tf, fwdbwd_s=tfb, bwd_s=tfb - tf, fwd_tflops=fl / tf / 1e12,
                         fwdbwd_tflops=3.5 * fl / tfb / 1e12)
    return out


def _time_parts(cands, S, D, iters, tag):
    data = _sweep_data(S, D)
    for part, tiles, cfg, row in cands:
        kern = TritonKernel({D: cfg})
        r = row.setdefault(tag, {})
        try:
            for mask in (FULL, CAUSAL):
                ts = timed(_part_fn(part, kern, tiles, S, D, mask, data[mask]), "cuda", warmup=1, iters=iters)
                r[mask] = median(ts)
            r["total_s"] = r[FULL] + r[CAUSAL]
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {e}"[:400]
        log(f"S={S} d={D} {part:>6} {tiles}: " + (f"full {r[FULL] * 1e3:.2f} ms, causal {r[CAUSAL] * 1e3:.2f} ms"
                                                    if "error" not in r else "FAILED " + r["error"][:200]))
    del data
    torch.cuda.empty_cache()


def sweep(args):
    """Time every candidate tile shape per kernel part at --sweep-seq, the best few again at
    --sweep-long, spot-check each against float64, and write the fastest correct per part."""
    t0 = time.time()
    cands = {D: _candidates(D) for D in SWEEP}
    tasks = [dict(config=c.to_dict(), D=D, dtype="bfloat16", doc=False, block=False)
             for D, cs in cands.items() for _, _, c in cs]
    errors = warm_variants(tasks, args.jobs)
    log(f"compiled {len(tasks)} sweep variants in {time.time() - t0:.0f}s, {len(errors)} failed")
    for e in errors:
        log("  ", e[:300])
    rows, chosen, cudnn = [], {}, {}
    for S in (args.sweep_seq, args.sweep_long):
        cudnn[S] = _cudnn_rows(S, 128)
        log(f"cudnn S={S}: " + ", ".join(f"{m} fwd {r['fwd_tflops']:.0f} f+b {r['fwdbwd_tflops']:.0f} TFLOP/s"
                                         for m, r in cudnn[S].items()))
    for D, cs in cands.items():
        entries = []
        for part, tiles, cfg in cs:
            row = dict(D=D, part=part, tiles=str(tiles), config=cfg.to_dict())
            try:
                row["err"] = _spot_check(TritonKernel({D: cfg}), D)
            except Exception as e:
                row["err"] = float("inf")
                row["check_error"] = f"{type(e).__name__}: {e}"[:400]
            row["ok"] = row["err"] <= 1e-2
            log(f"check d={D} {part} {tiles}: worst {row['err']:.2e} {'ok' if row['ok'] else 'FAIL'}")
            rows.append(row)
            entries.append((part, tiles, cfg, row))
        good = [e for e in entries if e[3]["ok"]]
        _time_parts(good, args.sweep_seq, D, args.sweep_iters, "short")
        # the best few per part again at the long length (D=128 only: the targets' head dim)
        long = []
        if D == 128:
            for part in ("fwd", "kv", "atomic", "dq"):
                ps = sorted([e for e in good if e[0] == part and "total_s" in e[3].get("short", {})],
                            key=lambda e: e[3]["short"]["total_s"])
                long += ps[:args.sweep_top]
            _time_parts(long, args.sweep_long, D, max(2, args.sweep_iters // 2), "long")

        def cost(e):
            r = e[3]
            return r["short"]["total_s"] + (r.get("long", {}).get("total_s", 0.0) / 16 if D == 128 else 0.0)

        def best(part):
            ps = [e for e in good if e[0] == part and "total_s" in e[3].get("short", {})
                  and (D != 128 or "total_s" in e[3].get("long", {}) or not long)]
            return min(ps, key=cost) if ps else None

        base = CONFIGS[D]
        f, kv, dq, at = best("fwd"), best("kv"), best("dq"), best("atomic")
        fwd = f[1] if f else base.fwd
        if kv and dq and (not at or cost(kv) + cost(dq) <= cost(at)):
            chosen[D] = TileConfig(fwd=fwd, kv=kv[1], dq=dq[1])
        elif at:
            chosen[D] = TileConfig(fwd=fwd, kv=at[1], dq=None)
        else:
            chosen[D] = TileConfig(fwd=fwd, kv=base.kv, dq=base.dq)
    out = {str(D): c.to_dict() for D, c in chosen.items()}
    with open(args.configs_out, "w") as fh:
        json.dump(out, fh, indent=1)
    log("chosen:", json.dumps(out))
    log(_sweep_table(rows, cudnn, args))
    e2e = _end_to_end(TritonKernel(chosen), cudnn, args) if 128 in chosen else []
    with open(args.configs_out + ".sweep.json", "w") as fh:
        json.dump(dict(seq=args.sweep_seq, long=args.sweep_long, heads=32, rows=rows, cudnn=cudnn, chosen=out,
                       end_to_end=e2e, compile_errors=errors, seconds=time.time() - t0,
                       flops="forward 4*S^2*H*d (x0.5 causal); dK/dV and atomic parts 2.5x, dQ part 1.5x"),
                  fh, indent=1)


def _end_to_end(ours, cudnn, args, H=32, D=128):
    """The chosen configs as the main stage runs them (forward; forward + D + backward) beside
    cuDNN, so the sweep already shows the ratios."""
    out = []
    for S in (args.sweep_seq, args.sweep_long):
        q, k, v, do = (rand(1, S, H, D) for _ in range(4))
        for mask in (FULL, CAUSAL):
            fl = attn_flops(1, S, S, H, D, 0.5 if mask == CAUSAL else 1.0)

            def fwdbwd():
                o, lse = ours.forward(q, k, v, D ** -0.5, mask)
                return ours.backward(do, q, k, v, lse, ours.delta(o, do), D ** -0.5, mask)

            tf = median(timed(lambda: ours.forward(q, k, v, D ** -0.5, mask), "cuda", warmup=1, iters=args.sweep_iters))
            tfb = median(timed(fwdbwd, "cuda", warmup=1, iters=args.sweep_iters))
            c = cudnn[S][mask]
            # the full-size output against cuDNN's (a race at this size would show here)
            with torch.no_grad():
                o = ours.forward(q, k, v, D ** -0.5, mask)[0].float()
                ref = sdpa_fn("cudnn")(q, k, v, mask == CAUSAL).float()
            r = dict(S=S, mask=mask, fwd_tflops=fl / tf / 1e12, fwdbwd_tflops=3.5 * fl / tfb / 1e12,
                     fwd_vs_cudnn=c["fwd_s"] / tf, fwdbwd_vs_cudnn=c["fwdbwd_s"] / tfb,
                     out_err_vs_cudnn=((o - ref).norm() / ref.norm()).item())
            del o, ref
            out.append(r)
            log(f"end to end S={S} {mask}: fwd {r['fwd_tflops']:.0f} TFLOP/s ({r['fwd_vs_cudnn']:.2f}x cudnn), "
                f"fwd+bwd {r['fwdbwd_tflops']:.0f} ({r['fwdbwd_vs_cudnn']:.2f}x cudnn), out vs cudnn "
                f"{r['out_err_vs_cudnn']:.1e}")
        del q, k, v, do
        torch.cuda.empty_cache()
    return out


def _sweep_table(rows, cudnn, args):
    """Per candidate: TFLOP/s of its part (flops of the whole pass it serves) beside cuDNN's."""
    lines = []
    for tag, S in (("short", args.sweep_seq), ("long", args.sweep_long)):
        for r in rows:
            t = r.get(tag)
            if not t or "total_s" not in t:
                continue
            D = r["D"]
            # forward FLOPs; the backward parts are shown as a share of the backward's 2.5x
            mult = {"fwd": 1.0, "kv": 2.5, "atomic": 2.5, "dq": 2.5}[r["part"]]
            cells = []
            for m in (FULL, CAUSAL):
                fl = mult * attn_flops(1, S, S, 32, D, 0.5 if m == CAUSAL else 1.0)
                c = cudnn[S][m]["fwd_s" if r["part"] == "fwd" else "bwd_s"] if D == 128 else None
                cells.append(f"{m} {fl / t[m] / 1e12:5.0f}" + (f" (cudnn {fl / c / 1e12:4.0f})" if c else ""))
            lines.append(f"S={S:>6} d={D} {r['part']:>6} {r['tiles']:<80} " + "  ".join(cells))
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------


def sdpa_fn(backend):
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend]

    def fn(q, k, v, causal):
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal).transpose(1, 2)
    return fn


def _causal(b, h, i, j):
    return i >= j


class Flex:
    def __init__(self):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self.attn = torch.compile(flex_attention, dynamic=True)
        self.make_mask = torch.compile(create_block_mask)
        self.masks = {}

    def __call__(self, q, k, v, causal):
        # q, k, v: (B, H, S, D)
        S = q.shape[2]
        bm = None
        if causal:
            if S not in self.masks:
                self.masks[S] = self.make_mask(_causal, None, None, S, S, device="cuda")
            bm = self.masks[S]
        return self.attn(q, k, v, block_mask=bm)


def backward(out, dout, leaves):
    for t in leaves:
        t.grad = None  # fresh gradients each call, as ours returns them (no accumulation pass)
    out.backward(dout)


def single_launch(args, ours, rows, checkpoint=lambda: None):
    flex = None
    if not args.no_flex:
        try:
            flex = Flex()
        except Exception as e:
            log(f"flex unavailable: {type(e).__name__}: {e}"[:300])
    for S in args.seqs:
        for causal in (False, True):
            _single_case(args, ours, flex, S, causal, rows)
            torch.cuda.empty_cache()
            checkpoint()


def _single_case(args, ours, flex, S, causal, rows):
    H, D, B = 32, 128, 1
    scale = D ** -0.5
    q, k, v, do = (rand(B, S, H, D) for _ in range(4))
    mask = CAUSAL if causal else FULL
    flops = attn_flops(B, S, S, H, D, 0.5 if causal else 1.0)

    def ours_fwd():
        return ours.forward(q, k, v, scale, mask)

    def ours_fwdbwd():
        o, lse = ours.forward(q, k, v, scale, mask)
        return ours.backward(do, q, k, v, lse, ours.delta(o, do), scale, mask)

    methods = {"ours": (ours_fwd, ours_fwdbwd)}
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    for name in ("cudnn", "flash"):
        if name == "flash" and S > args.flash_max:
            continue
        f = sdpa_fn(name)
        methods[name] = ((lambda f=f: f(q, k, v, causal)),
                         (lambda f=f: backward(f(qg, kg, vg, causal), do, (qg, kg, vg))))
    if flex is not None:
        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        doh = do.transpose(1, 2).contiguous()
        qhg, khg, vhg = (t.detach().clone().requires_grad_() for t in (qh, kh, vh))
        methods["flex"] = ((lambda: flex(qh, kh, vh, causal)),
                           (lambda: backward(flex(qhg, khg, vhg, causal), doh, (qhg, khg, vhg))))
    for name, (fwd, fwdbwd) in methods.items():
        for what, fn, fl in (("fwd", fwd, flops), ("fwd+bwd", fwdbwd, 3.5 * flops)):
            try:
                with torch.no_grad() if what == "fwd" else torch.enable_grad():
                    ts = timed(fn, "cuda", warmup=args.warmup, iters=args.iters)
                r = dict(times=ts, tflops=fl / median(ts) / 1e12)
            except Exception as e:
                r = dict(error=f"{type(e).__name__}: {e}"[:400])
            rows.append(dict(S=S, mask=mask, method=name, what=what, **r))
            log(f"S={S} {mask} {name} {what}: " + (f"{r['tflops']:.0f} TFLOP/s" if "tflops" in r
                                                  else r["error"][:200]))


def ring_step(args, ours, rows):
    """One ring step's local work on an n x n block with a non-empty running state."""
    for n in args.ring_seqs:
        for hkv in (32, 8):
            _ring_case(args, ours, n, hkv, rows)
            torch.cuda.empty_cache()


def _ring_case(args, ours, n, hkv, rows):
    D, H = 128, 32
    scale = D ** -0.5
    cudnn = KERNELS["cudnn"]
    q, do = rand(1, n, H, D), rand(1, n, H, D)
    k, v = rand(1, n, hkv, D), rand(1, n, hkv, D)
    out = torch.randn(1, n, H, D, device="cuda")
    lse = torch.randn(1, H, n, device="cuda") + 5.0
    delta = torch.randn(1, H, n, device="cuda")
    g = [torch.zeros(t.shape, device="cuda") for t in (q, k, v)]
    for mask in (FULL, CAUSAL, STRICT):
        flops = attn_flops(1, n, n, H, D, 1.0 if mask == FULL else 0.5)
        for kname, kern in (("ours", ours), ("cudnn", cudnn)):
            for what, fn, fl in (
                    ("forward_into", lambda: kern.forward_into(q, k, v, scale, mask, out, lse), flops),
                    ("backward_into", lambda: kern.backward_into(do, q, k, v, lse, delta, scale, mask, *g),
                     2.5 * flops)):
                try:
                    ts = timed(fn, "cuda", warmup=args.warmup, iters=args.iters)
                    r = dict(times=ts, tflops=fl / median(ts) / 1e12)
                except Exception as e:
                    r = dict(error=f"{type(e).__name__}: {e}"[:400])
                rows.append(dict(n=n, hkv=hkv, mask=mask, kernel=kname, what=what, **r))
                log(f"ring n={n} hkv={hkv} {mask} {kname} {what}: " +
                    (f"{r['tflops']:.0f} TFLOP/s ({median(r['times']) * 1e3:.2f} ms)" if "tflops" in r
                     else r["error"][:200]))


def summarize(single, ring):
    def get(rows, **kw):
        for r in rows:
            if all(r.get(a) == b for a, b in kw.items()) and "tflops" in r:
                return r["tflops"]
        return None

    summary, lines = [], []
    for S in sorted({r["S"] for r in single}):
        for mask in (FULL, CAUSAL):
            row = dict(S=S, mask=mask)
            for what in ("fwd", "fwd+bwd"):
                o = get(single, S=S, mask=mask, method="ours", what=what)
                for peer in ("cudnn", "flash", "flex"):
                    p = get(single, S=S, mask=mask, method=peer, what=what)
                    row[f"{what} {peer}"] = p
                    row[f"{what} ours/{peer}"] = (o / p) if (o and p) else None
                row[f"{what} ours"] = o
            summary.append(row)

    def f(x, ratio=False):
        return "-" if x is None else (f"{x:.2f}x" if ratio else f"{x:.0f}")

    lines.append(f"{'S':>7} {'mask':>6} | {'fwd ours':>8} {'cudnn':>6} {'flash':>6} {'flex':>6} {'/cudnn':>7} "
                 f"{'/flex':>7} | {'f+b ours':>8} {'cudnn':>6} {'flash':>6} {'flex':>6} {'/cudnn':>7} {'/flex':>7}")
    for r in summary:
        lines.append(f"{r['S']:>7} {r['mask']:>6} | " + " ".join(
            [f"{f(r[w + ' ours']):>8} {f(r[w + ' cudnn']):>6} {f(r[w + ' flash']):>6} {f(r[w + ' flex']):>6} "
             f"{f(r[w + ' ours/cudnn'], True):>7} {f(r[w + ' ours/flex'], True):>7} |" for w in ("fwd", "fwd+bwd")]))
    ring_summary = []
    for key in sorted({(r["n"], r["hkv"], r["mask"], r["what"]) for r in ring}):
        n, hkv, mask, what = key
        o = [r for r in ring if (r["n"], r["hkv"], r["mask"], r["what"], r["kernel"]) == key + ("ours",)]
        c = [r for r in ring if (r["n"], r["hkv"], r["mask"], r["what"], r["kernel"]) == key + ("cudnn",)]
        if o and c and "times" in o[0] and "times" in c[0]:
            to, tc = median(o[0]["times"]), median(c[0]["times"])
            ring_summary.append(dict(n=n, hkv=hkv, mask=mask, what=what, ours_ms=to * 1e3, cudnn_ms=tc * 1e3,
                                     speedup=tc / to))
            lines.append(f"ring n={n:>6} hkv={hkv:>2} {mask:>6} {what:>13}: ours {to * 1e3:7.2f} ms, "
                         f"cudnn(+merge) {tc * 1e3:7.2f} ms, speedup {tc / to:.2f}x")
    return summary, ring_summary, "\n".join(lines)


def main_stage(args):
    ours = TritonKernel(load_configs(args.configs))
    t0 = time.time()
    sweep_path = args.sweep_record or (args.configs + ".sweep.json" if args.configs else None)
    sweep_rec = json.load(open(sweep_path)) if sweep_path and os.path.exists(sweep_path) else None
    single, ring = [], []
    x = torch.empty(1, 16384, 32, 128, dtype=torch.bfloat16, device="cuda")
    # which kernel "ours" runs for the plain full/causal forward (fwd rows, and fwd of fwd+bwd)
    plain_forward = "gluon (kernels/gluon/fwd.py)" if gluon_takes(x, x, x) else "triton (kernels/triton/fwd.py)"
    st = (torch.empty(1, 16384, 32, 128, device="cuda"), torch.empty(1, 32, 16384, device="cuda"))
    ring_forward_into = ("gluon (kernels/gluon/fwd.py) for full/causal/strict" if gluon_takes(x, x, x, FULL, *st)
                         else "triton (kernels/triton/fwd.py)")
    # and for the backward (bwd of fwd+bwd, and the ring step's backward_into onto float32 grads)
    grads = (st[0], *(torch.empty(1, 16384, n, 128, device="cuda") for n in (32, 32)))
    plain_backward = ("gluon (kernels/gluon/bwd.py)" if gluon_bwd_takes(x, x, x, CAUSAL, x)
                      else "triton (kernels/triton/bwd.py)")
    ring_backward_into = ("gluon (kernels/gluon/bwd.py) for full/causal/strict"
                          if gluon_bwd_takes(x, x, x, FULL, x, *grads) else "triton (kernels/triton/bwd.py)")
    del x, st, grads

    def record(done):
        summary, ring_summary, table = summarize(single, ring)
        path = write_record("lao_bench", dict(
            complete=done, configs={str(D): c.to_dict() for D, c in ours.config.items()}, sweep=sweep_rec,
            single_launch=dict(heads=32, head_dim=128, dtype="bfloat16", batch=1, rows=single, summary=summary),
            ring_step=dict(heads=32, head_dim=128, dtype="bfloat16", rows=ring, summary=ring_summary),
            table=table, seconds=time.time() - t0, plain_forward=plain_forward, ring_forward_into=ring_forward_into,
            plain_backward=plain_backward, ring_backward_into=ring_backward_into, flops="forward 4*S^2*H*d (x0.5 causal), forward+backward 3.5x; ring backward_into 2.5x forward"))
        return path, table

    # compile what the main stage runs before timing anything
    errs = warm_variants([dict(config=c.to_dict(), D=D, dtype="bfloat16", doc=False, block=False, H=32, Hkv=hkv)
                          for D, c in ours.config.items() for hkv in (32, 8)], args.jobs)
    for e in errs:
        log("compile error:", e[:300])
    # a time limit's SIGTERM still leaves a record of what was measured
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    done = False
    try:
        if not args.skip_ring:
            ring_step(args, ours, ring)
            record(False)
        single_launch(args, ours, single, lambda: record(False))
        done = True
    finally:
        path, table = record(done)
        log(table)
        log("wrote", path)


def main(argv=None):
    ap = command_parser("burstengine bench lao-bench", __doc__)
    ap.add_argument("--stage", choices=("sweep", "main"), required=True)
    ap.add_argument("--configs", default=None, help="JSON from the sweep (default: the CONFIGS table)")
    ap.add_argument("--configs-out", default="lao_configs.json")
    ap.add_argument("--seqs", default="16384,32768,65536,131072")
    ap.add_argument("--ring-seqs", default="8192,16384")
    ap.add_argument("--sweep-seq", type=int, default=16384)
    ap.add_argument("--sweep-long", type=int, default=65536)
    ap.add_argument("--sweep-top", type=int, default=3, help="candidates per part timed again at --sweep-long")
    ap.add_argument("--sweep-iters", type=int, default=5)
    ap.add_argument("--flash-max", type=int, default=32768, help="skip SDPA flash above this length (slowest peer)")
    ap.add_argument("--sweep-record", default=None, help="a sweep's JSON to embed in the record (default: "
                    "<--configs>.sweep.json)")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--skip-ring", action="store_true")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=8)
    args = ap.parse_args(argv)
    args.seqs = [int(s) for s in args.seqs.split(",") if s]
    args.ring_seqs = [int(s) for s in args.ring_seqs.split(",") if s]
    if args.stage == "sweep":
        sweep(args)
    else:
        main_stage(args)


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    out = []
    sl = rec["single_launch"]
    rows = keyed(sl["rows"], "S", "mask", "method", "what")
    cases = sorted({(r["S"], r["mask"]) for r in sl["rows"]}, key=lambda c: (c[0], c[1] != "full"))
    body = []
    for S, mask in cases:
        line = [S, mask]
        for what in ("fwd", "fwd+bwd"):
            ours = rows.get((S, mask, "ours", what))
            line.append(num(ours["tflops"], 4) if ours else "—")
            for peer in ("cudnn", "flash", "flex"):
                p = rows.get((S, mask, peer, what))
                line.append(num(p["tflops"], 4) if p else "—")
            for peer in ("cudnn", "flex"):
                p = rows.get((S, mask, peer, what))
                line.append(ratio(med(p["times"]), med(ours["times"])) if p and ours else "—")
        body.append(line)
    out.append(f"One launch, {sl.get('dtype', '?')}, d={sl.get('head_dim', '?')}, {sl.get('heads', '?')} heads, "
               f"batch {sl.get('batch', '?')}: TFLOP/s and our speed relative to a peer (the peer's median time "
               "÷ ours).")
    out.append("")
    out += table(["S", "mask", "fwd ours", "cuDNN", "flash", "Flex", "ours/cuDNN", "ours/Flex",
                  "f+b ours", "cuDNN", "flash", "Flex", "ours/cuDNN", "ours/Flex"], body)
    rs = rec.get("ring_step") or {}
    if rs.get("rows"):
        rrows = keyed(rs["rows"], "n", "hkv", "mask", "kernel", "what")
        keys = sorted({(r["n"], r["hkv"], r["mask"], r["what"]) for r in rs["rows"]})
        body = []
        for n, hkv, mask, what in keys:
            o, c = rrows.get((n, hkv, mask, "ours", what)), rrows.get((n, hkv, mask, "cudnn", what))
            body.append([n, f"{rs.get('heads', '?')}/{hkv}", mask, what, ms(med(o["times"])) if o else "—",
                         ms(med(c["times"])) if c else "—",
                         ratio(med(c["times"]), med(o["times"])) if o and c else "—"])
        out.append("Ring step (one block pair onto the running float32 state), n rows per block: our kernel "
                   "against cuDNN plus the torch merge or gradient adds.")
        out.append("")
        out += table(["n", "H/Hkv", "mask", "call", "ours ms", "cuDNN(+merge) ms", "ours speed ÷ cuDNN's"], body)
    notes = [f"{k.replace('_', ' ')}: {rec[k]}" for k in ("plain_forward", "plain_backward", "ring_forward_into",
                                                          "ring_backward_into", "flops") if rec.get(k)]
    if notes:
        out += ["- " + n for n in notes] + [""]
    return out


def _lao_ratios(rec, what, peer):
    rows = keyed(rec["single_launch"]["rows"], "S", "mask", "method", "what")
    return [med(p["times"]) / med(rows[(S, m, "ours", w)]["times"])
            for (S, m, meth, w), p in rows.items() if meth == peer and w == what and (S, m, "ours", w) in rows]


def block_lao(records):
    h200 = record(records, "lao_bench.json")
    h100 = record(records, "lao_bench_h100.json")
    parts = []
    for rec, name in ((h200, "lao_bench.json"), (h100, "lao_bench_h100.json")):
        parts.append(f"on {device_of(rec)} (`{name}`) the forward runs at {span(_lao_ratios(rec, 'fwd', 'cudnn'))}× "
                     f"cuDNN's speed and {span(_lao_ratios(rec, 'fwd', 'flex'))}× FlexAttention's, forward + backward "
                     f"at {span(_lao_ratios(rec, 'fwd+bwd', 'cudnn'))}× cuDNN and "
                     f"{span(_lao_ratios(rec, 'fwd+bwd', 'flex'))}× Flex")
    sl = h200["single_launch"]
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(sl.get("dtype"), sl.get("dtype"))
    return f"In one launch ({dtype}, d={sl.get('head_dim')}), " + "; ".join(parts) + "."


SECTIONS = (Section("LAO kernels: speed", r"^lao_bench", render,
                    "`burstengine bench lao-bench`: our kernels against cuDNN, flash and FlexAttention on one GPU."),)
BLOCKS = {"lao": block_lao}
