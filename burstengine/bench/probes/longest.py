"""Longest total sequence whose attention fwd+bwd fits (issue 3, item 4), under torchrun.

    torchrun --nproc_per_node 2 -m burstengine bench longest --methods burst-zigzag,torch-cp-cudnn

Peak memory of ring-style attention grows linearly with the sequence, so each method is run
once at two probe sizes, the line through the two peaks is extended to the memory the GPU
has (less --headroom), and the method is then run once (fwd+bwd) at the predicted length,
stepping down by --step on an OOM.  --at-most caps the length tried (a fwd+bwd grows with its square:
at 5M tokens one try outlasts a 10-minute device call); the predicted length is still recorded.  One untimed iteration per size: this finds a size, it
does not time one (bench attention does).  Writes longest_<world>gpu.json to $BURST_RESULTS or ./burst-results.
"""
import os
import time

import torch
import torch.distributed as dist

from ..peers.attention import make_method
from ..records import OUT_DIR_HELP, write_record
from ..tables import Section, table
from ..usage import command_parser


def _try(method, S, args, group, dev):
    """Peak bytes (max over ranks) of one fwd+bwd at total length S, or None on OOM (all ranks agree)."""
    world = dist.get_world_size(group)
    fn, ctx_factory = make_method(method, group, True, args.kernel)
    n = S // world
    ok = torch.ones(1, device=dev)
    peak = torch.zeros(1, device=dev, dtype=torch.float64)
    tensors = None
    try:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        dtype = torch.bfloat16
        tensors = [torch.randn(1, n, h, args.head_dim, device=dev, dtype=dtype, requires_grad=i < 3)
                   for i, h in enumerate((args.heads, args.kv_heads, args.kv_heads, args.heads))]
        ctx = ctx_factory(group, S, dev, True) if ctx_factory else None
        if ctx:
            ctx.__enter__()
        try:
            q, k, v, do = tensors
            fn(q, k, v).backward(do)
            torch.cuda.synchronize()
        finally:
            if ctx:
                ctx.__exit__(None, None, None)
        peak[0] = torch.cuda.max_memory_allocated()
    except torch.OutOfMemoryError:
        ok[0] = 0
    tensors = None
    torch.cuda.empty_cache()
    # an OOM on one rank must not leave the others waiting in the ring: agree before going on
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    return int(peak.item()) if ok.item() else None


def main(argv=None):
    ap = command_parser("burstengine bench longest", __doc__)
    ap.add_argument("--methods", default="burst-zigzag,torch-cp-cudnn")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--kernel", default=None)
    ap.add_argument("--probes", default="131072,262144", help="two total lengths for the memory line")
    ap.add_argument("--headroom", type=float, default=0.04, help="fraction of GPU memory left free")
    ap.add_argument("--step", type=float, default=0.08, help="relative step down after an OOM")
    ap.add_argument("--tries", type=int, default=3)
    ap.add_argument("--at-most", type=int, default=None, help="longest length tried (the prediction is still recorded)")
    ap.add_argument("--name", default=None, help="record name [longest_<world>gpu]")
    ap.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    args = ap.parse_args(argv)
    unit = 2 * int(os.environ.get("WORLD_SIZE", "1")) * 1024  # zigzag needs 2G chunks; keep lengths round
    if args.at_most is not None and args.at_most < unit:
        ap.error(f"--at-most {args.at_most}: at least {unit} tokens (2 x 1024 x the ranks)")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda")
    cap = torch.cuda.get_device_properties(dev).total_memory * (1 - args.headroom)
    rows, t0 = [], time.time()
    name = args.name or f"longest_{world}gpu"
    own = None  # this run's record once written: rewritten after every method
    for m in args.methods.split(","):
        s1, s2 = map(int, args.probes.split(","))
        p1, p2 = _try(m, s1, args, None, dev), _try(m, s2, args, None, dev)
        row = dict(method=m, probes={s1: p1, s2: p2}, tries=[])
        if p1 is None or p2 is None:
            row["error"] = "OOM at a probe size"
            rows.append(row)
            continue
        per_token = (p2 - p1) / (s2 - s1)
        S = int((cap - (p1 - per_token * s1)) / per_token) // unit * unit
        row.update(bytes_per_token=per_token, predicted=S)
        if args.at_most and S > args.at_most:
            S = args.at_most // unit * unit
            row["capped"] = S
        for _ in range(args.tries):
            t = time.time()
            peak = _try(m, S, args, None, dev)
            row["tries"].append(dict(S=S, peak_bytes=peak, seconds=time.time() - t))
            if rank == 0:
                print(f"[{time.time() - t0:6.0f}s] {m}: S={S} -> {'OOM' if peak is None else f'{peak / 2**30:.1f} GiB'}",
                      flush=True)
            if peak is not None:
                row["longest"] = S
                break
            S = int(S * (1 - args.step)) // unit * unit
        rows.append(row)
        if rank == 0:  # after every method: a run stopped later still leaves its figures
            own = write_record(name, dict(world=world, args=vars(args), rows=rows, partial=True),
                               args.out_dir, path=own)
    if rank == 0:
        for r in rows:
            print(f"{r['method']:18s} longest fwd+bwd {r.get('longest', 'none')} tokens on {world} GPUs "
                  f"(predicted {r.get('predicted')}{', tried at most ' + str(r['capped']) if 'capped' in r else ''}; peak grows {r.get('bytes_per_token', 0) / 1024:.0f} KiB per GPU per token)")
        print("wrote", write_record(name, dict(world=world, args=vars(args), rows=rows), args.out_dir,
                                    path=own))
    dist.destroy_process_group()


# --- docs/results.md ----------------------------------------------------------------------------

def _peak(t):
    """A try's peak as the table shows it: records hold bytes (peak_bytes, None on OOM); the
    hand-assembled 2-GPU record holds GiB."""
    if t.get("peak_bytes"):
        return f"{t['peak_bytes'] / 2**30:.1f} GiB"
    return f"{t['peak_gib']} GiB" if t.get("peak_gib") else "OOM"


def render(rec):
    body = []
    for r in rec["rows"]:
        tries = "; ".join(f"S={t['S']}: {_peak(t)}" + (f" ({t['seconds']:.0f} s)" if t.get("seconds") else "")
                          for t in r.get("tries", []))
        predicted = r.get("predicted", "—")
        if "capped" in r:
            predicted = f"{predicted} (tried at most {r['capped']})"
        body.append([r["method"], r.get("longest", "—"), predicted, tries or r.get("error", "")])
    return table(["method", "longest S", "predicted to fit", "tries"], body)


SECTIONS = (Section("Longest sequence", r"^longest", render,
                    "`burstengine bench longest`: the longest sequence each method fits."),)
