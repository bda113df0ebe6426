"""The decode step's projections on one GPU: our GEMV kernel (kernels/triton/gemv.py) beside cuBLAS.

    burstengine bench gemv [--rows 1,8] [--sweep] [--name gemv_h100]

check: random x (1-16 rows), weights (odd N and K too), with and without bias, fp16 and bf16,
against float64.
speed: Llama-3.1-8B's projections as one rank of 1, 2 and 4 reads them (q/k/v and gate/up packed
as the inference model lays them out: model/layers.py ``pack``; the LM head's vocabulary slice),
``rows`` rows of x: cuBLAS (``F.linear``) and ours, each timed over a cycle of weight copies
larger than L2 (a decode step reads each weight once, from HBM), as the read's bandwidth and the
fraction of the device-to-device copy bandwidth measured in the same launch.  ``--sweep`` times
the kernel's tile configurations on every shape first and reports the best beside the default.
Writes gemv_<gpu>.json (--name) to --out-dir.
"""
from __future__ import annotations

import statistics

import torch
import torch.nn.functional as F

from ...model import PRESETS
from ...testing import fro_err
from ..peers.decode import copy_bandwidth
from ..records import OUT_DIR_HELP, write_record
from ..tables import Section, num, table
from ..usage import command_parser

SWEEP = [(bn, bk, w, s) for bn in (16, 32, 64) for bk in (128, 256, 512) for w in (4, 8) for s in (3, 4)
         if bn * bk <= 16384]
L2_CYCLE = 1 << 30  # bytes of weight copies cycled through: far past any L2 (at least 4 copies)


def check(device) -> list[dict]:
    from ...kernels.triton import gemv  # imports triton (report imports this module on any machine)

    g = torch.Generator().manual_seed(0)
    rows = []
    for M, N, K, dt, bias in [(1, 96, 200, torch.bfloat16, False), (3, 50, 64, torch.float16, True),
                              (16, 33, 300, torch.bfloat16, True), (8, 4096, 4096, torch.bfloat16, False),
                              (1, 1000, 4097, torch.float16, False), (5, 6144, 4096, torch.bfloat16, True)]:
        x = torch.randn(M, K, generator=g).to(device, dt)
        w = torch.randn(N, K, generator=g).to(device, dt)
        b = torch.randn(N, generator=g).to(device, dt) if bias else None
        ref = x.double() @ w.double().t() + (b.double() if bias else 0)
        rows.append(dict(M=M, N=N, K=K, dtype=str(dt)[6:], bias=bias, err=fro_err(gemv.gemv(x, w, b), ref),
                         cublas_err=fro_err(F.linear(x, w, b), ref)))
    return rows


def shapes(world: int) -> list[tuple[str, int, int]]:
    a = PRESETS["llama-8b"]
    q, kv, f = a.n_heads * a.head_dim // world, a.n_kv_heads * a.head_dim // world, a.ffn_dim // world
    return [("qkv", q + 2 * kv, a.dim), ("wo", a.dim, q), ("w13", 2 * f, a.dim), ("w2", a.dim, f),
            ("lm_head", a.vocab_size // world, a.dim)]


def _bench(fn, ws, x, reps: int = 3) -> float:
    """GPU seconds per call of fn(x, w), cycling through the weights ``ws`` (each read from HBM),
    the cycle captured in a CUDA graph and replayed: a decode step replays its projections so,
    and timed launch by launch a call of a few microseconds would measure the host's launches."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for w in ws:
            fn(x, w)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for w in ws:
            fn(x, w)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(ws))
    del graph
    return statistics.median(times)


def speed(device, rows_list, sweep: bool, bw: float) -> list[dict]:
    from ...kernels.triton import gemv  # imports triton: only on a GPU run

    out = []
    for world in (1, 2, 4):
        for name, N, K in shapes(world):
            nbytes = N * K * 2
            ws = [torch.randn(N, K, device=device, dtype=torch.bfloat16) * 0.02
                  for _ in range(max(4, L2_CYCLE // nbytes))]
            for M in rows_list:
                x = torch.randn(M, K, device=device, dtype=torch.bfloat16)
                t_cublas = _bench(lambda x, w: F.linear(x, w), ws, x)
                t_ours = _bench(lambda x, w: gemv.gemv(x, w), ws, x)
                row = dict(world=world, proj=name, N=N, K=K, M=M, bytes=nbytes, cublas_s=t_cublas, ours_s=t_ours,
                           cublas_of_copy=nbytes / t_cublas / bw, ours_of_copy=nbytes / t_ours / bw,
                           config=list(gemv.config_for(N)))
                if sweep:
                    times = {c: _bench(lambda x, w, c=c: gemv.gemv(x, w, config=c), ws, x, reps=2) for c in SWEEP}
                    best = min(times, key=times.get)
                    row.update(best_config=list(best), best_s=times[best],
                               sweep={",".join(map(str, c)): t for c, t in times.items()})
                out.append(row)
                print(f"[bench gemv] W={world} {name:8s} {N}x{K} M={M}: cuBLAS {t_cublas * 1e6:7.1f} us "
                      f"({row['cublas_of_copy']:.0%}), ours {t_ours * 1e6:7.1f} us ({row['ours_of_copy']:.0%})"
                      + (f", best {row['best_config']} {row['best_s'] * 1e6:.1f} us" if sweep else ""), flush=True)
            del ws
            torch.cuda.empty_cache()
    return out


def main(argv=None):
    ap = command_parser("burstengine bench gemv", __doc__)
    ap.add_argument("--rows", default="1,8", help="rows of x (decode batch sizes) [%(default)s]")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--name", default=None)
    ap.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.exit(2, "burstengine bench gemv: needs a CUDA GPU\n")
    try:
        rows_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        ap.exit(2, f"burstengine bench gemv: --rows must be integers, got {args.rows!r}\n")
    if not all(1 <= r <= 16 for r in rows_list):
        ap.exit(2, f"burstengine bench gemv: --rows must lie in [1, 16] (the kernel's rows), got {args.rows}\n")
    device = torch.device("cuda")
    rec = dict(check=check(device))
    worst = max(r["err"] for r in rec["check"])
    print(f"[bench gemv] check: {len(rec['check'])} cases, worst {worst:.2e} vs float64 "
          f"(cuBLAS {max(r['cublas_err'] for r in rec['check']):.2e})", flush=True)
    rec["copy_bandwidth_Bps"] = bw = copy_bandwidth(device, 4096)
    rec["speed"] = speed(device, rows_list, args.sweep, bw)
    name = args.name or "gemv_" + torch.cuda.get_device_name().split()[1].lower()
    print("wrote", write_record(name, rec, args.out_dir))


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec) -> list[str]:
    return table(["ranks", "projection", "N × K", "rows", "cuBLAS µs", "ours µs", "cuBLAS of copy bw",
                  "ours of copy bw"],
                 [[r["world"], r["proj"], f"{r['N']}×{r['K']}", r["M"], num(r["cublas_s"] * 1e6, 3),
                   num(r["ours_s"] * 1e6, 3), f"{r['cublas_of_copy']:.0%}", f"{r['ours_of_copy']:.0%}"]
                  for r in rec.get("speed", [])])


SECTIONS = (Section("GEMV (decode projections)", r"^gemv_", render,
                    "`burstengine bench gemv`: Llama-3.1-8B's projections as one rank of 1, 2, 4 reads them, "
                    "bf16, weights cycled past L2; one GPU."),)
