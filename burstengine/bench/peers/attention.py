"""`burstengine bench attention`: BurstAttention beside its peers, same GPUs, same launch.

    torchrun --nproc_per_node 4 -m burstengine bench attention --seqs 131072,524288 --mask both
    burstengine bench attention --device cpu          # a smoke run of the harness on 2 gloo ranks

Times forward (no grad) and forward+backward of one attention call, bf16, B=1, for every
method in --methods, at every total sequence in --seqs, prints a table (TFLOP/s per GPU,
ratio to torch-native CP with cuDNN, peak memory per GPU) and writes a JSON record with the
raw times.  --profile S also traces one fwd+bwd of BurstAttention at S with torch.profiler
and reports how much NCCL time no compute kernel covers (the exposed communication).  The
methods are entries of bench/peers/methods.py.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

import burstengine as be

from ...timing import median, timed
from ..harness import attn_flops, device_backend, ranked_bench
from ..launch import add_launch_arguments
from ..records import OUT_DIR_HELP, results_dir, write_record
from ..tables import Section, gib, med, memory, ms, num, rate, ratio, table
from ..usage import fill_device_defaults, kernel_error, missing_package
from . import peer_attention as peers
from .methods import METHODS as ALL_METHODS, method as lookup, unknown

# the methods of a GPU run unless --methods says otherwise (any SDPA backend of the peers runs too)
METHODS = ("burst-zigzag", "burst-striped", "burst-contiguous", "ringbwd-zigzag", "torch-cp-cudnn", "torch-cp-flash",
           "ulysses-cudnn", "megatron-tp-cudnn", "single-gpu-cudnn")
BASELINE = "torch-cp-cudnn"


def make_method(name, group, causal, kernel):
    """-> (fn(q, k, v) -> out, context manager factory or None) of the method ``name``."""
    m = lookup(name, "attention")
    if m.attention == "burst":
        return (lambda q, k, v: be.burst_attn_func(q, k, v, group=group, causal=causal, layout=m.layout,
                                                   backward=m.backward, kernel=kernel)), None
    if m.attention == "torch-cp":
        fn = peers.torch_cp(m.sdpa)
        return (lambda q, k, v: fn(q, k, v, causal)), peers.torch_cp_context
    if m.attention == "single-gpu":
        return (lambda q, k, v: peers.sdpa(q, k, v, causal, m.sdpa)), None
    fn = {"ulysses": peers.ulysses, "megatron-tp": peers.megatron_tp}[m.attention](group, m.sdpa)
    return (lambda q, k, v: fn(q, k, v, causal)), None


def _peak_reset(dev):
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak(dev):
    return torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0


def run_case(method, S, H, Hkv, D, causal, args, group):
    world = dist.get_world_size(group)
    fn, ctx_factory = make_method(method, group, causal, args.kernel)
    single = ALL_METHODS[method].attention == "single-gpu"
    if single:
        # one GPU doing the per-GPU work of the distributed call: S' = S / sqrt(G)
        S_run = max(1024, int(round(S / math.sqrt(world) / 1024)) * 1024)
        n = S_run
    else:
        S_run, n = S, S // world
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    q = torch.randn(1, n, H, D, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(1, n, Hkv, D, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(1, n, Hkv, D, device=dev, dtype=dtype, requires_grad=True)
    do = torch.randn(1, n, H, D, device=dev, dtype=dtype)
    ctx = ctx_factory(group, S, dev, causal) if ctx_factory else None
    rec = dict(method=method, S=S, S_run=S_run, H=H, Hkv=Hkv, D=D, causal=causal, world=world)
    try:
        if ctx:
            ctx.__enter__()

        def fwd():
            with torch.no_grad():
                fn(q, k, v)

        def fwdbwd():
            fn(q, k, v).backward(do)

        rec["fwd_s"] = timed(fwd, dev, group, args.warmup, args.iters)
        _peak_reset(dev)
        rec["fwdbwd_s"] = timed(fwdbwd, dev, group, args.warmup, args.iters)
        peak = torch.tensor([_peak(dev)], device=dev, dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        rec["peak_bytes"] = int(peak.item())
    finally:
        if ctx:
            ctx.__exit__(None, None, None)
    flops = attn_flops(1, S_run, S_run, H, D, 0.5 if causal else 1.0) / (1 if single else world)
    rec["fwd_tflops"] = flops / median(rec["fwd_s"]) / 1e12
    rec["fwdbwd_tflops"] = 3.5 * flops / median(rec["fwdbwd_s"]) / 1e12
    del q, k, v, do
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def exposed_comm(trace_path):
    """Per rank trace: total NCCL kernel time, and the part of it no compute kernel overlaps."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kern = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    nccl = sorted((e["ts"], e["ts"] + e["dur"]) for e in kern if "nccl" in e["name"].lower())
    comp = _union(sorted((e["ts"], e["ts"] + e["dur"]) for e in kern if "nccl" not in e["name"].lower()))
    nccl_u = _union(nccl)
    total = sum(b - a for a, b in nccl_u)
    covered = 0.0
    j = 0
    for a, b in nccl_u:
        for c, d in comp:
            lo, hi = max(a, c), min(b, d)
            if hi > lo:
                covered += hi - lo
    span = (max(b for _, b in comp + nccl_u) - min(a for a, _ in comp + nccl_u)) if kern else 0.0
    busy = sum(b - a for a, b in _union(sorted(comp + nccl_u)))
    return dict(nccl_us=total, exposed_us=total - covered, compute_us=sum(b - a for a, b in comp), span_us=span,
                idle_us=span - busy)


def _union(iv):
    out = []
    for a, b in iv:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def profile_step(S, H, Hkv, D, causal, layout, backward, kernel, group, out_dir):
    from torch.profiler import ProfilerActivity, profile  # only with --profile

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = S // world
    q, k, v, do = (torch.randn(1, n, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=i < 3)
                   for i, h in enumerate((H, Hkv, Hkv, H)))
    step = lambda: be.burst_attn_func(q, k, v, group=group, causal=causal, layout=layout, backward=backward,
                                      kernel=kernel).backward(do)
    step()
    torch.cuda.synchronize()
    dist.barrier(group=group)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    path = os.path.join(out_dir, f"trace_{backward}_{S // 1024}k_rank{rank}.json")
    prof.export_chrome_trace(path)
    stats = exposed_comm(path)
    t = torch.tensor([stats["exposed_us"], stats["nccl_us"], stats["span_us"]], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if rank != 0:
        os.remove(path)  # one trace is enough to look at; all ranks' figures are reduced above
    return dict(S=S, causal=causal, layout=layout, backward=backward, exposed_ms=t[0].item() / 1e3,
                nccl_ms=t[1].item() / 1e3, step_ms=t[2].item() / 1e3, rank0=stats)


def print_table(rows, file=None):
    file = file or sys.stdout  # per call, not bound at import
    key = lambda r: (r["world"], r["S"], r["causal"], r["Hkv"])
    base = {key(r): r for r in rows if r["method"] == BASELINE and "fwdbwd_tflops" in r}
    hdr = f"{'method':20s} {'G':>2s} {'S':>8s} {'mask':6s} {'kvH':>4s} {'fwd FLOP/s':>11s} {'f+b FLOP/s':>11s} " \
          f"{'f+b ms':>9s} {'vs CP':>6s} {'peak':>9s}"
    print(hdr, file=file)
    print("-" * len(hdr), file=file)
    for r in rows:
        if "error" in r:
            print(f"{r['method']:20s} {r['world']:>2d} {r['S']:>8d} {'causal' if r['causal'] else 'full':6s} "
                  f"{r['Hkv']:>4d} {r['error'][:60]}", file=file)
            continue
        b = base.get(key(r))
        vs_cp = f"{r['fwdbwd_tflops'] / b['fwdbwd_tflops']:6.3f}" if b else "   -  "
        print(f"{r['method']:20s} {r['world']:>2d} {r['S']:>8d} {'causal' if r['causal'] else 'full':6s} "
              f"{r['Hkv']:>4d} {rate(r['fwd_tflops'] * 1e12):>11s} {rate(r['fwdbwd_tflops'] * 1e12):>11s} "
              f"{median(r['fwdbwd_s']) * 1e3:9.1f} {vs_cp} {memory(r['peak_bytes']):>9s}", file=file)


def plot(json_path, out_png):
    import matplotlib  # optional dependency: only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency: only for the plot

    recs = json.load(open(json_path))
    recs = recs if isinstance(recs, list) else [recs]
    rows = [r for rec in recs for r in rec["rows"] if "fwdbwd_tflops" in r]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (m, causal), grp in sorted(_group(rows, lambda r: (r["method"], r["causal"])).items()):
        grp = sorted(grp, key=lambda r: (r["world"], r["S"]))
        xs = [f"{r['world']}x{r['S'] // 1024}K" for r in grp]
        ax.plot(xs, [r["fwdbwd_tflops"] for r in grp], marker="o", label=f"{m} {'causal' if causal else 'full'}")
    ax.set_ylabel("fwd+bwd TFLOP/s per GPU")
    ax.set_xlabel("GPUs x total sequence")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_png, dpi=120)
    return out_png


def _group(rows, key):
    out = {}
    for r in rows:
        out.setdefault(key(r), []).append(r)
    return out


# --device cpu: sizes a laptop finishes in well under a minute, and the methods that run on CPU
CPU_DEFAULTS = dict(seqs="1024", heads=4, head_dim=32, iters=3, warmup=1,
                    methods="burst-zigzag,burst-striped,burst-contiguous,ringbwd-zigzag,ulysses-math,"
                            "megatron-tp-math,single-gpu-math")
GPU_DEFAULTS = dict(seqs="131072,524288", heads=32, head_dim=128, iters=5, warmup=2,
                    methods=",".join(METHODS))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seqs", default=None, help="total sequence lengths, comma-separated "
                                                f"[cuda: {GPU_DEFAULTS['seqs']}, cpu: {CPU_DEFAULTS['seqs']}]")
    p.add_argument("--mask", choices=("causal", "full", "both"), default="both")
    p.add_argument("--heads", type=int, default=None, help="[cuda: 32, cpu: 4]")
    p.add_argument("--kv-heads", default=None, help="comma-separated kv head counts (e.g. 32,8 for a GQA case) "
                                                    "[= --heads]")
    p.add_argument("--head-dim", type=int, default=None, help="[cuda: 128, cpu: 32]")
    p.add_argument("--methods", default=None, help=f"[cuda: all of {', '.join(METHODS)}; cpu: "
                                                   f"{CPU_DEFAULTS['methods']}]")
    p.add_argument("--kernel", default=None, help="local kernel for BurstAttention (default: auto, i.e. cuDNN on GPUs)")
    p.add_argument("--warmup", type=int, default=None, help="[cuda: 2, cpu: 1]")
    p.add_argument("--iters", type=int, default=None, help="[cuda: 5, cpu: 3]")
    p.add_argument("--profile", type=int, default=0, help="also trace one fwd+bwd at this total sequence (GPUs)")
    p.add_argument("--name", default=None, help="record name (default attention_<world>gpu or _<world>cpu)")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--plot", default=None, help="draw the scaling plot from this JSON record and exit")
    p.add_argument("--worlds", default="", help="comma-separated world sizes to run on sub-groups of the launch "
                                                  "(default: the launch's world only)")
    p.add_argument("--skip", default="", help="method@S pairs to skip, e.g. torch-cp-flash@524288")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cpu: a smoke run of the harness on gloo ranks (float32, tiny sizes, methods that run on "
                        "CPU: burst-*, ringbwd-*, *-math peers); figures from it mean nothing [cuda when available]")
    add_launch_arguments(p)


def _fill_defaults(args):
    fill_device_defaults(args, CPU_DEFAULTS, GPU_DEFAULTS)
    if args.kv_heads is None:
        args.kv_heads = str(args.heads)


def _ints(text: str, what: str) -> list[int]:
    try:
        xs = [int(x) for x in text.split(",") if x]
    except ValueError:
        raise ValueError(f"{what} takes comma-separated integers, got {text!r}") from None
    if not xs or min(xs) < 1:
        raise ValueError(f"{what} takes positive integers, got {text!r}")
    return xs


def validate(args) -> str | None:
    """One line for arguments that cannot work (checked before any rank starts), else None."""
    if args.device == "cuda" and not torch.cuda.is_available():
        return ("--device cuda needs CUDA GPUs (run it under torchrun on a GPU node; --device cpu smoke-tests "
                "the harness)")
    methods = [m for m in args.methods.split(",") if m]
    bad = unknown("attention", methods)
    if bad:
        return f"unknown method(s) {bad}; known: {', '.join(METHODS)} (and -math/-flash variants of the peers)"
    if args.device == "cpu":
        gpu_only = [m for m in methods if ALL_METHODS[m].cuda_only]
        if gpu_only:
            return f"method(s) {gpu_only} need CUDA; on CPU use burst-*, ringbwd-* and the *-math peers"
        if args.profile:
            return "--profile traces CUDA kernels: it needs --device cuda"
    try:
        seqs = _ints(args.seqs, "--seqs")
        kv_heads = _ints(args.kv_heads, "--kv-heads")
        worlds = _ints(args.worlds, "--worlds") if args.worlds else [args.world]
    except ValueError as e:
        return str(e)
    if min(args.heads, args.head_dim, args.iters) < 1 or args.warmup < 0:
        return "--heads, --head-dim and --iters must be >= 1, --warmup >= 0"
    bad = [h for h in kv_heads if args.heads % h]
    if bad:
        return f"--heads ({args.heads}) must be a multiple of every --kv-heads, not of {bad}"
    if max(worlds) > args.world:
        return f"--worlds {args.worlds}: each must be between 1 and the launch's {args.world} ranks"
    chunks = 2 if any(ALL_METHODS[m].layout == "zigzag" for m in methods) else 1
    for w in worlds:
        for S in seqs:
            if S % (chunks * w):
                return f"--seqs: {S} tokens do not split into {chunks * w} equal chunks (world {w})"

    return kernel_error(args.kernel, args.device, backward=True)  # it times the backward too


def run_rank(args) -> int:
    """The benchmark on this rank of an initialised default group."""
    rank, world = dist.get_rank(), dist.get_world_size()
    methods = [m for m in args.methods.split(",") if m]
    worlds = sorted({int(w) for w in args.worlds.split(",")}) if args.worlds else [world]
    # sub-groups over the lowest ranks, made by every rank in the same order
    groups = {w: (None if w == world else dist.new_group(list(range(w)))) for w in worlds}
    out_dir = results_dir(args.out_dir)
    skip = set(args.skip.split(",")) if args.skip else set()
    masks = {"causal": [True], "full": [False], "both": [True, False]}[args.mask]
    rows, t0 = [], time.time()
    unit = "gpu" if args.device == "cuda" else "cpu"
    name = args.name or f"attention_{world}{unit}"
    record_args = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    prof = []
    payload = dict(world=world, args=record_args, rows=rows, profile=prof)
    path = None  # the first write picks a free name; later rows rewrite that file (a timeout keeps the rows done)
    cases = [(w, S, c, hkv) for w in worlds for S in map(int, args.seqs.split(",")) for c in masks
             for hkv in map(int, args.kv_heads.split(","))]
    for i, (w, S, causal, hkv) in enumerate(cases):
        group = groups[w]
        if rank >= w:
            continue
        for m in methods:
            if f"{m}@{S}" in skip or (w == 1 and ALL_METHODS[m].attention == "single-gpu"):
                continue
            try:
                r = run_case(m, S, args.heads, hkv, args.head_dim, causal, args, group)
            except torch.OutOfMemoryError as e:
                # an OOM is reported, not fatal: every rank allocates the same, so all ranks land here
                if args.device == "cuda":
                    torch.cuda.empty_cache()
                r = dict(method=m, S=S, H=args.heads, Hkv=hkv, D=args.head_dim, causal=causal, world=w,
                         error=f"OOM: {str(e).splitlines()[0]}")
            rows.append(r)
            if rank == 0:
                msg = r.get("error") or (f"fwd {rate(r['fwd_tflops'] * 1e12)}, fwd+bwd {rate(r['fwdbwd_tflops'] * 1e12)}, "
                                         f"peak {memory(r['peak_bytes'])}")
                print(f"[{time.time() - t0:6.0f}s] case {i + 1}/{len(cases)} world={w} S={S} "
                      f"{'causal' if causal else 'full'} kvH={hkv} {m}: {msg}", flush=True)
                path = write_record(name, payload, out_dir, path=path)
    dist.barrier()
    group = None
    if args.profile:
        os.makedirs(out_dir, exist_ok=True)
        for backward in ("burst", "ring"):
            prof.append(profile_step(args.profile, args.heads, args.heads, args.head_dim, True, "zigzag", backward,
                                     args.kernel, group, out_dir))
            if rank == 0:
                p = prof[-1]
                print(f"profile S={p['S']} causal zigzag {backward}: step {p['step_ms']:.1f} ms, NCCL {p['nccl_ms']:.1f} ms, "
                      f"exposed {p['exposed_ms']:.2f} ms", flush=True)
    if rank == 0:
        print_table(rows)
        path = write_record(name, payload, out_dir, path=path)
        print(f"wrote {path}")
    return 0


def _prepare(args) -> int | None:
    """--plot draws the plot of a record and ends the command; otherwise the device's defaults."""
    if not args.plot:
        _fill_defaults(args)
        return None
    msg = missing_package("matplotlib", "--plot") or (
        None if os.path.isfile(args.plot) else f"--plot {args.plot!r} does not exist")
    if msg:
        print(f"burstengine bench attention: error: {msg}", file=sys.stderr)
        return 2
    print(plot(args.plot, os.path.splitext(args.plot)[0] + ".png"))
    return 0


build_parser, main = ranked_bench("attention", __doc__, add_arguments, run_rank, validate, prepare=_prepare,
                                  backend=device_backend)


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    rows = rec["rows"]
    out = []
    base_of = {}
    for r in rows:
        key = (r["S"], r["Hkv"], r["causal"])
        m = ALL_METHODS.get(r["method"])
        if m is not None and (m.attention, m.backward) == ("burst", "burst") and key not in base_of:
            base_of[key] = r
    body = []
    for r in rows:
        base = base_of.get((r["S"], r["Hkv"], r["causal"]))
        comparable = base is not None and base is not r and base["S_run"] == r["S_run"]
        body.append([r["method"], r["S"], r["S_run"], f"{r['H']}/{r['Hkv']}", "causal" if r["causal"] else "full",
                     ms(med(r["fwd_s"])), ms(med(r["fwdbwd_s"])), num(r.get("fwd_tflops"), 4),
                     num(r.get("fwdbwd_tflops"), 4), gib(r.get("peak_bytes")),
                     ratio(med(r["fwdbwd_s"]), med(base["fwdbwd_s"])) if comparable else "—"])
    out += table(["method", "S", "S run", "H/Hkv", "mask", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s/GPU",
                  "fwd+bwd TFLOP/s/GPU", "peak GiB", "fwd+bwd time ÷ burst's"], body)
    out.append("Times are medians of the record's raw times; \"÷ burst's\" divides by the first `burst-*` row of "
               "the same S, KV heads and mask (only where the per-GPU work, S run, is the same).")
    out.append("")
    if rec.get("profile"):
        out += table(["S", "layout", "backward", "step ms", "NCCL ms", "exposed ms"],
                     [[p["S"], p["layout"], p["backward"], num(p["step_ms"], 5), num(p["nccl_ms"], 4),
                       num(p["exposed_ms"], 3)] for p in rec["profile"]])
    return out


SECTIONS = (Section("Attention on 1-2 GPUs beside the peers", r"^attention_", render,
                    "`burstengine bench attention`: BurstAttention against torch's context parallelism, Ulysses and "
                    "one GPU."),)
