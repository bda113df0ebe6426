"""Quick speed probe (planning aid): BurstAttention fwd / fwd+bwd at a few sizes, bf16, H=32, d=128.

    torchrun --nproc_per_node 2 -m burstengine bench probe-speed

Writes probe_speed_<world>gpu.json to $BURST_RESULTS or ./burst-results (or --out-dir).
"""

import torch
import torch.distributed as dist

from ..tables import Section, fixed, med, ms, num, table
import burstengine as be
from ..harness import attn_flops
from ..records import OUT_DIR_HELP, write_record
from ..usage import command_parser


def bench(fn, warm=2, iters=5):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    t = torch.tensor(ts, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return sorted(t.tolist())[len(ts) // 2], t.tolist()


def main(argv=None):
    ap = command_parser("burstengine bench probe-speed", __doc__)
    ap.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    args = ap.parse_args(argv)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    H, D = 32, 128
    rows = []
    for S, causal, layout, bwd, kern in [
        (131072, True, "zigzag", "burst", "cudnn"), (131072, True, "zigzag", "ring", "cudnn"),
        (131072, False, "contiguous", "burst", "cudnn"), (131072, True, "striped", "burst", "cudnn"),
        (131072, True, "zigzag", "burst", "flash"),
        (524288, True, "zigzag", "burst", "cudnn"), (524288, True, "zigzag", "ring", "cudnn"),
    ]:
        n = S // world
        q = torch.randn(1, n, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(1, n, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(1, n, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        do = torch.randn(1, n, H, D, device="cuda", dtype=torch.bfloat16)
        kw = dict(causal=causal, layout=layout, backward=bwd, kernel=kern)
        tf, _ = bench(lambda: be.burst_attn_func(q, k, v, **kw))
        torch.cuda.reset_peak_memory_stats()
        tb, raw = bench(lambda: be.burst_attn_func(q, k, v, **kw).backward(do))
        flops = attn_flops(1, S, S, H, D, 0.5 if causal else 1.0)
        row = dict(S=S, causal=causal, layout=layout, backward=bwd, kernel=kern, fwd_s=tf, fwdbwd_s=tb,
                   fwd_tflops=flops / world / tf / 1e12, fwdbwd_tflops=3.5 * flops / world / tb / 1e12,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30, raw=raw)
        rows.append(row)
        if rank == 0:
            print(f"S={S} causal={causal} {layout:10s} {bwd:5s} {kern:5s} fwd {tf*1e3:8.1f} ms {row['fwd_tflops']:6.1f} TF/s"
                  f" | fwd+bwd {tb*1e3:8.1f} ms {row['fwdbwd_tflops']:6.1f} TF/s | peak {row['peak_gib']:.1f} GiB", flush=True)
        del q, k, v, do
        torch.cuda.empty_cache()
    if rank == 0:
        print("wrote", write_record(f"probe_speed_{world}gpu", dict(rows=rows), args.out_dir))
    dist.destroy_process_group()


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    return table(["S", "mask", "layout", "backward", "kernel", "fwd ms", "fwd+bwd ms (median of raw)",
                  "fwd TFLOP/s", "fwd+bwd TFLOP/s", "peak GiB"],
                 [[r["S"], "causal" if r["causal"] else "full", r["layout"], r["backward"], r["kernel"],
                   ms(r["fwd_s"]), ms(med(r["raw"])), num(r["fwd_tflops"], 4), num(r["fwdbwd_tflops"], 4),
                   fixed(r["peak_gib"], 1)] for r in rec["rows"]])


SECTIONS = (Section("Per-call speed inside the ring", r"^probe_speed", render,
                    "`burstengine bench probe-speed`: one configuration of the ring, repeated."),)
