"""`burstengine bench decode`: generation on one device (or a CP group): first-token latency of our
prefill beside plain SDPA prefill of the same model, decode time per token beside the bound
that HBM bandwidth sets, peak memory.

    burstengine bench decode --model tiny --seqs 256,512 --batches 1,2 --world 1        # CPU, seconds
    torchrun --nproc_per_node 1 -m burstengine bench decode --model llama-3.1-8b \\
        --seqs 32K,128K --batches 1,8 --batch-max 32K --sdpa-max 128K
    torchrun --nproc_per_node 2 -m burstengine bench decode --model llama-3.1-8b --seqs 128K,512K \\
        --batches 1,8 --batch-max 128K --tp both          # tensor-parallel rows beside whole-model ones

For every prompt length S and batch B (B > 1 only up to --batch-max), one generate() call
prefills B random prompts of S tokens and decodes --warmup + --tokens steps: its prefill time is
the first-token latency (prompt on the device -> first token chosen, cache allocation
included), the median of the last --tokens steps the decode time per token.  With --graphs on
(auto: on CUDA, any number of ranks) that call replays the decode step from a CUDA graph (its
capture, at the first step, is recorded apart and not counted), and a second call on the same
prompts decodes op by op: the row records both times, their ratio and whether the two calls
chose the same greedy tokens (a run where they differ exits 1).  With more than one rank --tp
picks the rows: the decode step tensor-parallel over the ranks (each reads its slice of the
weights: model/tensor_parallel.py), the whole model on every rank, or both, one row each (auto:
tensor-parallel where the model's shapes divide); --sliced loads only each rank's slices (the
prefill then gathers each layer's weights; tensor-parallel rows only).  At B = 1 and
S <= --sdpa-max a second call with plain SDPA prefill (world 1 only) gives the peer's
first-token latency.  The bound of a decode step is the bytes one rank must read once: its
weights but the embedding table (its slices under tensor parallelism, else all) plus its shard
of the cached K and V of the B sequences, over the device-to-device copy bandwidth measured in
the same launch (a large tensor copied, read + written bytes / time).  Each row records its raw
times, and the record (command, commit, device, versions) is rewritten after every row, so an
interrupted run keeps what it measured.

--profile N profiles N decode steps of the last row's case (torch.profiler, after its warm-up
steps) and records, per step, each kind of kernel's GPU time (matrix products, decode attention,
collectives, element-wise, copies), the kernels launched and the time no kernel ran: where a step
beyond its bound goes.

--check first checks the decode path on this device in seconds (bench/checks/decode_check.py: the
decode attention kernel against float64, and a small model's greedy tokens with and without the
graph against the float64 model's), records it, and stops with exit 1 if anything fails.

--model: a preset (random weights made directly on the device, no HF directory needed;
"llama-3.1-8b" is Llama-3.1-8B's shape without its rope scaling, which does not change the
time) or a local HF directory.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ...inference.engine import peak_bytes, reset_peak
from ...inference.generate import STEP_LABEL, generate
from ...inference.kvcache import KV_CACHES
from ...inference.models import check_spec, load_model, resolve_dtype
from ...inference.needle import parse_lengths
from ...inference.step import MODES as GRAPH_MODES, use_graphs, use_tensor_parallel
from ...model import projection
from ...model.tensor_parallel import head_weight
from ..harness import RankLog, ranked_bench
from ..probes.profile import kernel_events, union
from ..records import OUT_DIR_HELP, write_record
from ..tables import Section, device_of, fixed, ms, num, record, table

ALIASES = {"llama-3.1-8b": "llama-8b"}
TP_CHOICES = ("auto", "on", "off", "both")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset (or llama-3.1-8b) or HF directory [%(default)s]")
    p.add_argument("--seqs", default="256,512", help="prompt lengths, e.g. 32K,128K,512K [%(default)s]")
    p.add_argument("--batches", default="1,2", help="batch sizes [%(default)s]")
    p.add_argument("--batch-max", default=None, help="run batches > 1 only up to this prompt length (e.g. 32K)")
    p.add_argument("--sdpa-max", default=None, help="run the SDPA prefill peer only up to this length [all]")
    p.add_argument("--eager-max", default=None,
                   help="with the graph on, decode the same prompts op by op beside it only up to this length "
                        "(each costs a second prefill) [all]")
    p.add_argument("--tokens", type=int, default=16, help="timed decode steps [%(default)s]")
    p.add_argument("--warmup", type=int, default=4, help="untimed decode steps first [%(default)s]")
    p.add_argument("--chunk", type=int, default=16384, help="prefill token-wise work per chunk [%(default)s]")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto", help="[%(default)s]")
    p.add_argument("--copy-mib", type=int, default=None, help="bytes of the bandwidth copy (default 4096 GPU, 64 CPU)")
    p.add_argument("--graphs", choices=GRAPH_MODES, default="auto",
                   help="replay the decode step from a CUDA graph (auto: on CUDA); when on, each row also decodes "
                        "without it [%(default)s]")
    p.add_argument("--tp", choices=TP_CHOICES, default=None,
                   help="tensor-parallel decode rows (on), whole-model ones (off), both, or auto (tensor-parallel "
                        "where the shapes divide); one rank: whole-model rows only [both; on with --sliced]")
    p.add_argument("--sliced", action="store_true",
                   help="load only each rank's tensor-parallel slices (implies --tp on)")
    p.add_argument("--kv-cache", choices=tuple(KV_CACHES), default="model",
                   help="the KV cache's dtype: the model's, or fp8 (e4m3, a scale per slot and kv head) [%(default)s]")
    p.add_argument("--gemv", choices=("on", "off"), default="on",
                   help="the decode step's projections through our GEMV kernel on CUDA (on) or cuBLAS (off) "
                        "[%(default)s]")
    p.add_argument("--check", action="store_true",
                   help="first check the decode path on this device (kernel vs float64, graph vs eager vs float64 "
                        "tokens); a failure stops the run")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="profile N decode steps of the last row's case: GPU time per kind of kernel per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default=None, help="record name [decode_<model>_<world><device>]")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--world", type=int, default=1, help="ranks to spawn without torchrun [%(default)s]")
    # one thread: a decode step is many small ops, which a thread pool slows down as soon as another
    # process wants a core (tiny on a busy 2-core box: 1.3 ms/token with one, 34-211 ms with two)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per rank (more only help a machine of idle cores) [%(default)s]")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are stopped")


def _lengths(text):
    return parse_lengths(text)


def validate(args) -> str | None:
    msg = check_spec(ALIASES.get(args.model, args.model), "ours")
    if msg:
        return msg
    try:
        _lengths(args.seqs)
        [int(b) for b in args.batches.split(",")]
        for v in (args.batch_max, args.sdpa_max, args.eager_max):
            if v is not None:
                _lengths(v)
    except ValueError as e:
        return f"{e}"
    if args.tokens < 1 or args.warmup < 0:
        return f"--tokens must be >= 1 and --warmup >= 0, got {args.tokens}, {args.warmup}"
    if args.graphs == "on" and not torch.cuda.is_available():
        return "--graphs on needs a CUDA device"
    if args.sliced and args.tp not in (None, "on", "auto"):
        return f"--sliced holds only tensor-parallel slices: it decodes with --tp on, not --tp {args.tp}"
    if args.threads < 1:
        return f"--threads must be >= 1, got {args.threads}"
    if args.profile < 0:
        return f"--profile must be >= 0 (decode steps to profile), got {args.profile}"
    return None


def copy_bandwidth(device, mib: int) -> float:
    """Bytes per second of a device-to-device copy (read + written), the best of a few."""
    n = mib * (1 << 20) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device=device).fill_(1.0)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        b.copy_(a)
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    del a, b
    return 2 * n * 2 / best


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_bytes(m, B: int, kv_tokens: int, world: int, kv_dtype: str | None = None) -> int:
    """Bytes one decode step of Transformer ``m`` (a whole model, or one rank's tensor-parallel
    slices) reads at least on one rank: its weights but the embedding table (one row per token is
    read there), and this rank's share of the cached K/V (an FP8 cache: a byte a value and a
    float32 scale a row)."""
    w = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if n != "tok_embeddings.weight")
    if m.output is None:  # tied: the LM head reads the embedding table (its vocabulary slice)
        w += head_weight(m).numel() * m.tok_embeddings.weight.element_size() if m.tp else \
            m.tok_embeddings.weight.numel() * m.tok_embeddings.weight.element_size()
    a = m.args
    elem = next(m.parameters()).element_size()
    row = a.head_dim + 4 if kv_dtype == "fp8" else a.head_dim * elem
    kv = 2 * a.n_layers * B * a.n_kv_heads * row * -(-kv_tokens // world)
    return w + kv


def tp_rows(args, model, world: int) -> list[bool]:
    """The tensor-parallel settings the rows decode with (--tp, --sliced), in order."""
    if world == 1:
        return [False]
    if args.sliced or args.tp == "on":
        return [True]
    if args.tp == "off":
        return [False]
    auto = use_tensor_parallel("auto", model, world)  # --tp both (the default) or auto
    return [auto] if args.tp == "auto" else ([True, False] if auto else [False])


def _decode_row(model, ids, args, tp: bool, graphed: bool, bw: float, world: int, group, device) -> dict:
    """One (prompt, batch, tensor-parallel) row: a generate() call (with the graph when on), and the
    same prompts op by op beside it (up to --eager-max)."""
    B, S = ids.shape
    n_new = 1 + args.warmup + args.tokens
    reset_peak(device)
    kv = KV_CACHES[args.kv_cache]
    out = generate(model, ids, n_new, chunk=args.chunk, graphs=args.graphs, tensor_parallel=tp, kv_dtype=kv)
    per = statistics.median(out.timings["decode_step_s"][args.warmup:])
    decoder = model.decoder(group) if tp else model.model
    need = step_bytes(decoder, B, S + args.warmup + args.tokens // 2, world, kv)
    row = dict(S=S, batch=B, tensor_parallel=tp, first_token_s=out.timings["prefill_s"],
               decode_step_s=out.timings["decode_step_s"], decode_s_per_token=per, step_bytes=need, bound_s=need / bw,
               ratio_to_bound=per / (need / bw), shard_slots=out.shard_lengths[-1], graphs=out.timings["graphs"],
               kv_cache=args.kv_cache)
    row["peak_bytes"], row["peak_kind"] = peak_bytes(device)
    if graphed:
        row["graph_capture_s"] = out.timings["graph_capture_s"]
    emax = _lengths(args.eager_max)[0] if args.eager_max else None
    if graphed and (emax is None or S <= emax):  # the same prompts op by op: the graph's gain, and the same tokens
        tokens = out.tokens
        del out
        if device.type == "cuda":
            torch.cuda.empty_cache()
        eager = generate(model, ids, n_new, chunk=args.chunk, graphs="off", tensor_parallel=tp, kv_dtype=kv)
        e_per = statistics.median(eager.timings["decode_step_s"][args.warmup:])
        row.update(eager_first_token_s=eager.timings["prefill_s"], eager_decode_step_s=eager.timings["decode_step_s"],
                   eager_decode_s_per_token=e_per, eager_ratio_to_bound=e_per / (need / bw), graph_speedup=e_per / per,
                   tokens_equal=eager.tokens == tokens)
    return row


# decode-step kernels by kind, first match wins (lower-cased names)
DECODE_KINDS = (
    ("collective", r"nccl"),
    ("attention", r"_split_kernel|_reduce_kernel|decode|flash|attn|fmha"),  # kernels/triton/decode.py
    ("matrix products", r"gemv|gemm|nvjet|cutlass|xmma|sm90_|cublas|splitk|matmul"),
    ("copy", r"memcpy|memset|copy|cat_|catarray|fill"),
)


def _kind(name: str) -> str:
    n = name.lower()
    return next((k for k, rx in DECODE_KINDS if re.search(rx, n)), "element-wise and other")


def step_profile(model, ids, args, tp: bool, device) -> dict:
    """--profile: ``args.profile`` decode steps (after ``args.warmup``) of one generate() call on
    ``ids`` under torch.profiler; per step, the GPU time of each kind of kernel, the kernels
    launched, the union of kernel time and the step's window (``wall_s``: first kernel to last on
    a GPU; the host range elsewhere): the window minus the union is time between kernels."""
    from torch.profiler import ProfilerActivity, profile, schedule

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # the profiler starts only after the prefill, the first step (the CUDA graph's capture: CUPTI
    # active during a capture with NCCL in it failed it on 2 H200s) and the warm-up steps: each
    # generated token advances its schedule (on_tokens), one more step warms the profiler up
    idle = 2 + args.warmup
    plan = schedule(wait=idle, warmup=1, active=args.profile, repeat=1)
    with profile(activities=acts, schedule=plan) as prof:
        generate(model, ids, idle + 1 + args.profile + 1, chunk=args.chunk, graphs=args.graphs, tensor_parallel=tp,
                 kv_dtype=KV_CACHES[args.kv_cache],
                 on_tokens=lambda *_: prof.step())
    cuda = torch.autograd.DeviceType.CUDA
    # a step's window: its range as the GPU ran it (the profiler's GPU-side copy of the host range,
    # from the step's first kernel to its last) where there is one, else the host range (CPU);
    # the host range of a graph's replay ends long before its kernels do
    marks = [e for e in prof.events() if e.name == STEP_LABEL]
    on_gpu = [e for e in marks if e.device_type == cuda]
    steps = sorted((e.time_range.start, e.time_range.end) for e in (on_gpu or marks))
    window = "gpu" if on_gpu else "host"
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in kernel_events(prof.events())]
    per = []
    top: dict[str, list] = {}  # kernel name -> [seconds, calls] over the steps (windows do not overlap)
    for lo, hi in steps:
        mine = [k for k in kernels if lo <= k[1] <= hi]
        kinds: dict[str, float] = {}
        for name, a, b in mine:
            kind = _kind(name)
            kinds[kind] = kinds.get(kind, 0.0) + (b - a) / 1e6
            t = top.setdefault(name[:120], [0.0, 0])
            t[0] += (b - a) / 1e6
            t[1] += 1
        busy = union([(a, b) for _, a, b in mine]) / 1e6
        per.append(dict(wall_s=(hi - lo) / 1e6, busy_s=busy, kernels=len(mine), kinds_s=kinds))
    n = max(len(per), 1)
    mean = lambda key: sum(p[key] for p in per) / n  # noqa: E731
    kinds = sorted({k for p in per for k in p["kinds_s"]})
    return dict(S=ids.shape[1], batch=ids.shape[0], tensor_parallel=tp, steps=len(per), window=window,
                wall_s=mean("wall_s"),
                busy_s=mean("busy_s"), kernels_per_step=mean("kernels") if per else 0,
                kinds_s={k: sum(p["kinds_s"].get(k, 0.0) for p in per) / n for k in kinds},
                top_kernels=[dict(name=k, s_per_step=v[0] / n, calls_per_step=v[1] / n)
                             for k, v in sorted(top.items(), key=lambda kv: -kv[1][0])[:15]], per_step=per)


def run_rank(args) -> dict:
    init = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if init else (0, 1)
    group = dist.group.WORLD if init else None
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = resolve_dtype(args.dtype, device)
    spec = ALIASES.get(args.model, args.model)

    log = RankLog("bench decode", rank, clock=None)

    graphed = use_graphs(args.graphs, device)
    projection.set_gemv(args.gemv == "on")
    check = None
    if args.check:
        from ..checks.decode_check import check as check_decode  # the check's small models: only with --check

        check = check_decode(device, log)
        if not check["ok"]:
            write_record((args.name or f"decode_{args.model}_{world}{device.type}") + "_check_failed",
                         dict(kind="decode", check=check), args.out_dir)
            raise SystemExit(1)
    t0 = time.perf_counter()
    model = load_model(spec, "ours", device, dtype, args.seed, tp_group=group if args.sliced and world > 1 else None)
    log(f"{model.describe} on {world} rank(s), {device}, {dtype} (made in {time.perf_counter() - t0:.1f}s)")
    bw = copy_bandwidth(device, args.copy_mib or (4096 if device.type == "cuda" else 64))
    log(f"device-to-device copy bandwidth {bw / 1e9:.0f} GB/s")
    seqs, batches = _lengths(args.seqs), [int(b) for b in args.batches.split(",")]
    bmax = _lengths(args.batch_max)[0] if args.batch_max else None
    smax = _lengths(args.sdpa_max)[0] if args.sdpa_max else None
    tps = tp_rows(args, model, world)
    g = torch.Generator().manual_seed(args.seed + 1)
    # warm-up, kernels chosen / compiled at short lengths (the decode step's fused ops for each batch,
    # each way the step runs; prefill compiles its own for any length from the first call)
    shapes = [(1, 256), (1, 384)] + ([(2, 384)] if max(batches) > 1 else [])
    for b, n in shapes:
        warm = torch.randint(0, model.vocab_size, (b, n), generator=g)
        for tp in tps:
            generate(model, warm, 2, chunk=args.chunk, graphs=args.graphs, tensor_parallel=tp,
                     kv_dtype=KV_CACHES[args.kv_cache])
            if graphed:
                generate(model, warm, 2, chunk=args.chunk, graphs="off", tensor_parallel=tp,
                         kv_dtype=KV_CACHES[args.kv_cache])
        if world == 1 and b == 1:
            generate(model, warm, 1, attention="sdpa", chunk=args.chunk)
    rows = []
    name = args.name or f"decode_{args.model}_{world}{device.type}"
    payload = dict(kind="decode", model=args.model, describe=model.describe, world=world, dtype=str(dtype),
                   copy_bandwidth_Bps=bw, graphs=graphed, gemv=args.gemv, sliced=model.sliced,
                   threads=torch.get_num_threads(),
                   rows=rows)
    if check is not None:
        payload["check"] = check
    path = None  # the first write picks a free name; later rows rewrite that file
    for S in seqs:
        for B in batches:
            if B > 1 and bmax is not None and S > bmax:
                continue
            ids = torch.randint(0, model.vocab_size, (B, S), generator=g)
            for tp in tps:
                try:
                    row = _decode_row(model, ids, args, tp, graphed, bw, world, group, device)
                    if tp is tps[-1] and B == 1 and world == 1 and (smax is None or S <= smax):
                        peer = generate(model, ids, 1, attention="sdpa", chunk=args.chunk)
                        row["sdpa_first_token_s"] = peer.timings["prefill_s"]
                        row["first_token_vs_sdpa"] = row["first_token_s"] / row["sdpa_first_token_s"]
                        del peer
                except torch.OutOfMemoryError as e:
                    row = dict(S=S, batch=B, tensor_parallel=tp, error=f"OOM: {str(e).splitlines()[0][:160]}")
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                rows.append(row)
                _log_row(log, row)
                if rank == 0:  # one record per launch, rewritten after each row (a timeout keeps the rows done)
                    path = write_record(name, payload, args.out_dir, path=path)
    if args.profile and rows and "error" not in rows[-1]:
        last = rows[-1]
        if device.type == "cuda":
            torch.cuda.empty_cache()
        ids = torch.randint(0, model.vocab_size, (last["batch"], last["S"]), generator=g)
        prof = step_profile(model, ids, args, last["tensor_parallel"], device)
        payload["profile"] = prof
        kinds = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in prof["kinds_s"].items())
        log(f"profile S={prof['S']} B={prof['batch']}{' tensor-parallel' if prof['tensor_parallel'] else ''}: "
            f"{prof['wall_s'] * 1e3:.2f} ms a step, kernels busy {prof['busy_s'] * 1e3:.2f} ms "
            f"({prof['kernels_per_step']:.0f} kernels): {kinds} ms")
        if rank == 0:
            path = write_record(name, payload, args.out_dir, path=path)
    if rank == 0:
        log(f"wrote {path}")
    return payload


def _log_row(log, row: dict) -> None:
    tp = " tensor-parallel" if row.get("tensor_parallel") else ""
    where = f"S={row['S']} B={row['batch']}{tp}"
    if "error" in row:
        log(f"{where}: {row['error']}")
        return
    sd = f", SDPA prefill {row['sdpa_first_token_s']:.3f}s" if "sdpa_first_token_s" in row else ""
    eg = ""
    if "eager_decode_s_per_token" in row:
        eg = (f" with the CUDA graph, {row['eager_decode_s_per_token'] * 1e3:.2f} ms op by op "
              f"(x{row['eager_ratio_to_bound']:.2f}; graph {row['graph_speedup']:.2f}x faster; tokens "
              f"{'equal' if row['tokens_equal'] else 'DIFFER'})")
    log(f"{where}: first token {row['first_token_s']:.3f}s{sd}; decode {row['decode_s_per_token'] * 1e3:.2f} ms/token"
        f"{eg}, bound {row['bound_s'] * 1e3:.2f} ms (x{row['ratio_to_bound']:.2f}); peak "
        f"{row['peak_bytes'] / 2**30:.1f} GiB ({row['peak_kind']})")


def _entry(args) -> int:
    payload = run_rank(args)
    differ = [(r["S"], r["batch"]) for r in payload["rows"] if r.get("tokens_equal") is False]
    if differ:
        print(f"[bench decode] the greedy tokens with and without the CUDA graph differ at (S, batch) {differ}",
              file=sys.stderr, flush=True)
        return 1
    return 0


build_parser, main = ranked_bench("decode", __doc__, add_arguments, _entry, validate)


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    graphs = rec.get("graphs")
    split = any(r.get("tensor_parallel") for r in rec["rows"])  # tensor-parallel rows beside whole-model ones
    head = [f"{rec['describe']}; {rec['world']} rank(s), {rec['dtype'].replace('torch.', '')}; device-to-device copy "
            f"bandwidth {rec['copy_bandwidth_Bps'] / 1e9:,.0f} GB/s measured in the launch. Decode time per token is "
            "the median of the timed steps; the bound reads one rank's KV cache shard and weights once per token at "
            "that bandwidth." + (" Decode steps replayed from a CUDA graph; the same prompts decoded op by op in a "
                                 "second call (whose prefill gives the second first-token time: nothing left to "
                                 "allocate or compile)." if graphs else "")
            + (" TP: the decode step tensor-parallel over the ranks (each reads its slice of the weights)."
               if split else ""), ""]
    body = []
    for r in rec["rows"]:
        lead = [r["S"], r["batch"]] + (["yes" if r.get("tensor_parallel") else "no"] if split else [])
        if "error" in r:
            body.append(lead + [r["error"]] + ["—"] * (7 if graphs else 5))
            continue
        sdpa = r.get("sdpa_first_token_s")
        first = fixed(r["first_token_s"], 2)
        eager = "eager_decode_s_per_token" in r  # not past --eager-max
        if graphs:
            first += f" / {fixed(r['eager_first_token_s'], 2)}" if eager else ""
        row = lead + [first, fixed(sdpa, 2) if sdpa else "—",
                      ms(r["decode_s_per_token"]) + ("" if r.get("graphs", True) else " (op by op: capture failed)")]
        if graphs:
            row.append(ms(r["eager_decode_s_per_token"]) if eager else "—")
        row += [ms(r["bound_s"]), f"{r['ratio_to_bound']:.2f}×", fixed(r["peak_bytes"] / 2**30, 1)]
        if graphs:
            row.insert(-1, ("yes" if r["tokens_equal"] else "NO") if eager else "—")
        body.append(row)
    cols = ["prompt tokens", "batch"] + (["TP"] if split else [])
    cols += ["first token s" + (" (first / again)" if graphs else ""), "SDPA prefill s",
             "decode ms/token" + (" (graph)" if graphs else "")]
    cols += ["op by op ms/token"] if graphs else []
    cols += ["bound ms/token", "× bound"] + (["same tokens"] if graphs else []) + ["peak GiB"]
    out = head + table(cols, body)
    prof = rec.get("profile")
    if prof and prof["steps"] and prof.get("window"):  # (earlier profiles double-counted: their note says)
        out += ["", f"Profiled ({prof['steps']} steps at {prof['S']} tokens, batch {prof['batch']}"
                f"{', tensor-parallel' if prof['tensor_parallel'] else ''}): {ms(prof['wall_s'])} ms a step, kernels "
                f"busy {ms(prof['busy_s'])} ms of it, {prof['kernels_per_step']:.0f} kernels a step. GPU time per "
                "step by kind of kernel:", ""]
        out += table(["kind", "ms per step", "share of the step"],
                     [[k, ms(v), f"{100 * v / prof['wall_s']:.1f}%"]
                      for k, v in sorted(prof["kinds_s"].items(), key=lambda kv: -kv[1])])
    return out


def block_decode_graphs(records):
    """docs/inference.md: the decode step's CUDA graph and kernel on one GPU, from the records."""
    chk = record(records, "decode_8b_graphs.json")["check"]
    runs = [("decode_8b_h200_graphs2.json", record(records, "decode_8b_h200_graphs2.json")),
            ("decode_8b_h200_graphs.json", record(records, "decode_8b_h200_graphs.json"))]
    att = chk["attention"]
    seen, body = set(), []
    for name, rec in runs:
        for r in rec["rows"]:
            if "error" in r or (r["S"], r["batch"]) in seen:
                continue
            seen.add((r["S"], r["batch"]))
            sdpa = r.get("sdpa_first_token_s")
            body.append([f"{r['S'] // 1024}K", r["batch"], ms(r["decode_s_per_token"]), ms(r["eager_decode_s_per_token"]),
                         ms(r["bound_s"]), f"{r['ratio_to_bound']:.2f}×",
                         f"{fixed(r['eager_first_token_s'], 2)} / {fixed(sdpa, 2)}" if sdpa else "—",
                         "yes" if r["tokens_equal"] else "NO", f"`{name}`"])
    body.sort(key=lambda row: (int(row[0][:-1]), row[1]))
    dev = device_of(runs[0][1])
    toks = chk["tokens"]
    head = (f"On {dev}, {runs[0][1]['describe'].split(':')[0]} with Llama-3.1-8B's shape: `bench decode --check` passed "
            f"({len(att)} kernel cases within {num(max(r['out_err'] for r in att))} of float64; with and without the "
            f"graph the float32 model chose float64's tokens and bf16 the same tokens both ways, "
            f"{sum(len(t['lengths']) for t in toks)} prompts, windows {', '.join(str(t['window']) for t in toks)}; "
            "`decode_8b_graphs.json`). Decode per token with the graph, op by op, and the bound of reading the "
            "weights and the KV cache once at the copy bandwidth measured in the launch; first token of a second "
            "prefill (warm) beside plain SDPA's:")
    return "\n".join([head, ""] + table(["prompt", "batch", "graph ms", "op by op ms", "bound ms", "× bound",
                                         "first token s (ours / SDPA)", "same tokens", "record"], body))


RANK_RUNS = ("decode_8b_2gpu_128k.json", "decode_8b_2gpu_512k.json", "decode_8b_2gpu_128k_b8.json",
             "decode_8b_2gpu_128k_tiles.json", "decode_8b_2gpu_512k_tiles.json", "decode_8b_2gpu_1m_raw.json",
             "decode_8b_2gpu_128k_b8_cuts.json", "decode_8b_4gpu_128k.json", "decode_8b_4gpu_1m.json",
             "decode_8b_4gpu_128k_cuts.json", "decode_8b_4gpu_128k_b8_cuts.json", "decode_8b_2gpu_128k_hostfree.json",
             "decode_8b_2gpu_512k_hostfree.json", "decode_8b_4gpu_1m_cuts.json", "decode_8b_2gpu_128k_heads.json")
# the decode step's kernel cuts (packed projections, compiled merge and gather, the GEMV kernel):
# (launch, what ran, record); each launch times the step before and after them on the same machine
STEP_RUNS = (("1 GPU", "before (93b8049)", "decode_8b_1gpu_128k_before.json"),
             ("1 GPU", "after, cuBLAS projections", "decode_8b_1gpu_128k_gemv_off.json"),
             ("1 GPU", "after, GEMV kernel (first tiles)", "decode_8b_1gpu_128k_gemv_on.json"),
             ("2 ranks, call 1", "before (93b8049)", "decode_8b_2gpu_128k_before.json"),
             ("2 ranks, call 1", "after, GEMV kernel (first tiles)", "decode_8b_2gpu_128k_gemv_on.json"),
             ("2 ranks, call 1", "before (93b8049)", "decode_8b_2gpu_512k_before.json"),
             ("2 ranks, call 1", "after, GEMV kernel (first tiles)", "decode_8b_2gpu_512k_gemv_on.json"),
             ("2 ranks, call 2", "after, cuBLAS projections", "decode_8b_2gpu_128k_gemv_off.json"),
             ("2 ranks, call 2", "after, GEMV kernel (swept tiles)", "decode_8b_2gpu_128k_tiles.json"),
             ("2 ranks, call 2", "after, GEMV kernel (swept tiles)", "decode_8b_2gpu_512k_tiles.json"),
             ("2 ranks, call 3", "before (93b8049)", "decode_8b_2gpu_128k_before2.json"),
             ("2 ranks, call 3", "after, q/k roped in the gather", "decode_8b_2gpu_128k_raw.json"),
             ("2 ranks, call 3", "after, q/k roped in the gather", "decode_8b_2gpu_1m_raw.json"),
             ("2 ranks, call 4", "host waits for each token (3c03e61)", "decode_8b_2gpu_128k_hostfree_before.json"),
             ("2 ranks, call 4", "host out of the loop", "decode_8b_2gpu_128k_hostfree.json"),
             ("2 ranks, call 4", "host waits for each token (3c03e61)", "decode_8b_2gpu_512k_hostfree_before.json"),
             ("2 ranks, call 4", "host out of the loop", "decode_8b_2gpu_512k_hostfree.json"),
             ("2 ranks, call 5", "before (929b1a0)", "decode_8b_2gpu_128k_fused_before.json"),
             ("2 ranks, call 5", "heads kernel, packed merge send, SwiGLU in the GEMV", "decode_8b_2gpu_128k_fused.json"),
             ("2 ranks, call 5", "before (929b1a0)", "decode_8b_2gpu_512k_fused_before.json"),
             ("2 ranks, call 5", "heads kernel, packed merge send, SwiGLU in the GEMV", "decode_8b_2gpu_512k_fused.json"),
             ("2 ranks, call 6", "before (929b1a0)", "decode_8b_2gpu_128k_heads_before.json"),
             ("2 ranks, call 6", "heads kernel, packed merge send", "decode_8b_2gpu_128k_heads.json"),
             ("1 GPU, stop 54", "today's step (e7547f8: packed out/lse)", "decode_8b_1gpu_today.json"))


def block_decode_ranks(records):
    """docs/inference.md: decode over several ranks (the cache sharded by sequence; tensor-parallel
    projections or whole weights on every rank), each row beside its bound, from the records."""
    body = []
    for name in RANK_RUNS:
        rec = record(records, name)
        for r in rec["rows"]:
            if "error" in r:
                continue
            body.append([f"{rec['world']} × {device_of(rec).split('× ')[-1]}", f"{r['S'] // 1024}K × {r['batch']}",
                         ("tensor-parallel" if r["tensor_parallel"] else "whole on every rank")
                         # a capture that failed on every try under graphs="auto": timed op by op
                         + ("" if r.get("graphs", True) else " (op by op: capture failed)"),
                         ms(r["decode_s_per_token"]), ms(r["bound_s"]), f"{r['ratio_to_bound']:.2f}×",
                         fixed(r["first_token_s"], 1), f"`{name}` ({rec['commit'][:7]})"])
    return "\n".join(["Decode of llama-3.1-8b's shape (random weights, bf16, CUDA graph unless a row says) over several "
                      "ranks: per token, the bound of one rank reading its weights and its cache shard once at the copy "
                      "bandwidth measured in the launch, and the first token (the prompt's prefill):", ""]
                     + table(["ranks", "prompt × batch", "weights", "ms/token", "bound ms", "× bound", "first token s",
                              "record"], body))


def block_decode_step(records):
    """docs/inference.md: the decode step before and after its kernel cuts, each launch's rows
    side by side (llama-3.1-8b, batch 1, CUDA graph; tensor-parallel with sliced weights on 2 ranks)."""
    body = []
    for launch, what, name in STEP_RUNS:
        rec = record(records, name)
        r = rec["rows"][0]
        body.append([launch, device_of(rec).split("× ")[-1], f"{r['S'] // 1024}K", what,
                     ms(r["decode_s_per_token"]), ms(r["bound_s"]), f"{r['ratio_to_bound']:.2f}×",
                     f"`{name}` ({rec['commit'][:7]})"])
    return "\n".join(table(["launch", "card", "prompt", "step", "ms/token", "bound ms", "× bound", "record"], body))


# the FP8 cache's decode steps beside bf16's, each pair one launch: (what, bf16 record, FP8 record)
FP8_STEPS = (("FP8 tiles widened to bf16, 64-row tiles", "decode_8b_2gpu_128k_kvbf16.json",
              "decode_8b_2gpu_128k_kvfp8.json"),
             ("FP8 tiles widened to fp16, 128-row tiles (now)", "decode_8b_2gpu_128k_kvbf16b.json",
              "decode_8b_2gpu_128k_kvfp8b.json"))
FP8_KERNELS = (("bf16 cache", "bf16"), ("FP8, to bf16, 64 rows", "fp8 widen=q bn=64 warps=4"),
               ("FP8, to fp16, 128 rows (now)", "fp8 widen=f16 bn=128 warps=4"))


def block_decode_fp8(records):
    """docs/inference.md: the FP8 KV cache's decode kernel and step beside the bf16 cache's."""
    name = "decode_fp8_h200.json"
    rec = record(records, name)
    got = {(r["capacity"], r["batch"], r["kernel"]): r for r in rec["rows"] if "us" in r}
    body = []
    for cap, B in dict.fromkeys((r["capacity"], r["batch"]) for r in rec["rows"]):
        cells = []
        for _, k in FP8_KERNELS:
            r = got.get((cap, B, k))
            cells.append("—" if r is None else f"{r['us']:.0f}" + (f" ({num(r['out_err'])})" if "out_err" in r else ""))
        body.append([f"{cap // 1024}K", B] + cells)
    steps = []
    for what, b16, f8 in FP8_STEPS:
        rb, rf = record(records, b16)["rows"][0], record(records, f8)["rows"][0]
        steps.append([what, ms(rb["decode_s_per_token"]), ms(rf["decode_s_per_token"]), ms(rf["bound_s"]),
                      f"{rf['ratio_to_bound']:.2f}×", f"{rb['decode_s_per_token'] / rf['decode_s_per_token']:.2f}×",
                      f"`{b16}`, `{f8}` ({record(records, f8)['commit'][:7]})"])
    return "\n".join([f"The decode kernel on one layer of llama-3.1-8b's shape (32 q / 8 kv heads, d=128, bf16 queries) "
                      f"on {device_of(rec).split('× ')[-1]} (`{name}`, commit {rec['commit'][:7]}): µs a call, host "
                      "launch included (the 32K rows are mostly host time), and in brackets the output's error against "
                      "float64 over the dequantized cache where checked:", ""]
                     + table(["slots", "batch"] + [h for h, _ in FP8_KERNELS], body)
                     + ["", "The whole step, 2 ranks tensor-parallel, 128K prompt, batch 1, CUDA graph (each pair two "
                            "launches in one device call; the bound is the FP8 cache's bytes):", ""]
                     + table(["FP8 kernel", "bf16 ms/token", "FP8 ms/token", "FP8 bound ms", "FP8 × bound",
                              "FP8 speed-up", "records"], steps))


PROFILE_RUNS = ("decode_8b_2gpu_128k_profile2.json", "decode_8b_2gpu_128k_profile4.json")


def block_decode_profile(records):
    """docs/inference.md: where a graphed tensor-parallel decode step's time goes (bench decode
    --profile), beside its bound: each profile of PROFILE_RUNS in turn (before and after a cut)."""
    out = []
    for name in PROFILE_RUNS:
        rec = record(records, name)
        p, r = rec["profile"], rec["rows"][-1]
        kinds = sorted(p["kinds_s"].items(), key=lambda kv: -kv[1])
        top = [[f"`{t['name'][:60]}`", ms(t["s_per_step"]), f"{t['calls_per_step']:g}"] for t in p["top_kernels"][:6]]
        out += ([f"`bench decode --profile`, {r['S'] // 1024}K × {r['batch']}, {rec['world']} ranks tensor-parallel, "
                 f"CUDA graph, on {device_of(rec)} (`{name}`, {rec['commit'][:7]}): a step's GPU window "
                 f"{ms(p['wall_s'])} ms, kernels busy {ms(p['busy_s'])} ms over {p['kernels_per_step']:g} "
                 f"kernels; the bound {ms(r['bound_s'])} ms. By kind (ms a step): "
                 + ", ".join(f"{k} {ms(v)}" for k, v in kinds) + ".", ""]
                + table(["kernel", "ms a step", "calls a step"], top) + [""])
    return "\n".join(out[:-1])


SECTIONS = (Section("Decode against the sharded KV cache", r"^decode_", render,
                    "`burstengine bench decode`: first-token latency beside plain SDPA prefill, decode time per "
                    "token beside the HBM-bandwidth bound."),)
BLOCKS = {"decode-graphs": block_decode_graphs, "decode-ranks": block_decode_ranks, "decode-step": block_decode_step,
          "decode-fp8": block_decode_fp8, "decode-profile": block_decode_profile}
