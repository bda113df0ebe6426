"""`burstengine demo`: BurstAttention forward + backward on CPU ranks, checked and measured.

Starts ``--world`` gloo processes on this machine (or, under torchrun, uses the ranks torchrun
started), gives every rank its shard of one random global q, k, v, dO (fixed seed, float32),
and runs burst_attn_func forward and backward with both backward schemes ("burst": Q, dO, lse,
D, dQ travel; "ring": K, V, dK, dV travel).  Every rank times its calls, counts the bytes it
sends, and compares its shard of out, dq, dk, dv with a float64 reference computed on the full
sequence (split into row chunks, shared out among the ranks).  Rank 0 prints the table.  Exits
1 if any error exceeds --tol or the bytes sent differ from the byte model.

``burstengine demo finetune`` is the other demo: a tiny model's context extended from 256 to 2K
tokens by RoPE scaling and fine-tuning, exported and evaluated in transformers
(burstengine/cli/finetune_demo.py; ``burstengine demo finetune --help``).
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import burstengine as be

from ..bench.harness import RankLog
from ..bench.launch import run_command
from ..bench.records import write_record
from ..bench.tables import Section, fixed, num, table
from ..bench.usage import HelpFormatter, kernel_error
from ..kernels.base import merge_
from ..kernels.reference import ReferenceKernel
from ..layout import LAYOUTS, position_ids
from ..masks import CAUSAL, FULL
from ..schedule import backward_bytes, forward_bytes
from ..testing import rel_err
from . import finetune_demo

HELP = "run BurstAttention fwd+bwd on local CPU ranks; check it against a reference and report time and bytes"
SCHEMES = ("burst", "ring")


def add_arguments(p: argparse.ArgumentParser) -> None:
    # the attention check takes this parser's own flags; the other demo is a sub-command of it
    sub = p.add_subparsers(dest="demo", metavar="DEMO", required=False,
                           help="another demo instead of the attention check: finetune")
    fp = sub.add_parser("finetune", help=finetune_demo.HELP, description=finetune_demo.__doc__,
                        formatter_class=HelpFormatter)
    finetune_demo.add_arguments(fp)

    p.add_argument("--world", type=int, default=default_world(),
                   help="ranks to spawn (ignored under torchrun) [this machine's cores, 2 to 4: %(default)s]")
    p.add_argument("--seq", type=int, default=8192, help="global sequence length [%(default)s]")
    p.add_argument("--batch", type=int, default=1, help="batch size [%(default)s]")
    p.add_argument("--heads", type=int, default=4, help="query heads [%(default)s]")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads (GQA when < heads) [%(default)s]")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension [%(default)s]")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True,
                   help="causal mask [on]")
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag", help="sequence layout [%(default)s]")
    p.add_argument("--kernel", default=None,
                   help="local kernel (default: the kernel= default, i.e. BURST_KERNEL or auto)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the global inputs [%(default)s]")
    p.add_argument("--tol", type=float, default=1e-3,
                   help="largest max-relative error (max|x-ref| / max|ref|) accepted [%(default)s]")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: cores / world when spawning, else torch's default)")
    p.add_argument("--timeout", type=float, default=1200.0,
                   help="seconds before the spawned ranks are killed [%(default)s]")
    p.add_argument("--record", metavar="NAME", default=None,
                   help="also write the table as a JSON record NAME.json in $BURST_RESULTS or ./burst-results, "
                        "with the command's wall time (a numbered name if that exists)")


def default_world() -> int:
    """One rank per core, at least 2 (the demo's point is the ring) and at most 4: more ranks
    than cores only time the oversubscription."""
    return max(2, min(4, os.cpu_count() or 1))


# --- small helpers ------------------------------------------------------------------------------

def _mb(nbytes: int) -> str:
    return f"{nbytes:,} ({nbytes / 1e6:.1f} MB)"


def validate(args) -> str | None:
    """A message for arguments that cannot work, else None (checked before any process starts)."""
    if args.world < 1:
        return f"--world must be >= 1, got {args.world}"
    for name in ("seq", "batch", "heads", "kv_heads", "head_dim"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if args.heads % args.kv_heads:
        return f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})"
    try:
        position_ids(args.seq, args.layout, 0, args.world)
    except ValueError as e:
        return str(e)

    return kernel_error(args.kernel, "cpu", backward=True)  # the demo trains


# --- the reference ------------------------------------------------------------------------------

def _reference(q, k, v, do, causal, scale, rank, world, log):
    """out, dq, dk, dv of exact attention on the full sequence, float64.

    Query rows are cut into chunks of at most ~8M scores each (64 MB in float64); chunk i is
    computed by one rank (chunks dealt out zigzag so causal work is even).  A chunk of rows
    [a, b) meets keys [0, a) with the FULL mask and keys [a, b) with CAUSAL (all keys FULL
    when not causal), forward merged by log-sum-exp, then backward with the chunk's global lse
    and delta = rowsum(dO * O).  The partial results are summed over the ranks."""
    kern = ReferenceKernel()
    B, S, H, D = q.shape
    q, k, v, do = (t.double() for t in (q, k, v, do))
    out = torch.zeros_like(q)
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    rows = max(1, min(S, (1 << 23) // (B * H * S)))
    starts = list(range(0, S, rows))
    period = 2 * world
    mine = [a for i, a in enumerate(starts) if (i % period if i % period < world else period - 1 - i % period) == rank]
    for j, a in enumerate(mine):
        b = min(S, a + rows)
        if causal:
            blocks = ([(0, a, FULL)] if a > 0 else []) + [(a, b, CAUSAL)]
        else:
            blocks = [(0, S, FULL)]
        qc, doc = q[:, a:b], do[:, a:b]
        o = lse = None
        for k0, k1, mask in blocks:
            o2, l2 = kern.forward(qc, k[:, k0:k1], v[:, k0:k1], scale, mask)
            if o is None:
                o, lse = o2, l2
                continue
            merge_(o, lse, o2, l2)
        delta = (doc * o).sum(-1).transpose(1, 2)
        out[:, a:b] = o
        for k0, k1, mask in blocks:
            g_q, g_k, g_v = kern.backward(doc, qc, k[:, k0:k1], v[:, k0:k1], lse, delta, scale, mask)
            dq[:, a:b] += g_q
            dk[:, k0:k1] += g_k
            dv[:, k0:k1] += g_v
        if (j + 1) % max(1, len(mine) // 4) == 0 or j + 1 == len(mine):
            log(f"reference: rank 0 done {j + 1}/{len(mine)} of its row chunks")
    for t in (out, dq, dk, dv):
        dist.all_reduce(t)
    return out, dq, dk, dv


# --- one rank -----------------------------------------------------------------------------------

def run_rank(args, group=None) -> int:
    """The demo on this rank of an initialised process group; returns the exit code (same on all)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    log = RankLog("demo", rank)
    B, S, H, Hkv, D = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    n = S // world
    scale = D ** -0.5
    log(f"world {world} (gloo, {torch.get_num_threads()} thread(s) per rank), B={B} S={S} H={H} Hkv={Hkv} D={D}, "
        f"{'causal' if args.causal else 'full'}, layout {args.layout}, {n} tokens per rank, float32")

    g = torch.Generator().manual_seed(args.seed)
    q = torch.randn(B, S, H, D, generator=g)
    k = torch.randn(B, S, Hkv, D, generator=g)
    v = torch.randn(B, S, Hkv, D, generator=g)
    do = torch.randn(B, S, H, D, generator=g)
    sh = lambda t: be.shard(t, args.layout, rank, world).contiguous()
    ql, kl, vl, dol = (sh(t) for t in (q, k, v, do))
    elem = ql.element_size()

    # warm-up on a few tokens per rank (with a real dO: a broadcast one takes another path), so
    # the timings below hold no first-call costs
    few = min(16, n)
    for scheme in SCHEMES:
        w = [t[:, :few].clone().requires_grad_() for t in (ql, kl, vl)]
        be.burst_attn_func(*w, group=group, causal=args.causal, layout=args.layout, backward=scheme,
                           kernel=args.kernel).backward(dol[:, :few])

    results = {}
    for scheme in SCHEMES:
        log(f"{scheme}: forward + backward ...")
        qg, kg, vg = (t.clone().requires_grad_() for t in (ql, kl, vl))
        dist.barrier(group)
        with be.comm_stats() as st:
            t0 = time.perf_counter()
            o = be.burst_attn_func(qg, kg, vg, group=group, causal=args.causal, layout=args.layout,
                                   backward=scheme, kernel=args.kernel)
            dist.barrier(group)
            t1 = time.perf_counter()
            o.backward(dol)
            dist.barrier(group)
            t2 = time.perf_counter()
        results[scheme] = dict(out=o.detach(), dq=qg.grad, dk=kg.grad, dv=vg.grad, fwd_s=t1 - t0, bwd_s=t2 - t1,
                               fwd_bytes=st.forward_bytes, bwd_bytes=st.backward_bytes,
                               want_fwd=forward_bytes(B, n, Hkv, D, elem, world),
                               want_bwd=backward_bytes(scheme, B, n, H, Hkv, D, elem, world))
        log(f"{scheme}: forward {t1 - t0:.2f}s, backward {t2 - t1:.2f}s")

    log("reference: float64, full sequence in row chunks shared among the ranks ...")
    t0 = time.perf_counter()
    ref = dict(zip(("out", "dq", "dk", "dv"), _reference(q, k, v, do, args.causal, scale, rank, world, log)))
    log(f"reference: done in {time.perf_counter() - t0:.1f}s")

    mine = {}
    for scheme, r in results.items():
        errs = {key: rel_err(r[key], sh(ref[key])) for key in ("out", "dq", "dk", "dv")}
        mine[scheme] = dict(errs, **{key: r[key] for key in ("fwd_s", "bwd_s", "fwd_bytes", "bwd_bytes",
                                                              "want_fwd", "want_bwd")})
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=group)

    failures = []
    rows = []
    for scheme in SCHEMES:
        per = [e[scheme] for e in everyone]
        worst = {key: max(p[key] for p in per) for key in ("out", "dq", "dk", "dv", "fwd_s", "bwd_s")}
        fwd_b, bwd_b = per[0]["fwd_bytes"], per[0]["bwd_bytes"]
        want_f, want_b = per[0]["want_fwd"], per[0]["want_bwd"]
        for r, p in enumerate(per):
            if (p["fwd_bytes"], p["bwd_bytes"]) != (p["want_fwd"], p["want_bwd"]):
                failures.append(f"{scheme}: rank {r} sent {p['fwd_bytes']}/{p['bwd_bytes']} bytes fwd/bwd, "
                                f"byte model says {p['want_fwd']}/{p['want_bwd']}")
        bad = [key for key in ("out", "dq", "dk", "dv") if not worst[key] <= args.tol]
        if bad:
            failures.append(f"{scheme}: max rel err of {', '.join(bad)} above --tol {args.tol:g}")
        rows.append((scheme, worst, fwd_b, bwd_b, want_f, want_b))

    if rank == 0:
        print()
        print(f"BurstAttention on {world} CPU ranks: B={B} S={S} H={H} Hkv={Hkv} D={D} "
              f"{'causal' if args.causal else 'full'} {args.layout}, float32 (reference float64)")
        print("errors: max over ranks of max|x - ref| / max|ref|; times: slowest rank, barrier to barrier; "
              "bytes: sent by each rank")
        head = (f"{'scheme':<7}{'out err':>10}{'dq err':>10}{'dk err':>10}{'dv err':>10}{'fwd s':>8}{'bwd s':>8}"
                f"  {'fwd bytes/rank':<24}{'bwd bytes/rank':<24}{'predicted fwd / bwd':<22}")
        print(head)
        print("-" * len(head))
        for scheme, w, fb, bb, pf, pb in rows:
            same = "(match)" if (fb, bb) == (pf, pb) else "(DIFFER)"
            print(f"{scheme:<7}{w['out']:>10.1e}{w['dq']:>10.1e}{w['dk']:>10.1e}{w['dv']:>10.1e}"
                  f"{w['fwd_s']:>8.2f}{w['bwd_s']:>8.2f}  {_mb(fb):<24}{_mb(bb):<24}{pf:,} / {pb:,} {same}")
        if world > 1:
            lo = min(SCHEMES, key=lambda s: dict((r[0], r[3]) for r in rows)[s])
            print(f"backward bytes: {lo} sends less for these shapes "
                  f"(burst/ring = {rows[0][3] / max(1, rows[1][3]):.2f})")
        if failures:
            print("FAILED:\n  " + "\n  ".join(failures), flush=True)
        else:
            print(f"OK: every error <= {args.tol:g}, bytes as predicted", flush=True)
        if args.record:

            started = getattr(args, "started_at", None)
            path = write_record(args.record, dict(
                world=world, threads_per_rank=torch.get_num_threads(), kernel=args.kernel or "default",
                shape=dict(B=B, S=S, H=H, Hkv=Hkv, D=D), causal=args.causal, layout=args.layout, tol=args.tol,
                ok=not failures, failures=failures,
                # from the command's start (after Python's imports) to the table: spawn + work + reference
                wall_s=None if started is None else time.time() - started,
                rows=[dict(scheme=sc, **{k: w[k] for k in ("out", "dq", "dk", "dv", "fwd_s", "bwd_s")},
                           fwd_bytes=fb, bwd_bytes=bb) for sc, w, fb, bb, _, _ in rows]))
            print(f"record: {path}", flush=True)
    return 1 if failures else 0


# --- launching ----------------------------------------------------------------------------------

def run(args) -> int:
    if getattr(args, "demo", None) == "finetune":
        return finetune_demo.run(args)
    args.started_at = time.time()  # wall clock: the ranks share it (the record's wall_s)
    return run_command(run_rank, args, validate, "burstengine demo", backend="gloo")


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    sh = rec["shape"]
    head = [f"{rec['world']} gloo ranks on a {rec['env'].get('cpu_count', '?')}-core machine, "
            f"B={sh['B']} S={sh['S']} H={sh['H']} (kv {sh['Hkv']}) D={sh['D']}, "
            f"{'causal' if rec['causal'] else 'full'} {rec['layout']}, kernel {rec['kernel']}; whole command "
            f"{fixed(rec['wall_s'], 1)} s (spawn, both schemes, the float64 reference); "
            f"{'all within' if rec['ok'] else 'NOT all within'} {num(rec['tol'])} of float64.", ""]
    body = [[r["scheme"], num(r["out"]), num(r["dq"]), fixed(r["fwd_s"], 2), fixed(r["bwd_s"], 2),
             f"{r['fwd_bytes']:,}", f"{r['bwd_bytes']:,}"] for r in rec["rows"]]
    return head + table(["backward scheme", "out error", "dq error", "forward s", "backward s",
                         "forward bytes/rank", "backward bytes/rank"], body)


def block_demo(records):
    rec = dict(records).get("demo_cpu.json")
    if rec is None or rec.get("wall_s") is None:
        return "in docs/results.md."
    return (f"{rec['wall_s']:.0f} s on a {rec['env'].get('cpu_count', 2)}-core machine with {rec['world']} ranks, "
            f"after the install (`demo_cpu.json`).")


SECTIONS = (Section("The demo", r"^demo_(?!finetune)", render,
                    "`burstengine demo --record NAME`: the README's first command."),)
BLOCKS = {"demo": block_demo}
