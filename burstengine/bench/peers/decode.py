"""`burstengine bench decode`: generation on one device (or a CP group): first-token latency of our
prefill beside plain SDPA prefill of the same model, decode time per token beside the bound
that HBM bandwidth sets, peak memory.

    burstengine bench decode --model tiny --seqs 256,512 --batches 1,2 --world 1        # CPU, seconds
    torchrun --nproc_per_node 1 -m burstengine bench decode --model llama-3.1-8b \\
        --seqs 32K,128K --batches 1,8 --batch-max 32K --sdpa-max 128K

For every prompt length S and batch B (B > 1 only up to --batch-max), one generate() call
prefills B random prompts of S tokens and decodes --warmup + --tokens steps: its prefill time is
the first-token latency (prompt on the device -> first token chosen, cache allocation
included), the median of the last --tokens steps the decode time per token.  With --graphs on
(auto: on CUDA with one rank) that call replays the decode step from a CUDA graph (its capture,
at the first step, is recorded apart and not counted), and a second call on the same prompts
decodes op by op: the row records both times, their ratio and whether the two calls chose the
same greedy tokens (a run where they differ exits 1).  At B = 1 and
S <= --sdpa-max a second call with plain SDPA prefill (world 1 only) gives the peer's
first-token latency.  The bound of a decode step is the bytes it must read once, every
weight but the embedding table plus every cached K and V of the B sequences, over the
device-to-device copy bandwidth measured in the same launch (a large tensor copied, read +
written bytes / time).  Each row records its raw times, and the record (command, commit,
device, versions) is rewritten after every row, so an interrupted run keeps what it measured.

--check first checks the decode path on this device in seconds (bench/checks/decode_check.py: the
decode attention kernel against float64, and a small model's greedy tokens with and without the
graph against the float64 model's), records it, and stops with exit 1 if anything fails.

--model: a preset (random weights made directly on the device, no HF directory needed;
"llama-3.1-8b" is Llama-3.1-8B's shape without its rope scaling, which does not change the
time) or a local HF directory.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ...inference.engine import peak_bytes, reset_peak
from ...inference.generate import generate
from ...inference.models import check_spec, load_model, resolve_dtype
from ...inference.needle import parse_lengths
from ...inference.step import MODES as GRAPH_MODES, use_graphs
from ..harness import RankLog, ranked_bench
from ..records import OUT_DIR_HELP, write_record
from ..tables import Section, device_of, fixed, ms, num, record, table

ALIASES = {"llama-3.1-8b": "llama-8b"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset (or llama-3.1-8b) or HF directory [%(default)s]")
    p.add_argument("--seqs", default="256,512", help="prompt lengths, e.g. 32K,128K,512K [%(default)s]")
    p.add_argument("--batches", default="1,2", help="batch sizes [%(default)s]")
    p.add_argument("--batch-max", default=None, help="run batches > 1 only up to this prompt length (e.g. 32K)")
    p.add_argument("--sdpa-max", default=None, help="run the SDPA prefill peer only up to this length [all]")
    p.add_argument("--tokens", type=int, default=16, help="timed decode steps [%(default)s]")
    p.add_argument("--warmup", type=int, default=4, help="untimed decode steps first [%(default)s]")
    p.add_argument("--chunk", type=int, default=16384, help="prefill token-wise work per chunk [%(default)s]")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto", help="[%(default)s]")
    p.add_argument("--copy-mib", type=int, default=None, help="bytes of the bandwidth copy (default 4096 GPU, 64 CPU)")
    p.add_argument("--graphs", choices=GRAPH_MODES, default="auto",
                   help="replay the decode step from a CUDA graph (auto: on CUDA with one rank); when on, each row "
                        "also decodes without it [%(default)s]")
    p.add_argument("--check", action="store_true",
                   help="first check the decode path on this device (kernel vs float64, graph vs eager vs float64 "
                        "tokens); a failure stops the run")
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
        for v in (args.batch_max, args.sdpa_max):
            if v is not None:
                _lengths(v)
    except ValueError as e:
        return f"{e}"
    if args.tokens < 1 or args.warmup < 0:
        return f"--tokens must be >= 1 and --warmup >= 0, got {args.tokens}, {args.warmup}"
    if args.graphs == "on" and (args.world > 1 or not torch.cuda.is_available()):
        return "--graphs on needs one rank on a CUDA device (with more ranks the decode step runs op by op)"
    if args.threads < 1:
        return f"--threads must be >= 1, got {args.threads}"
    if args.check and args.world > 1:
        return "--check runs on one rank (--world 1)"
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


def step_bytes(model, B: int, kv_tokens: int, world: int) -> int:
    """Bytes one decode step reads at least on one rank: every weight but the embedding table
    (one row per token is read there), and this rank's share of the cached K/V."""
    m = model.model
    w = sum(p.numel() * p.element_size() for n, p in m.named_parameters() if n != "tok_embeddings.weight")
    if m.output is None:  # tied: the LM head reads the embedding table
        w += m.tok_embeddings.weight.numel() * m.tok_embeddings.weight.element_size()
    a = m.args
    elem = next(m.parameters()).element_size()
    kv = 2 * a.n_layers * B * a.n_kv_heads * a.head_dim * elem * -(-kv_tokens // world)
    return w + kv


def run_rank(args) -> dict:
    init = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if init else (0, 1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = resolve_dtype(args.dtype, device)
    spec = ALIASES.get(args.model, args.model)

    log = RankLog("bench decode", rank, clock=None)

    graphed = use_graphs(args.graphs, device, world)
    check = None
    if args.check:
        from ..checks.decode_check import check as check_decode  # the check's small models: only with --check

        check = check_decode(device, log)
        if not check["ok"]:
            write_record((args.name or f"decode_{args.model}_{world}{device.type}") + "_check_failed",
                         dict(kind="decode", check=check), args.out_dir)
            raise SystemExit(1)
    t0 = time.perf_counter()
    model = load_model(spec, "ours", device, dtype, args.seed)
    log(f"{model.describe} on {world} rank(s), {device}, {dtype} (made in {time.perf_counter() - t0:.1f}s)")
    bw = copy_bandwidth(device, args.copy_mib or (4096 if device.type == "cuda" else 64))
    log(f"device-to-device copy bandwidth {bw / 1e9:.0f} GB/s")
    seqs, batches = _lengths(args.seqs), [int(b) for b in args.batches.split(",")]
    bmax = _lengths(args.batch_max)[0] if args.batch_max else None
    smax = _lengths(args.sdpa_max)[0] if args.sdpa_max else None
    g = torch.Generator().manual_seed(args.seed + 1)
    # warm-up, kernels chosen / compiled at short lengths: torch.compile specialises the fused ops
    # (model/fused.py) on the first shape and compiles a dynamic kernel at the next one that
    # differs, in length or in batch; without these the first row's first-token time held ~3 s
    # of compiling (an 8B at 32K on an H200: 4.36 s, 1.31 s in the same row's second call)
    shapes = [(1, 256), (1, 384)] + ([(2, 384)] if max(batches) > 1 else [])
    for b, n in shapes:
        warm = torch.randint(0, model.vocab_size, (b, n), generator=g)
        generate(model, warm, 2, chunk=args.chunk, graphs=args.graphs)
        if graphed:
            generate(model, warm, 2, chunk=args.chunk, graphs="off")
        if world == 1 and b == 1:
            generate(model, warm, 1, attention="sdpa", chunk=args.chunk)
    rows = []
    name = args.name or f"decode_{args.model}_{world}{device.type}"
    payload = dict(kind="decode", model=args.model, describe=model.describe, world=world, dtype=str(dtype),
                   copy_bandwidth_Bps=bw, graphs=graphed, threads=torch.get_num_threads(), rows=rows)
    if check is not None:
        payload["check"] = check
    path = None  # the first write picks a free name; later rows rewrite that file
    for S in seqs:
        for B in batches:
            if B > 1 and bmax is not None and S > bmax:
                continue
            row = dict(S=S, batch=B)
            ids = torch.randint(0, model.vocab_size, (B, S), generator=g)
            try:
                reset_peak(device)
                n_new = 1 + args.warmup + args.tokens
                out = generate(model, ids, n_new, chunk=args.chunk, graphs=args.graphs)
                per = statistics.median(out.timings["decode_step_s"][args.warmup:])
                need = step_bytes(model, B, S + args.warmup + args.tokens // 2, world)
                row.update(first_token_s=out.timings["prefill_s"], decode_step_s=out.timings["decode_step_s"],
                           decode_s_per_token=per, step_bytes=need, bound_s=need / bw, ratio_to_bound=per / (need / bw),
                           shard_slots=out.shard_lengths[-1], graphs=out.timings["graphs"])
                row["peak_bytes"], row["peak_kind"] = peak_bytes(device)
                if graphed:  # the same prompts op by op: the graph's gain, and the same tokens
                    row["graph_capture_s"] = out.timings["graph_capture_s"]
                    tokens = out.tokens
                    del out
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    eager = generate(model, ids, n_new, chunk=args.chunk, graphs="off")
                    e_per = statistics.median(eager.timings["decode_step_s"][args.warmup:])
                    row.update(eager_first_token_s=eager.timings["prefill_s"],
                               eager_decode_step_s=eager.timings["decode_step_s"], eager_decode_s_per_token=e_per,
                               eager_ratio_to_bound=e_per / (need / bw), graph_speedup=e_per / per,
                               tokens_equal=eager.tokens == tokens)
                    del eager
                else:
                    del out
                if B == 1 and world == 1 and (smax is None or S <= smax):
                    peer = generate(model, ids, 1, attention="sdpa", chunk=args.chunk)
                    row["sdpa_first_token_s"] = peer.timings["prefill_s"]
                    row["first_token_vs_sdpa"] = row["first_token_s"] / row["sdpa_first_token_s"]
                    del peer
            except torch.OutOfMemoryError as e:
                row["error"] = f"OOM: {str(e).splitlines()[0][:160]}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
            if "error" in row:
                log(f"S={S} B={B}: {row['error']}")
            else:
                sd = f", SDPA prefill {row['sdpa_first_token_s']:.3f}s" if "sdpa_first_token_s" in row else ""
                eg = ""
                if "eager_decode_s_per_token" in row:
                    eg = (f" with the CUDA graph, {row['eager_decode_s_per_token'] * 1e3:.2f} ms op by op "
                          f"(x{row['eager_ratio_to_bound']:.2f}; graph {row['graph_speedup']:.2f}x faster; tokens "
                          f"{'equal' if row['tokens_equal'] else 'DIFFER'})")
                log(f"S={S} B={B}: first token {row['first_token_s']:.3f}s{sd}; decode "
                    f"{row['decode_s_per_token'] * 1e3:.2f} ms/token{eg}, bound {row['bound_s'] * 1e3:.2f} ms "
                    f"(x{row['ratio_to_bound']:.2f}); peak {row['peak_bytes'] / 2**30:.1f} GiB ({row['peak_kind']})")
            if rank == 0:  # one record per launch, rewritten after each row (a timeout keeps the rows done)
                path = write_record(name, payload, args.out_dir, path=path)
    if rank == 0:
        log(f"wrote {path}")
    return payload


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
    head = [f"{rec['describe']}; {rec['world']} rank(s), {rec['dtype'].replace('torch.', '')}; device-to-device copy "
            f"bandwidth {rec['copy_bandwidth_Bps'] / 1e9:,.0f} GB/s measured in the launch. Decode time per token is "
            "the median of the timed steps; the bound reads the KV cache and the weights once per token at that "
            "bandwidth." + (" Decode steps replayed from a CUDA graph; the same prompts decoded op by op in a second "
                            "call (whose prefill gives the second first-token time: nothing left to allocate or "
                            "compile)." if graphs else ""), ""]
    body = []
    for r in rec["rows"]:
        if "error" in r:
            body.append([r["S"], r["batch"], r["error"]] + ["—"] * (7 if graphs else 5))
            continue
        sdpa = r.get("sdpa_first_token_s")
        first = fixed(r["first_token_s"], 2)
        if graphs:
            first += f" / {fixed(r['eager_first_token_s'], 2)}"
        row = [r["S"], r["batch"], first, fixed(sdpa, 2) if sdpa else "—", ms(r["decode_s_per_token"])]
        if graphs:
            row.append(ms(r["eager_decode_s_per_token"]))
        row += [ms(r["bound_s"]), f"{r['ratio_to_bound']:.2f}×", fixed(r["peak_bytes"] / 2**30, 1)]
        if graphs:
            row.insert(-1, "yes" if r.get("tokens_equal") else "NO")
        body.append(row)
    cols = ["prompt tokens", "batch", "first token s" + (" (first / again)" if graphs else ""), "SDPA prefill s",
            "decode ms/token" + (" (graph)" if graphs else "")]
    cols += ["op by op ms/token"] if graphs else []
    cols += ["bound ms/token", "× bound"] + (["same tokens"] if graphs else []) + ["peak GiB"]
    return head + table(cols, body)


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


SECTIONS = (Section("Decode against the sharded KV cache", r"^decode_", render,
                    "`burstengine bench decode`: first-token latency beside plain SDPA prefill, decode time per "
                    "token beside the HBM-bandwidth bound."),)
BLOCKS = {"decode-graphs": block_decode_graphs}
