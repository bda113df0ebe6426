"""First-token latency of LLaMA prefill beside its peers (BurstAttention paper, Tables 2-3).

    torchrun --nproc_per_node 4 -m burstengine bench prefill --models 7b,13b \\
        --seqs 32768,65536,131072,262144,524288,1048576
    burstengine bench prefill --world 2 --models tiny --seqs 256,512    # CPU/gloo check

One launch, the same random weights (seeded per parameter), the same prompt, bf16 on GPUs:

* ``burst``: burstengine's LLaMA, sequence sharded zigzag, BurstAttention (``burst-<layout>``
  for another layout);
* ``torch-cp``: the same model and shards, attention through SDPA under torch-native context
  parallelism (``context_parallel``, its head-tail balancing is our zigzag); CUDA only;
* ``megatron-v3`` / ``megatron-v1``: Megatron-style tensor parallelism of the same weights
  (:mod:`.tp_llama`), with sequence parallelism (all-gather / reduce-scatter) or without
  (all-reduce).

Every case times the whole prefill (token ids in, next-token logits on every rank out; median
of --iters after --warmup, slowest rank; once a method takes over --long seconds, its longer
cases run once), records the peak allocated memory and compares its logits with ``burst``'s.
With --cold or --warmup 0 each method first runs once at a short length (untimed: the process,
NCCL and the kernels warm; ``warmed_at`` in its first row), so no method pays for what the next
one reuses.  With --cold the first call at each length is timed on its own beside the warm median:
what a served prompt of a new length pays (``first_s``, ``first_vs_warm``; the issue's target is
1.1x).  The record is rewritten after every case, so a run stopped by a timeout keeps its rows.
With --profile each method that ran at the last length makes one more call there, after its
timed ones, under torch.profiler (every rank; rank 0's numbers kept): the row's ``profile``
holds the call's wall time, the time some kernel ran (the union of their intervals; on CPU the
calling thread's ops), the host gaps (wall minus busy), each kind of kernel's time (the categories of
``bench profile``), the --top kernels, and per kind of collective its kernel time and the part
no computing kernel covers (exposed); rank 0 prints each one's breakdown after the tables.
With --efficiency each BurstEngine row that ran (``burst``, ``burst-fp8``, ``burst-<layout>``;
not the peers) is rated against the single-GPU speeds, measured on rank 0's device after every
method of the model has run (the other ranks wait): ``ideal_s`` = (attention FLOPs / W) / (the
attention speed) + (dense FLOPs / W) / (the matmul speed) on W ranks, and ``parallel_efficiency``
= ideal_s / the warm median (``first_parallel_efficiency``: / the first call, with --cold).  The
FLOPs of a causal prefill of S tokens (:func:`prefill_flops`): attention 2·S²·heads·head_dim per
layer (QKᵀ and PV over the causal half); dense 2 x the parameters a token's layers touch x S,
plus the final norm and the LM head once (prefill computes the last position's logits only).
The attention speed is one causal block of min(S / W, 65536) query rows (the model's q / kv
heads and head_dim, batch 1) on the local kernel the ring runs, the matmul speed a 16384 x dim @
dim x ffn matmul (:mod:`..probes.one_gpu`); the row keeps both and their shapes (``probe``).
Models whose attention is not plain causal (a sliding window) are refused.
Budget: a 7B prefill of 1M tokens is ~2.9e17 FLOPs, about 2-3 minutes on 4 GPUs per method;
13B about half as long again.  A method that runs out of memory at some length is not tried at longer
ones; the summary gives the longest sequence each method fits.  Rank 0 prints the tables and
writes a JSON record (prefill_<world>gpu.json in $BURST_RESULTS or ./burst-results by default).

Running out of memory is survived when all ranks run out together, which the symmetric work
of every method makes the usual case; set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys

import torch
import torch.distributed as dist

from ...inference.engine import peak_bytes, prefill, reset_peak
from ...inference.models import OurLlama, random_llama
from ...model import ModelArgs, PRESETS
from ...timing import median, reduce_max, timed
from ..harness import RankLog, attn_flops, ranked_bench
from ..launch import default_world
from ..probes.one_gpu import attention_speed, device_label, matmul_speed
from ..probes.profile import breakdown, category_lines, exposure, idle_causes, idle_lines, profiled
from ..records import OUT_DIR_HELP, write_record
from ..tables import Section, device_of, gib, med, memory, ms, num, rate, ratio, record, table
from ..usage import kernel_error
from . import peer_attention as peers
from .methods import METHODS as ALL_METHODS, unknown
from .tp_llama import TPLlama

# LLaMA-2 7B and 13B (the paper's models), and a CPU-sized one
SHAPES: dict[str, ModelArgs] = {
    "tiny": PRESETS["tiny"],
    "7b": PRESETS["llama-7b"],
    "13b": ModelArgs(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000, ffn_dim=13824),
    "8b": PRESETS["llama-8b"],  # Llama-3.1-8B's shape (GQA, 8 kv heads)
}
METHODS = ("burst", "torch-cp", "megatron-v3", "megatron-v1")  # a GPU run's, unless --methods says otherwise


# defaults by device: the paper's shapes on GPUs; a tiny model that finishes in seconds on CPU
GPU_DEFAULTS = dict(models="7b,13b", seqs="32768,65536,131072,262144,524288,1048576", methods=",".join(METHODS))
CPU_DEFAULTS = dict(models="tiny", seqs="1024,2048", methods="burst,megatron-v3,megatron-v1")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=None, help=f"comma-separated shapes from {sorted(SHAPES)} "
                                                  f"[cuda: {GPU_DEFAULTS['models']}, cpu: {CPU_DEFAULTS['models']}]")
    p.add_argument("--seqs", default=None, help="prompt lengths, comma-separated, ascending "
                                                f"[cuda: {GPU_DEFAULTS['seqs']}, cpu: {CPU_DEFAULTS['seqs']}]")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated, from {','.join(METHODS)} (and burst-<layout>) "
                        f"[cuda: all, cpu: {CPU_DEFAULTS['methods']}]")
    p.add_argument("--kernel", default=None, help="BurstAttention's local kernel (default: auto, cuDNN on GPUs)")
    p.add_argument("--sdpa", default=None, help="SDPA backend of the peers: cudnn, flash, math "
                                                "(default: cudnn on GPUs, math on CPU)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed calls per case; with 0 each method still makes one untimed call at a short length "
                        "first (the row's warmed_at) [%(default)s]")
    p.add_argument("--cold", action="store_true",
                   help="time the first call at each length apart from the warm ones (after one untimed call per "
                        "method at a short length)")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--long", type=float, default=30.0,
                   help="once a method's prefill takes longer than this many seconds, its longer sequences "
                        "run once without warm-up (NCCL and the kernels are warm by then) [%(default)s]")
    p.add_argument("--profile", action="store_true",
                   help="after each method's timed calls at the last length, profile one more call there "
                        "(torch.profiler): kernel time by category, host gaps, top kernels, exposed collectives")
    p.add_argument("--top", type=int, default=15, help="kernels a --profile lists [%(default)s]")
    p.add_argument("--efficiency", action="store_true",
                   help="rate each BurstEngine row's time against its FLOPs at the single-GPU attention and matmul "
                        "speeds, measured on rank 0 after the timed calls (ideal_s, parallel_efficiency)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world", type=int, default=None, help="ranks to spawn without torchrun [one per GPU, else 2]")
    p.add_argument("--name", default=None, help="record name (default prefill_<world><gpu|cpu>)")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--timeout", type=float, default=7200.0)


def fill_defaults(args):
    """The device's defaults where none were given (idempotent; ``validate`` calls it too)."""

    for key, value in (GPU_DEFAULTS if torch.cuda.is_available() else CPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.world is None:
        args.world = default_world()
    return args


def parse_methods(spec: str) -> list[str]:
    out = [m for m in spec.split(",") if m]
    bad = unknown("prefill", out)
    if bad:
        raise ValueError(f"unknown method {bad[0]!r}; expected {METHODS} or burst-<layout>")
    return out


def validate(args) -> str | None:
    world = fill_defaults(args).world
    try:
        methods = parse_methods(args.methods)
        seqs = [int(s) for s in args.seqs.split(",") if s]
    except ValueError as e:
        return str(e)
    models = [m for m in args.models.split(",") if m]
    bad = [m for m in models if m not in SHAPES]
    if bad or not models:
        return f"unknown model shape(s) {bad}; expected from {sorted(SHAPES)}"
    if not seqs or seqs != sorted(seqs) or seqs[0] < 1:
        return f"--seqs must be positive and ascending, got {seqs}"
    for s in seqs:
        if s % (2 * world):
            return f"sequence {s} is not divisible by 2 x {world} ranks (zigzag halves, TP shards)"
    for name in models:
        a = SHAPES[name]
        if any(ALL_METHODS[m].attention == "megatron" for m in methods) and (a.n_heads % world or a.ffn_dim % world):
            return f"{name}: heads {a.n_heads} and ffn {a.ffn_dim} must be divisible by {world} for tensor parallelism"
    if args.iters < 1 or args.warmup < 0:
        return "--iters must be >= 1 and --warmup >= 0"
    if args.top < 1:
        return f"--top must be >= 1 (kernels a --profile lists), got {args.top}"
    if args.sdpa is not None and args.sdpa not in ("cudnn", "flash", "math"):
        return f"--sdpa must be one of cudnn, flash, math, got {args.sdpa!r}"
    if args.efficiency:
        if not any(ALL_METHODS[m].attention == "burst" for m in methods):
            return (f"--efficiency rates BurstEngine's rows (burst, burst-fp8, burst-<layout>); "
                    f"--methods {','.join(methods)} has none")
        windowed = [m for m in models if SHAPES[m].window]
        if windowed:
            return (f"--efficiency counts plain causal attention; model {windowed[0]} has a sliding window of "
                    f"{SHAPES[windowed[0]].window}")

    return kernel_error(args.kernel, "cuda" if torch.cuda.is_available() else "cpu")


def longest_fit(rows, method: str, model: str) -> int | None:
    fits = [r["S"] for r in rows if r["method"] == method and r["model"] == model and "seconds" in r]
    return max(fits) if fits else None


def _oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def _failure(e: BaseException, device) -> str:
    """One line for a call that raised (an OOM, a kernel refusing a shape); the allocator's cache
    is freed for what runs next."""
    first = (str(e).splitlines() or [""])[0][:160]
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return f"OOM: {first}" if _oom(e) else f"{type(e).__name__}: {first}"


def _agreed(err: str | None, device, group) -> str | None:
    """Whether a call failed on any rank, the same on every rank: this rank's ``err``, or "failed on
    another rank"; None where it ran everywhere.  A failure is normally simultaneous (the work is
    symmetric), but a rank going on alone would meet the others in different collectives."""
    if reduce_max([1.0 if err else 0.0], device, group)[0] > 0:
        return err or "failed on another rank"
    return None


def _case(method, S, ids, ours, tp, group, args, device):
    """-> (fn, context manager factory or None) running one prefill of ``ids`` with ``method``."""
    from torch.nn.attention import sdpa_kernel  # only for the SDPA baselines

    backend = args.sdpa or ("cudnn" if device.type == "cuda" else "math")
    m = ALL_METHODS[method]
    if m.attention == "burst":
        return (lambda: prefill(ours, ids, group=group, layout=m.layout, kernel=m.kernel or args.kernel).logits), None
    if m.attention == "torch-cp":
        def fn():
            with sdpa_kernel(peers.BACKENDS[backend]):
                return prefill(ours, ids, group=group, layout=m.layout, attention="sdpa").logits
        return fn, (lambda: peers.torch_cp_context(group, S, device, causal=True))
    tp.mode, tp.backend = m.mode, backend  # megatron
    return (lambda: tp.next_token_logits(ids)), None


# a prefill's collectives by kernel name: Megatron's and torch CP's all-gather / reduce-scatter /
# all-reduce, then the rest: BurstAttention's ring (send/recv), broadcasts, all-to-all
COLLECTIVES = ("gather/reduce", "send/recv and other")


def _warm_short(method, ours, tp, group, args, device, vocab: int, S: int) -> str | None:
    """One untimed prefill of ``method`` at a short length ``S``; why it failed on any rank (the
    ranks agree), else None."""
    ids = torch.randint(0, vocab, (1, S), generator=torch.Generator().manual_seed(args.seed))
    fn, ctx = _case(method, S, ids, ours, tp, group, args, device)
    err = None
    try:
        with ctx() if ctx else contextlib.nullcontext():
            fn()
    except Exception as e:  # noqa: BLE001  (an OOM, or a kernel refusing a shape: said in the row)
        err = _failure(e, device)
    return _agreed(err, device, group)


def run_rank(args, group=None) -> list[dict]:
    """Every case on this rank of an initialised group; rank 0 prints and writes the record.
    Returns the rows (on every rank)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    methods = parse_methods(args.methods)
    seqs = [int(s) for s in args.seqs.split(",") if s]
    log = RankLog("prefill-bench", rank, "7.0f")

    log(f"{world} rank(s) on {device.type}, {dtype}; models {args.models}; methods {methods}; S {seqs}")
    rows = []
    record_name = args.name or f"prefill_{world}{'gpu' if device.type == 'cuda' else 'cpu'}"
    path = None  # the first write picks a free name; later ones rewrite that file

    def save(**more):  # rank 0's record, rewritten after every case: a timeout keeps what was measured
        nonlocal path
        path = write_record(record_name, dict(kind="prefill_bench", world=world, args=vars(args), rows=rows, **more),
                            args.out_dir, path=path)

    for name in (m for m in args.models.split(",") if m):
        a = SHAPES[name]
        model = random_llama(a, device, dtype, args.seed)
        ours = OurLlama(model, name)
        log(ours.describe)
        reference = {}
        tp = None
        # CP methods first (they share the full model); then TP, whose slices are cut from it
        # before the full model is freed, so every method's peak memory is its own
        order = sorted(methods, key=lambda m: (ALL_METHODS[m].attention == "megatron", m != "burst"))
        for method in order:
            if ALL_METHODS[method].attention == "megatron" and tp is None:
                tp = TPLlama(model, group)
                del model, ours
                model = ours = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            stopped = None  # why longer sequences of this method are not tried
            warmup, iters = args.warmup, args.iters
            for S in seqs:
                row = dict(model=name, method=method, S=S, world=world, dtype=str(dtype).replace("torch.", ""))
                rows.append(row)
                if ALL_METHODS[method].cuda_only and device.type != "cuda":
                    row["error"] = "needs CUDA"
                    continue
                if stopped:
                    row["error"] = stopped
                    continue
                ids = torch.randint(0, a.vocab_size, (1, S), generator=torch.Generator().manual_seed(args.seed + S))
                # warm the process at a short length first: "cold" is a new length, and with no warm-up at
                # all the first method would pay the process's start (kernel builds, NCCL's communicators,
                # torch.compile's shared fused ops) that the next one reuses: 8B at 1M on 4 H100s, burst's
                # first call of the process beside torch-CP's after it
                if (args.cold or args.warmup == 0) and S == seqs[0]:
                    # shorter than the first length (4K tokens a rank at most): still a new length for --cold
                    row["warmed_at"] = max(2 * world, min(4096 * world, S // 2) // (2 * world) * (2 * world))
                    bad = _warm_short(method, ours, tp, group, args, device, a.vocab_size, row["warmed_at"])
                    if bad:  # every rank agrees: this method's lengths are not tried
                        row["error"] = f"the warm-up call at {row['warmed_at']} tokens failed: {bad}"
                        stopped = "not run: its warm-up call failed"
                        log(f"{name} {method}: {row['error']}")
                        continue
                fn, ctx = _case(method, S, ids, ours, tp, group, args, device)
                box, err, first = {}, None, None

                def step():
                    box["logits"] = fn()

                reset_peak(device)
                try:
                    with ctx() if ctx else contextlib.nullcontext():
                        if args.cold:  # the first call at this length, alone; it counts as a warm-up call
                            first = timed(step, device, group, 0, 1, events=False)[0]
                        secs = timed(step, device, group, max(warmup - (first is not None), 0), iters, events=False)
                except Exception as e:  # noqa: BLE001  (an OOM, or a kernel refusing a shape)
                    box.clear()
                    err = _failure(e, device)
                # all ranks agree on whether the case ran; longer sequences of a failed method are not tried
                err = _agreed(err, device, group)
                if err:
                    row["error"] = err
                    stopped = f"not run: {'OOM' if row['error'].startswith('OOM') else 'failed'} at {S}"
                    log(f"{name} {method} S={S}: {row['error']}")
                    continue
                peak, what = peak_bytes(device, group)
                logits = box["logits"]
                if method == "burst":
                    reference[S] = logits
                elif S in reference:
                    ref = reference[S]
                    row["logits_rel_diff_vs_burst"] = ((logits - ref).abs().max() / ref.abs().max()).item()
                if median(secs) > args.long:
                    warmup, iters = 0, 1
                row.update(seconds=secs, median_s=median(secs),
                           std_s=statistics.pstdev(secs) if len(secs) > 1 else 0.0, peak_bytes=peak, peak_kind=what,
                           tokens_per_s=S / median(secs))
                if first is not None:
                    row.update(first_s=first, first_vs_warm=first / median(secs))
                log(f"{name} {method} S={S}: {row['median_s']:.3f}s, peak {memory(peak)} ({what})"
                    + (f", first call {first:.3f}s ({row['first_vs_warm']:.2f}x warm)" if first is not None else "")
                    + (f", logits vs burst {row['logits_rel_diff_vs_burst']:.1e}" if "logits_rel_diff_vs_burst" in row
                       else ""))
                del box
                if args.profile and S == seqs[-1]:  # after the timed calls: the profiler slows none
                    _profile_row(row, fn, ctx, device, group, args.top, log)
                if rank == 0:
                    save()
        del tp, model, ours
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if args.efficiency:  # after every timed call of the model, its weights freed
            _rate(rows, name, args, device, dtype, group, log)
            if rank == 0:
                save()
    if rank == 0:
        print_tables(rows, methods, seqs)
        print_profiles(rows)
        save(longest_fit={f"{m}@{r}": longest_fit(rows, m, r) for m in methods for r in args.models.split(",") if r})
        print(f"wrote {path}")
    return rows


# --efficiency's probe shapes by device type: the attention block's query rows at most (fewer where
# a rank holds fewer, S / W) and the matmul's token rows; a CPU's are small, its figures only test the path
PROBE_ROWS = {"cuda": (65536, 16384), "cpu": (1024, 256)}


def prefill_flops(a: ModelArgs, S: int) -> tuple[float, float]:
    """(attention, dense) forward FLOPs of a causal prefill of ``S`` tokens (batch 1) of the shape
    ``a``.  Attention: the causal half of every layer, 2·S²·heads·head_dim (docs/design.md, "FLOP
    conventions").  Dense: 2 per weight of the layers (projections, MLP, norms) for each of the S
    tokens, and 2 per weight of the final norm and the LM head for the one position whose logits
    prefill computes."""
    attention = a.n_layers * attn_flops(1, S, S, a.n_heads, a.head_dim, 0.5)
    last = a.dim + a.vocab_size * a.dim  # final norm and LM head (tied or not, the same matmul)
    layers = a.num_params(embedding=False) - a.dim - (0 if a.tie_embeddings else a.vocab_size * a.dim)
    return attention, 2.0 * (layers * S + last)


def ideal_seconds(row) -> float:
    """A rated row's time on its ``world`` ranks at the single-GPU speeds, from its own figures."""
    w = row["world"]
    return (row["attention_flops"] / w / (row["attention_tflops"] * 1e12)
            + row["dense_flops"] / w / (row["matmul_tflops"] * 1e12))


def _rate(rows, model: str, args, device, dtype, group, log) -> None:
    """--efficiency: the single-GPU speeds measured on rank 0 (the other ranks wait, then take its
    figures), and each of ``model``'s BurstEngine rows that ran rated against them (the module's
    doc); ``efficiency_error`` in those rows where the probe failed."""
    rated = [r for r in rows if r["model"] == model and ALL_METHODS[r["method"]].attention == "burst"
             and "seconds" in r]
    if not rated:  # the same on every rank: the rows agree
        return
    a, world = SHAPES[model], rated[0]["world"]
    most, mm_rows = PROBE_ROWS["cuda" if device.type == "cuda" else "cpu"]

    def key(r):  # the probe a row needs: its local kernel and a rank's query rows
        return ALL_METHODS[r["method"]].kernel or args.kernel, min(r["S"] // world, most)

    box = [None]
    if dist.get_rank(group) == 0:
        try:
            box[0] = dict(device=device_label(device), matmul=matmul_speed(mm_rows, a.dim, a.ffn_dim, dtype, device),
                          attention={k: attention_speed(*k, a.n_heads, a.n_kv_heads, a.head_dim, dtype, device,
                                                        a.softmax_scale) for k in dict.fromkeys(map(key, rated))})
        except Exception as e:  # noqa: BLE001  (an OOM, a kernel refusing the shape: said in the rows)
            box[0] = _failure(e, device)
    dist.broadcast_object_list(box, group=group, group_src=0)
    probe = box[0]
    if isinstance(probe, str):
        for r in rated:
            r["efficiency_error"] = probe
        log(f"{model}: the single-GPU probe failed: {probe}")
        return
    for r in rated:
        att, mm = probe["attention"][key(r)], probe["matmul"]
        r["attention_flops"], r["dense_flops"] = prefill_flops(a, r["S"])
        r.update(attention_tflops=att["tflops"], matmul_tflops=mm["tflops"],
                 probe=dict(device=probe["device"], dtype=r["dtype"], attention=att, matmul=mm))
        r["ideal_s"] = ideal_seconds(r)
        r["parallel_efficiency"] = r["ideal_s"] / r["median_s"]
        if "first_s" in r:
            r["first_parallel_efficiency"] = r["ideal_s"] / r["first_s"]
        log(f"{model} {r['method']} S={r['S']}: ideal {r['ideal_s']:.4g}s at {att['tflops']:.4g} (attention, "
            f"{att['kernel']}) / {mm['tflops']:.4g} (matmul) TFLOP/s on {probe['device']}: parallel efficiency "
            f"{r['parallel_efficiency']:.1%}" + (f", first call {r['first_parallel_efficiency']:.1%}"
                                                 if "first_s" in r else ""))


def _profile_row(row, fn, ctx, device, group, top: int, log) -> None:
    """``row["profile"]``: where one more call of its case, under torch.profiler, spent its time
    (see the module's doc); ``row["profile_error"]`` when that call failed on some rank (all ranks
    agree, as for the timed calls)."""
    err = None
    try:
        with ctx() if ctx else contextlib.nullcontext():
            prof, wall = profiled(fn, device, group)
        on_gpu = device.type == "cuda"
        summary, acts = breakdown(prof, wall, on_gpu, top)
        # the GPU's idle time by the host op running then (a first call's plan builds, compiles, allocations)
        idle = {"idle": idle_causes(prof, acts)} if on_gpu else {}
        prof = dict(wall_s=wall, **summary, collectives_s=exposure(acts, COLLECTIVES), **idle)
    except Exception as e:  # noqa: BLE001  (an OOM under the profiler: the timed figures stand)
        err = _failure(e, device)
    err = _agreed(err, device, group)
    if err:
        row["profile_error"] = err
        log(f"{row['model']} {row['method']} S={row['S']}: profile failed: {row['profile_error']}")
        return
    row["profile"] = prof
    busy = prof.get("gpu_busy_s", prof.get("cpu_busy_s"))
    log(f"{row['model']} {row['method']} S={row['S']}: profiled call {prof['wall_s']:.3f}s, busy {busy:.3f}s, "
        f"host gaps {prof['host_gap_s']:.3f}s")


def print_profiles(rows, file=None) -> None:
    """Each profiled call's breakdown: kernel time by category, host gaps, collectives."""
    file = file or sys.stdout
    for r in rows:
        if "profile" not in r:
            continue
        p = r["profile"]
        busy = p.get("gpu_busy_s", p.get("cpu_busy_s"))
        print(f"\nprofile of {r['model']} {r['method']} S={r['S']:,d} (rank 0): call {p['wall_s']:.3f} s, "
              f"busy {busy:.3f} s", file=file)
        print("\n".join(category_lines(p, p["wall_s"], "call")), file=file)
        print("collectives: " + "; ".join(f"{kind} {c['kernel_s']:.3f} s of kernels, {c['exposed_s']:.3f} s exposed"
                                          for kind, c in p["collectives_s"].items()), file=file)
        if p.get("idle"):
            print("\n".join(idle_lines(p)), file=file)


def print_tables(rows, methods, seqs, file=None):
    file = file or sys.stdout  # per call, not bound at import
    for model in dict.fromkeys(r["model"] for r in rows):
        def line(m, cell, tail=""):  # one method's cells over the lengths
            at = {x["S"]: x for x in rows if x["model"] == model and x["method"] == m}
            print(f"{m:14s}" + "".join(f"{cell(at[s]):>14s}" for s in seqs) + tail, file=file)

        print(f"\nfirst-token latency (s), {model}, {rows[0]['world']} rank(s), {rows[0]['dtype']}:", file=file)
        head = f"{'method':14s}" + "".join(f"{s:>14,d}" for s in seqs) + f"{'longest fit':>14s}"
        print(head, file=file)
        print("-" * len(head), file=file)
        for m in methods:
            line(m, _latency_cell, f"{longest_fit(rows, m, model) or '-':>14}")
        if any("first_s" in r for r in rows if r["model"] == model):
            print("first call at the length (s), ÷ the warm median:", file=file)
            for m in methods:
                line(m, lambda r: f"{r['first_s']:.3f} {r['first_vs_warm']:.2f}x" if "first_s" in r else "-")
        kinds = {x.get("peak_kind") for x in rows if x["model"] == model and "peak_bytes" in x} - {None}
        print(f"peak memory per rank (GiB{', ' + ', '.join(sorted(kinds)) if kinds else ''}):", file=file)
        for m in methods:
            line(m, lambda r: f"{r['peak_bytes'] / 2**30:.2f}" if "peak_bytes" in r else "-")
        rated = [r for r in rows if r["model"] == model and "ideal_s" in r]
        if rated:
            p = rated[0]["probe"]
            print(f"parallel efficiency (ideal ÷ measured{', warm / first call' if 'first_s' in rated[0] else ''}) "
                  f"at {p['device']}'s single-device speeds, {p['dtype']}"
                  + (" (cpu: the path runs, the figures mean nothing)" if p["device"] == "cpu" else "") + ":", file=file)
            for m in dict.fromkeys(r["method"] for r in rated):
                line(m, _efficiency_cell)
            probes = {(r["probe"]["attention"]["kernel"], r["probe"]["attention"]["rows"]): r["probe"] for r in rated}
            mm = p["matmul"]
            print(f"  matmul {rate(mm['tflops'] * 1e12)} ({mm['rows']} x {mm['dim']} @ {mm['dim']} x {mm['ffn']}); "
                  + "; ".join(f"attention {rate(q['tflops'] * 1e12)} ({q['kernel']}, causal, {q['rows']} rows, "
                              f"{q['heads']}/{q['kv_heads']} heads, d {q['head_dim']})"
                              for q in (x["attention"] for x in probes.values())), file=file)


def _efficiency_cell(r) -> str:
    if "parallel_efficiency" not in r:
        return "-"
    first = r.get("first_parallel_efficiency")
    return f"{r['parallel_efficiency']:.1%}" + (f"/{first:.1%}" if first is not None else "")


def _latency_cell(r) -> str:
    if "seconds" in r:
        return f"{r['median_s']:.3f}±{r['std_s']:.3f}"
    e = r["error"]
    return ("OOM" if e.startswith("OOM") else "(OOM)" if e.startswith("not run: OOM")
            else "-" if e.startswith(("not run", "needs")) else "error")


def _entry(args) -> int:
    run_rank(args)
    return 0


build_parser, main = ranked_bench("prefill", __doc__, add_arguments, _entry, validate,
                                  prepare=fill_defaults)


# --- docs/results.md ----------------------------------------------------------------------------

def _pct(x) -> str:
    return "—" if x is None else f"{x:.1%}"


def render(rec):
    rows = rec["rows"]
    base = {(r["model"], r["S"]): r for r in rows if r["method"] == "burst"}
    cold = any("first_s" in r for r in rows)
    rated = any("ideal_s" in r for r in rows)  # --efficiency (older records have none)
    body = [[r["model"], r["method"], r["S"], r["world"], ms(med(r["seconds"])), num(r["S"] / med(r["seconds"]), 4),
             gib(r.get("peak_bytes")), num(r.get("logits_rel_diff_vs_burst")),
             ratio(med(r["seconds"]), med(base[(r["model"], r["S"])]["seconds"])) if (r["model"], r["S"]) in base
             else "—"] + ([ms(r["first_s"]) if "first_s" in r else "—",
                          ratio(r["first_s"], med(r["seconds"])) if "first_s" in r else "—"] if cold else [])
            + ([ms(r.get("ideal_s")), _pct(r.get("parallel_efficiency"))]
               + ([_pct(r.get("first_parallel_efficiency"))] if cold else [])
               + [f"{num(r['attention_tflops'])} / {num(r['matmul_tflops'])} ({r['probe']['device']})"
                  if "ideal_s" in r else "—"] if rated else [])
            for r in rows if "seconds" in r]
    out = table(["model", "method", "S", "world", "first-token ms", "tokens/s", "peak GiB",
                 "logits vs burst", "time ÷ burst's"] + (["first call ms", "first ÷ warm"] if cold else [])
                + (["ideal ms", "parallel efficiency"] + (["first call's efficiency"] if cold else [])
                   + ["one GPU's attention / matmul TFLOP/s"] if rated else []), body)
    if rec.get("longest_fit"):
        out += table(["method@model", "longest prompt that fit"], [[k, v] for k, v in rec["longest_fit"].items()])
    return out


# issue 37's parallel efficiency: (--efficiency --cold records, the profile of the same shape)
EFF_RUNS = ("prefill_8b_2gpu_256k_eff.json", "prefill_8b_2gpu_512k_eff.json", "prefill_8b_2gpu_256k_eff2.json")
EFF_PROFILE = "prefill_8b_2gpu_256k_profile.json"


def block_prefill_eff(records):
    """docs/inference.md: prefill's parallel efficiency, warm and first call, beside torch-CP where
    it ran in the launch, and where the profiled call's time went."""
    body = []
    for name in EFF_RUNS:
        rec = record(records, name)
        rows = {r["method"]: r for r in rec["rows"] if "seconds" in r}
        b, peer = rows["burst"], rows.get("torch-cp")
        body.append([f"{rec['world']} × {device_of(rec).split('× ')[-1]}", f"{b['S'] // 1024}K", ms(b["ideal_s"]),
                     ms(med(b["seconds"])), ms(b["first_s"]), _pct(b["parallel_efficiency"]),
                     _pct(b["first_parallel_efficiency"]),
                     "—" if peer is None else f"{num(med(peer['seconds']) / med(b['seconds']), 3)}× / "
                                              f"{num(peer['first_s'] / b['first_s'], 3)}×",
                     f"`{name}` ({rec['commit'][:7]})"])
    prof = record(records, EFF_PROFILE)
    r = prof["rows"][0]
    p = r["profile"]
    cats = sorted(p["categories_s"].items(), key=lambda kv: -kv[1])
    parts = ", ".join(f"{k} {ms(v)} ({v / p['wall_s']:.1%})" for k, v in cats if v >= 0.0005)
    return "\n".join(table(["ranks", "prompt", "ideal ms", "warm ms", "first call ms", "efficiency warm",
                             "efficiency first call", "torch-CP ÷ burst (warm / first)", "record"], body)
                     + ["", f"One profiled call at {r['S'] // 1024}K on {prof['world']} × "
                            f"{device_of(prof).split('× ')[-1]} (rank 0, `{EFF_PROFILE}`, {prof['commit'][:7]}): "
                            f"{ms(p['wall_s'])} ms, the GPU idle {ms(p['host_gap_s'])} ms of it; {parts}."])


SECTIONS = (Section("Prefill", r"^prefill", render,
                    "`burstengine bench prefill`: first-token latency beside tensor and torch-native context "
                    "parallelism."),)
BLOCKS = {"prefill-eff": block_prefill_eff}
