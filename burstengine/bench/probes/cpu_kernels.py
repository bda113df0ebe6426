"""CPU kernel speed: the CPU flash kernel (kernels/cpu_flash.py, torch's CPU flash attention
op) against the reference kernel (plain torch, chunked scores) on one causal block, forward
and backward, float32 (and bfloat16 for the flash kernel).

    burstengine bench cpu-kernels [--seq 4096] [--heads 8] [--head-dim 64] [--threads 2] \
        [--out-dir DIR]

Times are medians of ``--iters`` calls after one warm-up, in seconds.  Writes
<out-dir>/cpu_kernels_cpu.json (default: ./burst-results, or $BURST_RESULTS).
"""
import statistics
import sys
import time

import torch

from ...kernels.cpu_flash import CpuFlashKernel
from ...kernels.reference import ReferenceKernel
from ..records import OUT_DIR_HELP, write_record
from ..tables import Section, med, ms, ratio, table
from ..usage import command_parser


def timed(fn, iters):
    fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def _refused(args) -> str | None:
    """One line for a shape the kernels cannot run, else None."""
    for name in ("seq", "batch", "heads", "kv_heads", "head_dim", "iters"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if args.heads % args.kv_heads:
        return f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}"
    return None


def main(argv=None):
    p = command_parser("burstengine bench cpu-kernels", __doc__)
    p.add_argument("--seq", type=int, default=4096, help="tokens of the block (queries and keys)")
    p.add_argument("--batch", type=int, default=1, help="sequences")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads [= --heads]")
    p.add_argument("--head-dim", type=int, default=64, help="width of a head")
    p.add_argument("--threads", type=int, default=None, help="torch threads [torch's default]")
    p.add_argument("--iters", type=int, default=5, help="timed calls after one warm-up")
    p.add_argument("--mask", default="causal", choices=("causal", "full", "strict"), help="the block's mask")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    args = p.parse_args(argv)
    if args.kv_heads is None:
        args.kv_heads = args.heads
    msg = _refused(args)
    if msg:
        print(f"burstengine bench cpu-kernels: error: {msg}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    B, S, H, Hkv, D = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    scale = D ** -0.5
    rows = []
    for kname, kern in (("reference", ReferenceKernel()), ("cpu_flash", CpuFlashKernel())):
        for dtype in (torch.float32, torch.bfloat16):
            if kname == "reference" and dtype != torch.float32:
                continue  # the reference computes in float32 whatever the input
            g = torch.Generator().manual_seed(0)
            q, do = (torch.randn(B, S, H, D, generator=g).to(dtype) for _ in range(2))
            k, v = (torch.randn(B, S, Hkv, D, generator=g).to(dtype) for _ in range(2))
            out, lse = kern.forward(q, k, v, scale, args.mask)
            delta = kern.delta(out, do)
            fwd, fwd_all = timed(lambda: kern.forward(q, k, v, scale, args.mask), args.iters)
            bwd, bwd_all = timed(lambda: kern.backward(do, q, k, v, lse, delta, scale, args.mask, out=out),
                                 args.iters)
            rows.append(dict(kernel=kname, dtype=str(dtype)[6:], fwd_s=fwd, bwd_s=bwd, fwd_all=fwd_all,
                             bwd_all=bwd_all))
            print(f"{kname:<10} {str(dtype)[6:]:<9} fwd {fwd:.3f}s  bwd {bwd:.3f}s", flush=True)
    ref = rows[0]
    for r in rows:
        r["fwd_speedup_vs_reference"] = ref["fwd_s"] / r["fwd_s"]
        r["bwd_speedup_vs_reference"] = ref["bwd_s"] / r["bwd_s"]
    path = write_record("cpu_kernels_cpu", dict(shape=dict(B=B, S=S, H=H, Hkv=Hkv, D=D), mask=args.mask,
                                                threads=torch.get_num_threads(), iters=args.iters, rows=rows),
                        args.out_dir)
    print("wrote", path)


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    sh = rec["shape"]
    head = [f"One {rec['mask']} block, B={sh['B']}, S={sh['S']}, H={sh['H']} (kv {sh['Hkv']}), D={sh['D']}, "
            f"{rec['threads']} threads; median of {rec['iters']} runs; speed-ups against the reference kernel of the "
            "same dtype, from the same record.", ""]
    ref = {(r["dtype"]): r for r in rec["rows"] if r["kernel"] == "reference"}
    body = [[r["kernel"], r["dtype"], ms(med(r["fwd_all"])), ms(med(r["bwd_all"])),
             ratio(med(ref[r["dtype"]]["fwd_all"]), med(r["fwd_all"])) if r["dtype"] in ref else "—",
             ratio(med(ref[r["dtype"]]["bwd_all"]), med(r["bwd_all"])) if r["dtype"] in ref else "—"]
            for r in rec["rows"]]
    return head + table(["kernel", "dtype", "forward ms", "backward ms", "forward ×", "backward ×"], body)


SECTIONS = (Section("Local kernels on CPU", r"^cpu_kernels", render,
                    "`burstengine bench cpu-kernels`: torch's CPU flash attention op against the reference kernel."),)
