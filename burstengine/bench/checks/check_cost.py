"""Cost of burst_attn_func's argument checks on CPU / gloo: the check alone, and a forward call
at each check level (local: no collective; agree: + one all-gather of the signature; full: +
the NaN/inf scan), for a tiny and a moderate shape, worlds 2 and 4.

    burstengine bench check-cost [--iters 20]

Times are medians over ``--iters`` calls (rank 0's clock, after a barrier, levels interleaved
so that load on a shared machine hits them alike).  Writes check_cost_cpu.json to
$BURST_RESULTS or ./burst-results (BURST_RESULTS=benchmarks/results to add to the committed ones).
"""
import os
import statistics
import time

import torch
import torch.distributed as dist

from ..tables import Section, ms, table
import burstengine as be
from ...attention.call import AttnCall, MaskArgs
from ...attention.prepare import check_call
from ...testing import DistPool
from ..records import write_record
from ..usage import command_parser

SHAPES = {"tiny": (1, 64, 4, 2, 32), "moderate": (1, 1024, 8, 8, 64)}  # B, n (local), H, Hkv, D


def measure(group, shape, iters):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    B, n, H, Hkv, D = shape
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(B, n, h, D, generator=g) for h in (H, Hkv, Hkv))

    def call():
        be.burst_attn_func(q, k, v, group=group, causal=True, layout="zigzag")

    def check():
        check_call(q, k, v, AttnCall(group=group, layout="zigzag", mask=MaskArgs(causal=True)))

    cases = {f"{what}_{level}": (fn, level) for what, fn in (("check", check), ("forward", call))
             for level in ("local", "agree", "full")}
    times = {name: [] for name in cases}
    for i in range(iters + 2):
        for name, (fn, level) in cases.items():
            dist.barrier(group)
            t0 = time.perf_counter()
            with be.arg_checks(level):
                fn()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    return times


def main(argv=None):
    ap = command_parser("burstengine bench check-cost", __doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    pool = DistPool(world=4)
    rows = []
    try:
        for world in (2, 4):
            for sname, shape in SHAPES.items():
                times = pool.run(measure, shape, args.iters, world=world)[0]
                med = {k: statistics.median(v) for k, v in times.items()}
                rows.append(dict(world=world, shape=sname, B_n_H_Hkv_D=shape, median_s=med, raw_s=times))
                fwd = med["forward_local"]
                print(f"world {world} {sname:8s} forward (local checks) {fwd * 1e3:8.2f} ms | "
                      f"check: agree {med['check_agree'] * 1e3:6.2f} ms ({med['check_agree'] / fwd:6.1%}), "
                      f"full {med['check_full'] * 1e3:6.2f} ms ({med['check_full'] / fwd:6.1%}) | "
                      f"forward at agree {med['forward_agree'] * 1e3:8.2f} ms, full {med['forward_full'] * 1e3:8.2f} ms",
                      flush=True)
    finally:
        pool.close()
    path = write_record("check_cost_cpu", dict(
        what="burst_attn_func argument-check cost on CPU/gloo (causal zigzag fp32 forward, reference kernel)",
        iters=args.iters, threads_per_rank=1, load_average_after=os.getloadavg(), rows=rows))
    print("wrote", path)


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    body = []
    for r in rec["rows"]:
        m = r["median_s"]
        body.append([r["world"], r["shape"], "×".join(map(str, r["B_n_H_Hkv_D"]))]
                    + [ms(m[f"check_{lv}"]) for lv in ("local", "agree", "full")]
                    + [ms(m[f"forward_{lv}"]) for lv in ("local", "agree", "full")]
                    + [f"{m['check_full'] / m['forward_local']:.1%}"])
    head = [f"{rec.get('what', '')}; medians of {rec.get('iters', '?')} calls, "
            f"{rec.get('threads_per_rank', '?')} thread(s) per rank.", ""]
    return head + table(["world", "shape", "B×n×H×Hkv×D", "check local ms", "check agree ms", "check full ms",
                         "forward local ms", "forward agree ms", "forward full ms", "check full ÷ forward local"],
                        body)


SECTIONS = (Section("Argument-check cost", r"^check_cost", render,
                    "`burstengine bench check-cost`: the cost of `BURST_CHECKS` levels."),)
