"""Sparse BurstAttention against its dense baseline: sliding windows and packed documents.

    # 4 GPUs, the issue's cases (bf16, H=32, d=128): SWA 4K and 32K at 1M vs causal at 1M,
    # packed documents of mixed lengths at 512K vs one causal document at 512K
    torchrun --nproc_per_node 4 -m burstengine bench sparse

    # CPU: 2 gloo ranks at a small size (no torchrun needed)
    burstengine bench sparse --device cpu

Every case times forward (no grad) and forward+backward of one burst_attn_func call on every
rank (median of --iters after --warmup, CUDA events on GPUs), and reports:

* speedup: the dense baseline's fwd+bwd time over the case's (causal at the same length for
  the windows, one causal document for the packed documents);
* ideal: the ratio of visible (query, key) pairs, baseline over case, i.e. the speedup of a
  perfect implementation; efficiency = speedup / ideal;
* balance: max / mean over ranks of each rank's compute time alone (its tasks at every step
  that runs, replayed without communication), beside the schedule's ideal (max / mean of the
  visible pairs per rank); and the measured wall time per rank;
* the steps the ring ran and the bytes each rank sent (comm_stats), beside the byte model's
  count for that rank and what whole shards would have cost (the ring sends only the rows
  later steps read, so a short window moves a thin tail of each shard).

``--check`` also runs every case once at a small length (--check-seq) with the chosen kernel
and with the reference kernel (float32, dense masks) and reports the normwise error of out,
dq, dk, dv between them: the GPU check of the sparse path of the SDPA kernels.
A JSON record (command, commit, devices, versions, raw times) goes to --out-dir ($BURST_RESULTS or ./burst-results).
"""
from __future__ import annotations

import argparse
import math
import random
import sys
import time

import torch
import torch.distributed as dist

import burstengine as be

from ...attention.call import AttnCall, MaskArgs
from ...attention.checks import check_mask
from ...attention.planning import plan_call
from ...kernels import get_kernel
from ...layout import LAYOUTS
from ...schedule import (attention_flops, backward_bytes, block_tasks, forward_bytes, ring_source, run_steps,
                         visible_pairs)
from ...testing import fro_err
from ...timing import median
from ..harness import device_backend, ranked_bench
from ..launch import add_launch_arguments
from ..records import OUT_DIR_HELP, write_record
from ..tables import MIB, Section, fixed, ms, num, rate, table
from ..usage import fill_device_defaults, kernel_error


def mixed_documents(seq_len: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """cu_seqlens of documents with log-uniform lengths in [lo, hi] filling ``seq_len`` tokens."""
    rnd = random.Random(seed)
    cu = [0]
    while cu[-1] < seq_len:
        L = int(round(math.exp(rnd.uniform(math.log(lo), math.log(hi)))))
        cu.append(min(seq_len, cu[-1] + max(1, L)))
    return cu


def cases(args) -> list[dict]:
    """(name, group, global length, layout, mask kwargs); the first case of a group is its baseline."""
    out = []
    if "window" in args.cases:
        out.append(dict(name="causal", group="window", S=args.seq, layout=args.causal_layout, mask={}))
        for W in args.windows:
            for layout in args.window_layouts:
                out.append(dict(name=f"swa-{W}", group="window", S=args.seq, layout=layout, mask=dict(window=W)))
    if "docs" in args.cases:
        lo, hi = args.doc_lengths
        cu = mixed_documents(args.doc_seq, lo, hi, args.seed)
        out.append(dict(name="one-doc", group="docs", S=args.doc_seq, layout=args.causal_layout, mask={}))
        for layout in args.doc_layouts:
            out.append(dict(name=f"docs-{len(cu) - 1}", group="docs", S=args.doc_seq, layout=layout,
                            mask=dict(cu_seqlens=cu)))
    return out


class _Clock:
    """Seconds of one call on this rank: CUDA events on GPUs, the host clock on CPUs."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def start(self):
        if self.cuda:
            self._a, self._b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._a.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self._t0
        self._b.record()
        torch.cuda.synchronize()
        return self._a.elapsed_time(self._b) / 1e3


def local_times(fn, warmup, iters, group, device):
    """This rank's own time of every timed call (not reduced over ranks: the balance needs them);
    all ranks start each call together."""
    clock = _Clock(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        clock.sync()
        dist.barrier(group=group)
        clock.start()
        fn()
        times.append(clock.stop())
    return times


def _gather(x, group, device):
    """Every rank's list of floats (same length on all ranks), rank-major."""
    t = torch.tensor(x, dtype=torch.float64, device=device)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t, group=group)
    return [p.tolist() for p in parts]


def compute_only(q, k, v, do, layout, pattern, kernel, scale, group):
    """This rank's attention work alone: its forward tasks and burst-backward tasks at every step
    that runs, on its own tensors (the shapes and tasks of the real call, no communication)."""
    G, r = dist.get_world_size(group), dist.get_rank(group)
    n = q.shape[1]
    steps = run_steps(layout, pattern, G, n)
    B, _, H, D = q.shape
    lse = torch.full((B, H, n), float("-inf"), device=q.device)
    delta = torch.randn(B, H, n, device=q.device)

    def fwd():
        out = torch.zeros(B, n, H, D, device=q.device)
        lse.fill_(float("-inf"))
        for s in steps:
            for t in block_tasks(layout, pattern, r, ring_source(r, s, G), G, n):
                kernel.forward_into(q[:, t.q0:t.q1], k[:, t.k0:t.k1], v[:, t.k0:t.k1], scale, t.mask,
                                    out[:, t.q0:t.q1], lse[:, :, t.q0:t.q1])

    def bwd():
        dq = torch.zeros(q.shape, device=q.device)
        dk = torch.zeros(k.shape, device=q.device)
        dv = torch.zeros(v.shape, device=q.device)
        lse_ = torch.where(torch.isinf(lse), 0.0, lse)
        for s in steps:
            for t in block_tasks(layout, pattern, ring_source(r, s, G, -1), r, G, n):
                qs, ks = slice(t.q0, t.q1), slice(t.k0, t.k1)
                kernel.backward_into(do[:, qs], q[:, qs], k[:, ks], v[:, ks], lse_[:, :, qs], delta[:, :, qs], scale,
                                     t.mask, dq[:, qs], dk[:, ks], dv[:, ks])

    return fwd, bwd


def run_case(case, args, group, device, dtype):
    G, rank = dist.get_world_size(group), dist.get_rank(group)
    S, layout, H, Hkv, D, B = case["S"], case["layout"], args.heads, args.kv_heads, args.head_dim, args.batch
    n = S // G
    mask = case["mask"]
    pattern = check_mask(MaskArgs(causal=True, window=mask.get("window"), cu_seqlens=mask.get("cu_seqlens")), layout, G, n)
    kw = dict(group=group, causal=True, layout=layout, backward=args.backward, kernel=args.kernel, **mask)
    g = torch.Generator(device=device).manual_seed(args.seed * 1000 + rank)
    q, k, v = (torch.randn(B, n, h, D, device=device, dtype=dtype, generator=g).requires_grad_()
               for h in (H, Hkv, Hkv))
    do = torch.randn(B, n, H, D, device=device, dtype=dtype, generator=g)
    def timer(fn, warmup, iters, group):
        return local_times(fn, warmup, iters, group, device)

    def fwd():
        with torch.no_grad():
            be.burst_attn_func(q, k, v, **kw)

    def fwdbwd():
        be.burst_attn_func(q, k, v, **kw).backward(do)

    with be.comm_stats() as st:
        fwdbwd()
    fwd_t = timer(fwd, args.warmup, args.iters, group)
    fwdbwd_t = timer(fwdbwd, args.warmup, args.iters, group)
    kernel = get_kernel(args.kernel, device)
    with torch.no_grad():
        cf, cb = compute_only(q.detach(), k.detach(), v.detach(), do, layout, pattern, kernel, 1 / math.sqrt(D), group)
        comp_f = timer(cf, args.warmup, args.iters, group)
        comp_b = timer(cb, args.warmup, args.iters, group)
    per_rank = _gather([median(fwd_t), median(fwdbwd_t), median(comp_f), median(comp_b), st.forward_bytes,
                        st.backward_bytes], group, device)
    model = byte_model(q, k, group, layout, pattern, args.backward)
    raw = _gather(fwd_t + fwdbwd_t, group, device)
    flops = attention_flops(layout, pattern, G, n, B, H, D, backward=True)
    # the slowest rank sets the pace of each iteration
    it = args.iters
    step_fwd = [max(r[i] for r in raw) for i in range(it)]
    step_fb = [max(r[it + i] for r in raw) for i in range(it)]
    comp = [r[2] + r[3] for r in per_rank]
    rec = dict(
        name=case["name"], group=case["group"], S=S, layout=layout, world=G, B=B, H=H, Hkv=Hkv, D=D,
        window=mask.get("window"), documents=len(mask["cu_seqlens"]) - 1 if "cu_seqlens" in mask else 1,
        steps=len(run_steps(layout, pattern, G, n)), visible_pairs=visible_pairs(S, pattern),
        fwd_s=median(step_fwd), fwdbwd_s=median(step_fb),
        fwdbwd_tflops=sum(flops) / G / median(step_fb) / 1e12,
        balance=max(comp) / (sum(comp) / G), ideal_balance=max(flops) / (sum(flops) / G),
        wall_balance=max(r[1] for r in per_rank) / (sum(r[1] for r in per_rank) / G),
        per_rank=[dict(fwd_s=r[0], fwdbwd_s=r[1], compute_fwd_s=r[2], compute_bwd_s=r[3], fwd_bytes=int(r[4]),
                       bwd_bytes=int(r[5]), **m) for r, m in zip(per_rank, model["per_rank"])],
        backward=model["backward"], whole_shard_bytes=model["whole_shard_bytes"],
        raw_fwd_s=[r[:it] for r in raw], raw_fwdbwd_s=[r[it:] for r in raw],
    )
    if "cu_seqlens" in mask:
        rec["cu_seqlens"] = mask["cu_seqlens"]
    del q, k, v, do
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rec


def byte_model(q, k, group, layout, pattern, backward) -> dict:
    """What the byte model says each rank sends in one fwd+bwd call (the call's own ring and
    backward scheme), and what one rank would send if whole shards travelled."""
    G = dist.get_world_size(group)
    B, n, H, D = q.shape
    Hkv, e = k.shape[2], q.element_size()
    plan = plan_call(q, k, AttnCall(group=group, layout=layout, backward=backward), G, pattern)
    ring, scheme = plan.ring(group), plan.backward
    hops = len(ring.steps) - 1
    trim = {} if ring.double else dict(layout=layout, mask=pattern)
    per_rank = [dict(model_fwd_bytes=forward_bytes(B, n, Hkv, D, e, G, hops, rank=r, **trim),
                     model_bwd_bytes=backward_bytes(scheme, B, n, H, Hkv, D, e, G, hops, rank=r, **trim))
                for r in range(G)]
    whole = forward_bytes(B, n, Hkv, D, e, G, hops) + backward_bytes(scheme, B, n, H, Hkv, D, e, G, hops)
    return dict(backward=scheme, per_rank=per_rank, whole_shard_bytes=whole)


def check_case(case, args, group, device, dtype):
    """Normwise error of the chosen kernel against the reference kernel on this case's mask at
    --check-seq tokens (window and documents scaled down with the length)."""
    G, rank = dist.get_world_size(group), dist.get_rank(group)
    S = args.check_seq
    scale = S / case["S"]
    mask = dict(case["mask"])
    if "window" in mask:
        mask["window"] = max(1, min(mask["window"], S // 4))
    if "cu_seqlens" in mask:
        lo, hi = args.doc_lengths
        mask["cu_seqlens"] = mixed_documents(S, max(1, int(lo * scale)), max(2, int(hi * scale)), args.seed)
    n = S // G
    g = torch.Generator(device=device).manual_seed(args.seed + rank)
    H, Hkv, D = args.heads, args.kv_heads, args.head_dim
    q, k, v, do = (torch.randn(1, n, h, D, device=device, dtype=dtype, generator=g) for h in (H, Hkv, Hkv, H))
    res = {}
    for kern in (args.kernel, "reference"):
        ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
        out = be.burst_attn_func(ql, kl, vl, group=group, causal=True, layout=case["layout"], backward=args.backward,
                                 kernel=kern, **mask)
        out.backward(do)
        res[kern] = (out.detach(), ql.grad, kl.grad, vl.grad)
    errs = [fro_err(a, b) for a, b in zip(res[args.kernel], res["reference"])]
    return max(_gather([max(errs)], group, device))[0]


def print_table(rows, file=None):
    file = file or sys.stdout  # per call, not bound at import
    base = {r["group"]: r for r in rows if r["name"] in ("causal", "one-doc")}
    hdr = (f"{'case':12s} {'layout':10s} {'S':>8s} {'steps':>5s} {'fwd ms':>9s} {'f+b ms':>9s} {'FLOP/s':>10s} "
           f"{'speedup':>7s} {'ideal':>7s} {'eff':>5s} {'balance':>7s} {'ideal':>6s} {'MB sent':>8s} {'whole':>8s}")
    print(hdr, file=file)
    print("-" * len(hdr), file=file)
    for r in rows:
        b = base.get(r["group"])
        sp = b["fwdbwd_s"] / r["fwdbwd_s"] if b else float("nan")
        ideal = b["visible_pairs"] / r["visible_pairs"] if b else float("nan")
        r["speedup"], r["ideal_speedup"] = sp, ideal
        sent = max(p["fwd_bytes"] + p["bwd_bytes"] for p in r["per_rank"]) / 2**20
        print(f"{r['name']:12s} {r['layout']:10s} {r['S']:>8d} {r['steps']:>2d}/{r['world']:<2d} {r['fwd_s'] * 1e3:9.1f} "
              f"{r['fwdbwd_s'] * 1e3:9.1f} {rate(r['fwdbwd_tflops'] * 1e12):>10s} {sp:7.2f} {ideal:7.2f} {sp / ideal:5.2f} "
              f"{r['balance']:7.3f} {r['ideal_balance']:6.3f} {sent:8.1f} {r['whole_shard_bytes'] / 2**20:8.1f}",
              file=file)


def _ints(s):
    return [int(x) for x in s.split(",") if x]


# --device cpu: sizes that finish in well under a minute on 2 cores
CPU_DEFAULTS = dict(seq=2048, windows=[64, 256], doc_seq=1024, doc_lengths=[16, 256], heads=2, head_dim=16,
                    warmup=1, iters=2, check_seq=256)
GPU_DEFAULTS = dict(seq=1 << 20, windows=[4096, 32768], doc_seq=1 << 19, doc_lengths=[1024, 65536], heads=32,
                    head_dim=128, warmup=2, iters=5, check_seq=16384)


def _d(key):
    def f(v):
        return ",".join(map(str, v)) if isinstance(v, list) else str(v)

    return f"[cuda: {f(GPU_DEFAULTS[key])}, cpu: {f(CPU_DEFAULTS[key])}]"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda: NCCL, bf16; cpu: gloo, float32 [cuda when available]")
    p.add_argument("--cases", default="window,docs", help="window and/or docs [%(default)s]")
    p.add_argument("--seq", type=int, default=None, help="global length of the window cases " + _d("seq"))
    p.add_argument("--windows", type=_ints, default=None, help="window sizes " + _d("windows"))
    p.add_argument("--window-layouts", default="contiguous", help="layouts for the windows [%(default)s]")
    p.add_argument("--doc-seq", type=int, default=None, help="global length of the document cases " + _d("doc_seq"))
    p.add_argument("--doc-lengths", type=_ints, default=None,
                   help="document lengths are log-uniform in [lo,hi] " + _d("doc_lengths"))
    p.add_argument("--doc-layouts", default="striped,contiguous", help="layouts for the documents [%(default)s]")
    p.add_argument("--causal-layout", default="zigzag", help="layout of the causal baselines [%(default)s]")
    p.add_argument("--heads", type=int, default=None, help=_d("heads"))
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=None, help=_d("head_dim"))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--backward", default="burst", choices=("burst", "ring", "auto"))
    p.add_argument("--kernel", default=None, help="local kernel (default: BURST_KERNEL or auto)")
    p.add_argument("--warmup", type=int, default=None, help=_d("warmup"))
    p.add_argument("--iters", type=int, default=None, help=_d("iters"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="also check each case against the reference kernel")
    p.add_argument("--check-seq", type=int, default=None, help="global length of the --check runs " + _d("check_seq"))
    p.add_argument("--name", default=None, help="record name (default sparse_<world><device>)")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    add_launch_arguments(p)


def _fill_defaults(args):
    fill_device_defaults(args, CPU_DEFAULTS, GPU_DEFAULTS)
    args.kv_heads = args.kv_heads or args.heads
    for key in ("cases", "window_layouts", "doc_layouts"):
        if isinstance(getattr(args, key), str):
            setattr(args, key, getattr(args, key).split(","))
    return args


def validate(args) -> str | None:
    """One line for arguments that cannot work (before any rank starts), else None."""
    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda needs GPUs; use --device cpu for a gloo run"
    if len(args.doc_lengths) != 2 or not 1 <= args.doc_lengths[0] <= args.doc_lengths[1]:
        return f"--doc-lengths takes lo,hi with 1 <= lo <= hi, got {args.doc_lengths}"
    bad = [c for c in args.cases if c not in ("window", "docs")]
    if bad:
        return f"--cases: unknown {bad}; known: window, docs"

    for key in ("window_layouts", "doc_layouts"):
        bad = [x for x in getattr(args, key) if x not in LAYOUTS]
        if bad:
            return f"--{key.replace('_', '-')}: unknown layout(s) {bad}; known: {', '.join(LAYOUTS)}"
    if args.causal_layout not in LAYOUTS:
        return f"--causal-layout: unknown layout {args.causal_layout!r}; known: {', '.join(LAYOUTS)}"
    if min(args.heads, args.kv_heads, args.head_dim, args.batch, args.iters, *args.windows) < 1 or args.warmup < 0:
        return "--heads, --kv-heads, --head-dim, --batch, --iters and --windows must be >= 1, --warmup >= 0"
    if args.heads % args.kv_heads:
        return f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})"
    for name in ("seq", "doc_seq", "check_seq"):
        S = getattr(args, name)
        if S < 1 or S % (2 * args.world):
            return f"--{name.replace('_', '-')} {S} must be a positive multiple of 2 x {args.world} ranks"

    return kernel_error(args.kernel, args.device, backward=True)  # it times the backward too


def run(group, argv=None) -> dict:
    """The benchmark with these arguments on an initialised process group; returns the record
    (rank 0 writes it)."""
    return _run(group, _fill_defaults(build_parser().parse_args(argv)))


def _run(group, args) -> dict:
    rank, G = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.kernel is None and args.device == "cpu":
        args.kernel = "reference"
    rows, t0 = [], time.time()
    todo = cases(args)
    for i, case in enumerate(todo):
        r = run_case(case, args, group, device, dtype)
        if args.check and case["mask"]:
            r["check_err"] = check_case(case, args, group, device, dtype)
        rows.append(r)
        if rank == 0:
            extra = f", check err {r['check_err']:.2e}" if "check_err" in r else ""
            print(f"[{time.time() - t0:6.0f}s] {i + 1}/{len(todo)} {r['name']} {r['layout']} S={r['S']}: "
                  f"fwd+bwd {r['fwdbwd_s'] * 1e3:.1f} ms, balance {r['balance']:.3f}{extra}", flush=True)
    payload = dict(world=G, device=args.device, args={k: v for k, v in vars(args).items()}, rows=rows)
    if rank == 0:
        print_table(rows)
        path = write_record(args.name or f"sparse_{G}{'gpu' if args.device == 'cuda' else 'cpu'}", payload,
                            args.out_dir)
        print(f"wrote {path}", flush=True)
        payload["path"] = path
    return payload


def run_rank(args) -> int:
    _run(None, args)
    return 0


build_parser, main = ranked_bench("sparse", __doc__, add_arguments, run_rank, validate, prepare=_fill_defaults,
                                  backend=device_backend)


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    base = {}
    for r in rec["rows"]:
        base.setdefault(r["group"], r)
    body = []
    for r in rec["rows"]:
        b = base[r["group"]]
        speed = b["fwdbwd_s"] / r["fwdbwd_s"]
        ideal = b["visible_pairs"] / r["visible_pairs"]
        sent = max(p["fwd_bytes"] + p["bwd_bytes"] for p in r["per_rank"]) if r.get("per_rank") else None
        body.append([r["name"], r["layout"], r.get("window") or "—", r.get("documents", "—"), r["steps"],
                     ms(r["fwdbwd_s"]), fixed(speed), fixed(ideal), fixed(speed / ideal) if r is not b else "",
                     fixed(r["balance"], 3), "—" if sent is None else f"{sent / MIB:.0f}",
                     "—" if r.get("whole_shard_bytes") is None else f"{r['whole_shard_bytes'] / MIB:.0f}",
                     num(r.get("check_err"))])
    a = rec.get("args", {})
    head = [f"S={a.get('seq')}, H={a.get('heads')}, Hkv={a.get('kv_heads') or a.get('heads')}, "
            f"d={a.get('head_dim')}, world {rec.get('world')}. Speedup: the fwd+bwd time (slowest rank's median) of "
            "the first row of the group (causal; one document) ÷ this row's; ideal: the ratio of visible pairs; "
            "balance: the slowest rank's compute time ÷ the mean over ranks.", ""]
    return head + table(["case", "layout", "window", "documents", "steps run", "fwd+bwd ms", "speedup",
                         "ideal", "efficiency", "balance", "MiB sent per rank", "whole shards MiB",
                         "error vs reference"], body)


SECTIONS = (Section("Sparse masks", r"^sparse_", render,
                    "`burstengine bench sparse`: sliding windows and packed documents against their causal baseline."),)
