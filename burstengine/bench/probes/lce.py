"""LM head + cross-entropy, forward + backward, on one GPU: peak memory and time of

  naive      F.cross_entropy(F.linear(h, w), y)            (bf16 logits, N x V)
  compiled   torch.compile of the naive function
  liger      Liger-Kernel's fused linear cross-entropy    (default: dW accumulated in bf16)
  liger32    the same with accum_dtype=float32             (our default precision)
  burst      burstengine.fused_linear_cross_entropy        (Triton per-chunk kernel on CUDA)
  burst16    the same with accum_dtype=bfloat16             (Liger's default precision)

for each vocabulary x token count, hidden 4096, bf16, in one process.  Peak memory is the
most allocated during one forward + backward beyond what was allocated before it (h, w, y):
it includes the gradients dh, dw every method must return.  Times: median of --iters after
--warmup (CUDA events).  --check first compares the fused loss and both gradients against a
float64 reference (Triton and torch paths, bf16 and fp32, softcap, z-loss, ignored labels,
reduction none with a random upstream gradient).

    burstengine bench lce --check                       # the full table on one GPU
    burstengine bench lce --device cpu --vocab 1000 --tokens 256 --hidden 64 --check
"""
from __future__ import annotations

import gc
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from ..tables import Section, fixed, keyed, med, ms, num, table
import burstengine as be
from ...testing import fro_err
from ...timing import timed
from ..records import write_record
from ..usage import command_parser


def naive(h, w, y):
    return F.cross_entropy(F.linear(h, w), y)


def reference(h, w, y, softcap=None, z_loss=0.0, reduction="mean"):
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    x = h64 @ w64.T
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    valid = y != -100
    per = F.cross_entropy(x, y, reduction="none") + z_loss * torch.where(valid, torch.logsumexp(x, -1) ** 2, 0.0)
    loss = per if reduction == "none" else per.sum() / valid.sum()
    return loss, h64, w64


def check(device, impls):
    """Errors of the fused path against float64, next to naive bf16's (the floor of bf16 logits)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    N, V, d = (4133, 32123, 256) if device.type == "cuda" else (301, 1000, 32)
    rows, worst = [], {}
    for dtype in (torch.bfloat16, torch.float32):
        h = torch.randn(N, d, generator=g).to(device, dtype)
        w = (torch.randn(V, d, generator=g) * 2 / d ** 0.5).to(device, dtype)
        y = torch.randint(0, V, (N,), generator=g).to(device)
        y[torch.rand(N, generator=g).to(device) < 0.1] = -100
        for opt in (dict(), dict(softcap=15.0, z_loss=1e-3), dict(reduction="none")):
            up = (torch.randn(N, generator=g).to(device, torch.float64) if opt.get("reduction") == "none"
                  else torch.tensor(1.3, device=device, dtype=torch.float64))
            ref, h64, w64 = reference(h, w, y, **opt)
            (ref * up).sum().backward()
            cands = [(f"burst-{i}", lambda hl, wl, i=i: be.fused_linear_cross_entropy(
                hl, wl, y, impl=i, chunk_size=1000 if device.type == "cuda" else 100, **opt)) for i in impls]
            if not opt:
                cands.append(("naive", lambda hl, wl: naive(hl, wl, y)))
            for name, fn in cands:
                hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
                loss = fn(hl, wl)
                (loss * up.to(loss.dtype)).sum().backward()
                e = dict(loss=fro_err(loss.detach(), ref.detach()), dh=fro_err(hl.grad, h64.grad),
                         dw=fro_err(wl.grad, w64.grad))
                rows.append(dict(dtype=str(dtype), opt=str(opt), method=name, **e))
                print(f"check {str(dtype):15s} {str(opt):38s} {name:13s} loss {e['loss']:.1e} dh {e['dh']:.1e} "
                      f"dw {e['dw']:.1e}", flush=True)
                if name.startswith("burst"):
                    worst[str(dtype)] = max(worst.get(str(dtype), 0.0), *e.values())
            del ref, h64, w64
    tol = {"torch.bfloat16": 1.5e-2, "torch.float32": 1e-4}
    ok = all(worst[k] <= tol[k] for k in worst)
    print(f"check {'PASSED' if ok else 'FAILED'}: worst normwise error per dtype {worst}", flush=True)
    return dict(rows=rows, worst=worst, tol=tol, passed=ok)


def methods(names):
    out = {}
    for name in names:
        if name == "naive":
            out[name] = naive
        elif name == "compiled":
            # dynamic: one compilation serves every size (a static one per size costs device time)
            out[name] = torch.compile(naive, dynamic=True)
        elif name in ("liger", "liger32"):
            try:
                from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as L
            except Exception as e:  # not installed: say so in the table rather than stop
                print(f"liger unavailable: {e!r}", flush=True)
                continue
            acc = torch.float32 if name == "liger32" else None
            out[name] = (lambda L, acc: lambda h, w, y: L.apply(h, w, y, None, None, -100, 0.0, 0.0, "mean", None,
                                                                 False, acc)[0])(L, acc)
        elif name == "burst":
            out[name] = lambda h, w, y: be.fused_linear_cross_entropy(h, w, y)
        elif name == "burst16":
            out[name] = lambda h, w, y: be.fused_linear_cross_entropy(h, w, y, accum_dtype=torch.bfloat16)
        else:
            raise SystemExit(f"unknown method {name}")
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_one(fn, h, w, y, device, warmup, iters):
    """Warm-up calls (the first one timed on its own: it holds compilation), the second of
    them measured for peak memory, then ``iters`` timed calls."""
    def step():
        h.grad = w.grad = None
        fn(h, w, y).backward()

    first = timed(step, device, warmup=0)[0]
    h.grad = w.grad = None
    gc.collect()
    peak = None
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    step()
    if device.type == "cuda":
        sync(device)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    for _ in range(max(0, warmup - 2)):
        step()
    times = [timed(step, device, warmup=0)[0] for _ in range(iters)]
    h.grad = w.grad = None
    return dict(first_s=first, peak_gib=peak, times_s=times, median_s=statistics.median(times))


def main(argv=None):
    ap = command_parser("burstengine bench lce", __doc__)
    ap.add_argument("--vocab", type=int, nargs="+", default=[131072, 32768])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--methods", nargs="+", default=["naive", "compiled", "liger", "liger32", "burst", "burst16"])
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip the remaining sizes after this many seconds")
    ap.add_argument("--name", default="lce_bench")
    ap.add_argument("--out", default=None, help="folder for the JSON record (default $BURST_RESULTS or ./burst-results)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    t0 = time.time()
    payload = dict(args=vars(args), rows=[])
    own = None  # this run's record once written: rewritten after every row
    if args.check:
        impls = ["triton", "torch"] if device.type == "cuda" else ["torch"]
        payload["check"] = check(device, impls)
    fns = methods(args.methods)
    try:
        import importlib.metadata as md
        payload["liger_kernel"] = md.version("liger-kernel")
    except Exception:
        payload["liger_kernel"] = None
    g = torch.Generator(device="cpu").manual_seed(1)
    for V in args.vocab:
        w = (torch.randn(V, args.hidden, generator=g) * args.hidden ** -0.5).to(device, dtype).requires_grad_()
        for N in args.tokens:
            h = torch.randn(N, args.hidden, generator=g).to(device, dtype).requires_grad_()
            y = torch.randint(0, V, (N,), generator=g).to(device)
            for name, fn in fns.items():
                row = dict(vocab=V, tokens=N, hidden=args.hidden, method=name)
                if time.time() - t0 > args.budget_s:
                    row["skipped"] = "time budget"
                else:
                    try:
                        row.update(run_one(fn, h, w, y, device, args.warmup, args.iters))
                    except torch.OutOfMemoryError:
                        row["oom"] = True
                    except Exception as e:  # keep the table going; the row says what broke
                        row["error"] = repr(e)[:300]
                    h.grad = w.grad = None
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                payload["rows"].append(row)
                show(row)
                own = write_record(args.name, payload, args.out, path=own)
            del h, y
        del w
    summary(payload["rows"])
    path = write_record(args.name, payload, args.out, path=own)
    print(f"record: {path}  ({time.time() - t0:.0f} s)", flush=True)


def show(r):
    head = f"V={r['vocab']:>6d} N={r['tokens']:>6d} {r['method']:9s}"
    if "median_s" in r:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:7.2f} GiB"
        print(f"{head} {r['median_s'] * 1e3:9.1f} ms  peak {peak}  (first call {r['first_s']:.1f} s)", flush=True)
    else:
        print(f"{head} {'OOM' if r.get('oom') else r.get('skipped') or r.get('error')}", flush=True)


def summary(rows):
    """Time against Liger at the same dW precision (burst / liger32: float32 accumulator,
    burst16 / liger: bf16), and memory against naive."""
    by = {(r["vocab"], r["tokens"], r["method"]): r for r in rows}

    def get(V, N, m, key):
        return by.get((V, N, m), {}).get(key)

    def ratio(a, b):
        return f"{a / b:6.2f}x" if a and b else f"{'-':>7s}"

    print("\n vocab  tokens |  burst  liger32 burst16  liger  (ms) | liger32/burst liger/burst16 liger/burst |"
          " burst GiB naive GiB naive/burst")
    for (V, N) in sorted({(r["vocab"], r["tokens"]) for r in rows}):
        t = {m: get(V, N, m, "median_s") for m in ("burst", "liger32", "burst16", "liger")}
        ms = " ".join(f"{t[m] * 1e3:7.1f}" if t[m] else f"{'-':>7s}" for m in t)
        bg, ng = get(V, N, "burst", "peak_gib"), get(V, N, "naive", "peak_gib")
        nmem = f"{ng:9.2f}" if ng else f"{'OOM' if get(V, N, 'naive', 'oom') else '-':>9s}"
        print(f"{V:6d} {N:7d} | {ms}      | {ratio(t['liger32'], t['burst']):>13s} "
              f"{ratio(t['liger'], t['burst16']):>13s} {ratio(t['liger'], t['burst']):>11s} | "
              f"{bg if bg is not None else float('nan'):9.2f} {nmem} {ratio(ng, bg):>11s}")
    sys.stdout.flush()


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    rows = rec["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = keyed(rows, "vocab", "tokens", "method")
    shapes = sorted({(r["vocab"], r["tokens"]) for r in rows}, key=lambda s: (-s[0], s[1]))
    body = []
    for v, t in shapes:
        line = [f"{v} × {t}"]
        for m in methods:
            r = by.get((v, t, m))
            line.append(f"{ms(med(r['times_s']))} ms, {fixed(r['peak_gib'], 1)} GiB" if r and r.get("times_s") else "—")
        body.append(line)
    a = rec.get("args", {})
    out = [f"hidden {a.get('hidden')}, {a.get('dtype')}, forward + backward; median of the raw times, peak = most "
           "allocated beyond the inputs.", ""]
    out += table(["vocab × tokens"] + methods, body)
    chk = rec.get("check")
    if chk and chk.get("rows"):
        tol = chk.get("tol")
        tol = ", ".join(f"{k.replace('torch.', '')} {num(v)}" for k, v in tol.items()) if isinstance(tol, dict) else num(tol)
        out += [f"Check against float64 (tolerance {tol}; passed: {num(chk.get('passed'))}):", ""]
        out += table(["method", "dtype", "options", "loss error", "dh error", "dW error"],
                     [[r["method"], r["dtype"], r.get("opt", ""), num(r["loss"]), num(r["dh"]), num(r["dw"])]
                      for r in chk["rows"]])
    return out


SECTIONS = (Section("Fused LM head + cross-entropy", r"^lce_bench", render,
                    "`burstengine bench lce`: forward + backward time and peak memory against the peers."),)
