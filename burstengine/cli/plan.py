"""`burstengine plan`: predicted time of one attention forward + backward per scheme, and the one
to use, for a cluster description.

    burstengine plan --preset a800-paper --seq 1M --heads 40
    burstengine plan --nodes 2 --gpus-per-node 8 --intra-gbps 300 --inter-gbps 45 --seq 512K --heads 32 --kv-heads 8
    burstengine plan --cluster benchmarks/results/topo_bench_2gpu.json --seq 128K   # measured figures

The cluster's figures are bandwidths per GPU and direction (GB/s), latencies (us) and the local
attention kernel's throughput (TFLOP/s); a --cluster JSON may also hold measured kernel times
(burstengine bench topo writes one).  Each flag overrides the preset or file.  The model is
burstengine/costmodel.py; the same model makes burst_attn_func's "auto" choices when
BURST_CLUSTER names the cluster.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from ..bench.records import write_record
from ..bench.tables import Section, fixed, table
from ..costmodel import Attn, Cluster, Link, PRESETS, SCHEMES, best, compare, load_cluster, table1

HELP = "predict each context-parallel scheme's attention time on a cluster and say which to use"

ELEM = {"bf16": 2, "fp16": 2, "fp32": 4}


def parse_tokens(s: str) -> int:
    """'1M' -> 1048576, '128K' -> 131072, '4096' -> 4096."""
    s = str(s).strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    try:
        return int(float(s[:-1] if mult > 1 else s) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {s!r} (e.g. 131072, 128K, 1M)") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    c = p.add_argument_group("cluster")
    c.add_argument("--preset", choices=sorted(PRESETS), default=None, help="start from these figures")
    c.add_argument("--cluster", default=None, help="start from a cluster JSON (e.g. written by topo_bench)")
    c.add_argument("--nodes", type=int, default=None)
    c.add_argument("--gpus-per-node", type=int, default=None)
    c.add_argument("--intra-gbps", type=float, default=None, help="intra-node GB/s per GPU and direction")
    c.add_argument("--inter-gbps", type=float, default=None, help="inter-node GB/s per GPU and direction")
    c.add_argument("--intra-latency-us", type=float, default=None)
    c.add_argument("--inter-latency-us", type=float, default=None)
    c.add_argument("--fwd-tflops", type=float, default=None, help="local kernel forward TFLOP/s")
    c.add_argument("--bwd-tflops", type=float, default=None, help="local kernel backward TFLOP/s")
    a = p.add_argument_group("attention")
    a.add_argument("--seq", type=parse_tokens, default=parse_tokens("128K"), help="global tokens [128K]")
    a.add_argument("--heads", type=int, default=32)
    a.add_argument("--kv-heads", type=int, default=None, help="[= heads]")
    a.add_argument("--head-dim", type=int, default=128)
    a.add_argument("--batch", type=int, default=1)
    a.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal mask [on]")
    a.add_argument("--layout", choices=("zigzag", "striped", "contiguous"), default="zigzag")
    a.add_argument("--dtype", choices=sorted(ELEM), default="bf16")
    p.add_argument("--json", default=None, help="also write the predictions as a JSON record here")


def build_cluster(args):
    base = load_cluster(args.cluster) if args.cluster else PRESETS[args.preset] if args.preset else Cluster()
    kw = {}
    for f in ("nodes", "gpus_per_node", "fwd_tflops", "bwd_tflops"):
        if getattr(args, f) is not None:
            kw[f] = getattr(args, f)
    for side in ("intra", "inter"):
        link = getattr(base, side)
        gbps, lat = getattr(args, f"{side}_gbps"), getattr(args, f"{side}_latency_us")
        if gbps is not None or lat is not None:
            kw[side] = Link(gbps if gbps is not None else link.gbps, lat if lat is not None else link.latency_us)
    return dataclasses.replace(base, **kw)


def call_for(p) -> str:
    """The burstengine call that runs prediction ``p``."""
    cfg = p.config
    if p.scheme in ("hybrid", "ulysses"):
        return f"hybrid_attn_func(q, k, v, ulysses={cfg['ulysses']}, backward=\"{cfg.get('backward', 'auto')}\")"
    topo = "None" if p.scheme in ("burst", "ring") else f"\"{cfg['topology']}\""
    return f"burst_attn_func(q, k, v, topology={topo}, backward=\"{cfg['backward']}\")"


def report(cluster, attn, out=None) -> dict:
    out = out or sys.stdout  # looked up per call: a default bound at import misses later redirections
    preds = compare(cluster, attn)
    G = cluster.world
    flops = attn.flops() / G
    print(f"cluster {cluster.name}: {cluster.nodes} node(s) x {cluster.gpus_per_node} GPUs; intra {cluster.intra.gbps:g} "
          f"GB/s {cluster.intra.latency_us:g} us, inter {cluster.inter.gbps:g} GB/s {cluster.inter.latency_us:g} us; "
          f"kernel {cluster.fwd_tflops:g} / {cluster.bwd_tflops:g} TFLOP/s fwd / bwd"
          f"{'; ' + str(len(cluster.kernel_times)) + ' measured kernel times' if cluster.kernel_times else ''}",
          file=out)
    print(f"attention: S={attn.seq} H={attn.heads} Hkv={attn.hkv} D={attn.head_dim} B={attn.batch} "
          f"{'causal' if attn.causal else 'full'} {attn.layout}, {attn.elem}-byte elements", file=out)
    hdr = (f"{'scheme':13s} {'fwd+bwd s':>10s} {'compute':>8s} {'comm only':>9s} {'exposed':>8s} "
           f"{'inter GB':>8s} {'TF/s/GPU':>8s}  notes")
    print(hdr, file=out)
    print("-" * len(hdr), file=out)
    for p in preds:
        if not p.feasible:
            print(f"{p.scheme:13s} {'-':>10s} {'':8s} {'':9s} {'':8s} {'':8s} {'':8s}  {p.why}", file=out)
            continue
        extra = ", ".join(f"{k}={v}" for k, v in p.config.items())
        print(f"{p.scheme:13s} {p.total_s:10.4f} {p.compute_s:8.4f} {p.comm_only_s:9.4f} {p.exposed_s:8.4f} "
              f"{p.inter_bytes / 1e9:8.2f} {flops / p.total_s / 1e12:8.1f}  {extra}", file=out)
    pick = best(preds)
    print(f"use: {pick.scheme} ({SCHEMES[pick.scheme]}): {call_for(pick)}", file=out)
    rec = dict(cluster=cluster.to_dict(), attn=dataclasses.asdict(attn), predictions=[p.to_dict() for p in preds],
               choice=dict(scheme=pick.scheme, call=call_for(pick)))
    if cluster.nodes > 1:
        t1 = table1(cluster, attn)
        rec["table1"] = t1
        print(f"BurstEngine Table 1 (communication time, P = one K shard = {t1['P_bytes'] / 1e6:.1f} MB, N = {G}): "
              f"Ring {t1['ring']:.4f} s, DoubleRing {t1['double_ring']:.4f} s, Burst {t1['burst_double']:.4f} s; "
              f"this model's comm-only time: " + ", ".join(
                  f"{p.scheme} {p.comm_only_s:.4f} s" for p in preds
                  if p.scheme in ("ring", "double_ring", "burst_double") and p.feasible), file=out)
    return rec


def refused(args, cluster) -> str | None:
    """One line for figures the model cannot divide by (a zero or negative size, bandwidth or
    throughput, from the flags or the preset / file), else None."""
    for flag, v in (("--seq", args.seq), ("--heads", args.heads), ("--kv-heads", args.kv_heads),
                    ("--head-dim", args.head_dim), ("--batch", args.batch)):
        if v is not None and v < 1:
            return f"{flag} must be >= 1, got {v}"
    if cluster.world < 1:
        return f"the cluster has no GPUs (--nodes {cluster.nodes}, --gpus-per-node {cluster.gpus_per_node})"
    for flag, v in (("--intra-gbps", cluster.intra.gbps), ("--inter-gbps", cluster.inter.gbps),
                    ("--fwd-tflops", cluster.fwd_tflops), ("--bwd-tflops", cluster.bwd_tflops)):
        if not v > 0:
            return f"{flag} must be > 0, got {v:g}"
    for flag, v in (("--intra-latency-us", cluster.intra.latency_us), ("--inter-latency-us", cluster.inter.latency_us)):
        if not v >= 0:
            return f"{flag} must be >= 0, got {v:g}"
    return None


def run(args) -> int:
    try:
        cluster = build_cluster(args)
        msg = refused(args, cluster)
        if msg:
            raise ValueError(msg)
        attn = Attn(args.seq, args.heads, args.kv_heads, args.head_dim, args.batch, args.causal, ELEM[args.dtype],
                    args.layout)
        if attn.heads % attn.hkv:
            raise ValueError(f"--heads {attn.heads} is not a multiple of --kv-heads {attn.hkv}")
    except (ValueError, TypeError) as e:
        print(f"burstengine plan: error: {e}", file=sys.stderr)
        return 2
    rec = report(cluster, attn)
    if args.json:
        path = write_record(os.path.splitext(os.path.basename(args.json))[0], rec, os.path.dirname(args.json) or ".")
        print(f"wrote {path}")
    return 0


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    a, c = rec["attn"], rec["cluster"]
    head = [f"{c['nodes']} nodes × {c['gpus_per_node']} GPUs ({c.get('name', '')}), S={a['seq']}, "
            f"{a['heads']} heads × {a['head_dim']}, {'causal' if a['causal'] else 'full'}; "
            f"choice: `{rec['choice']['call']}`.", ""]
    body = [[p["scheme"], fixed(p["total_s"], 3) if p["feasible"] else f"— ({p['why']})",
             fixed(p["compute_s"], 3) if p["feasible"] else "", fixed(p["comm_only_s"], 3) if p["feasible"] else "",
             fixed(p.get("exposed_s"), 3) if p["feasible"] else "",
             f"{p['inter_bytes'] / 1e9:.1f}" if p["feasible"] else ""] for p in rec["predictions"]]
    out = head + table(["scheme", "fwd+bwd s", "compute s", "communication only s", "exposed s", "inter-node GB"],
                       body)
    t = rec.get("table1")
    if t:
        out += [f"Table 1 relations of the paper, same figures: ring {fixed(t['ring'], 3)} s, double ring "
                f"{fixed(t['double_ring'], 3)} s, Burst on the double ring {fixed(t['burst_double'], 3)} s.", ""]
    return out


SECTIONS = (Section("Cost model predictions", r"^plan_", render, "`burstengine plan --json`: predictions, no run."),)
