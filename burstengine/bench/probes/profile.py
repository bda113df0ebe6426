"""Where one training step's time goes: a torch.profiler trace of one step, broken down.

    torchrun --nproc_per_node 1 -m burstengine bench profile --model llama-8b \\
        --set model.dim=3072 --set model.n_layers=28 ... --seq 131072

Builds the same Trainer as `burstengine bench train`, runs --warmup steps, then profiles one
step and sorts every GPU kernel of it into a category by its name (attention forward/backward,
GEMMs, elementwise/norm/RoPE, loss, collectives, optimizer, copies, other).  Host gaps are the
step's wall time minus the time at least one kernel ran (the union of kernel intervals), i.e.
time the GPU sat idle waiting for the host; each idle stretch of 10 us or more is charged to
the shortest host op running then, on any thread (a cudaMalloc, a synchronize, a hook), and the
caching allocator's retries and cudaMalloc/cudaFree calls in the step are counted.  Writes a
JSON record with the step's wall time, each category's kernel time, the top kernels, the idle
time's causes, and the config it came from.  On CPU (no CUDA) it
profiles the step's CPU ops instead (those the calling thread runs), so the path can be tried
anywhere.
"""
from __future__ import annotations

import argparse
import bisect
import heapq
import re
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from ...attention.checks import arg_checks
from ...comm.dist import world_of
from ...timing import sync
from ...train import Trainer, load
from ..harness import ranked_bench, step_check_level, step_overrides_refused
from ..records import OUT_DIR_HELP, write_record
from ..tables import Section, device_of, fixed, record, table

# first match wins; names are lower-cased kernel names
CATEGORIES = (
    ("collective", r"nccl|allgather|reducescatter|all_reduce|allreduce|^c10d::|^gloo:"),  # c10d, gloo: CPU ops
    ("attention backward", r"(fmha|flash|sdpa|attn|attention|_bwd_|gluon).*(bprop|bwd|backward|dq|dkdv)|"
                           r"(bprop|bwd|backward).*(fmha|flash|sdpa|attn)|_attn_bwd|_bwd_kernel|_bwd_preprocess|"
                           r"_delta|^delta_kernel|^kv_kernel|^dq_kernel|^bwd_(wide_)?kernel"),  # kernels/triton/bwd.py, kernels/gluon/bwd*.py
    ("attention forward", r"fmha|flash|sdpa|cudnn_generated|attn|attention|fwd_kernel|gluon|_merge"),
    ("loss", r"cross_entropy|log_softmax|softmax_backward|_ce_|^ce_|nll_loss|logsumexp|fused_ce|lce"),
    ("optimizer", r"multi_tensor|adam|foreach|_amp_|clip|norm_kernel"),
    ("gemm", r"gemm|nvjet|cutlass|xmma|sm90_|sm80_|ampere|cublas|wgmma|matmul|splitk|^aten::(linear|addmm|mm|bmm)$"),
    # not inductor's fused kernels (triton_poi/red/per_fused_*): the compiled RMSNorm, RoPE, SwiGLU
    # (model/fused.py) name the casts (_to_copy) and cats inside them, yet compute
    ("copy", r"^(?!triton_).*(memcpy|memset|copy|cat_|catarray|fill)"),
    ("elementwise/norm/rope", r"elementwise|vectorized|reduce|rms|norm|silu|mul|add|triton_|pow|rsqrt|neg|index|"
                              r"unrolled|where|embedding|scatter|gather"),
)
_PATTERNS = [(name, re.compile(rx)) for name, rx in CATEGORIES]


def category(kernel_name: str) -> str:
    n = kernel_name.lower()
    return next((c for c, rx in _PATTERNS if rx.search(n)), "other")


def union(intervals) -> float:
    """Total length covered by a list of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def kernel_events(events) -> list:
    """The GPU work among a profile's events (kernels, copies, sets), without the GPU-side range
    of a record_function (a user annotation: nccl:* around a collective, FSDP::*, ProfilerStep#N,
    a decode step's), which spans kernels listed already: counted as one more kernel, it doubled
    the collectives' time (torch's own tables leave annotations out too)."""
    cuda = torch.autograd.DeviceType.CUDA
    return [e for e in events if e.device_type == cuda and not e.is_user_annotation]


# the range around a profiled call: its CPU ops are the ones directly inside it, on the thread
# that made the call (a collective's worker threads, gloo's, run their own ops beside it)
PROFILED = "burst::profiled"


def profiled(fn, device, group=None):
    """-> (torch.profiler profile, wall seconds) of one call of ``fn`` on ``device``: CPU and CUDA
    activities on a GPU, CPU ones elsewhere; the ranks of ``group`` start it together and the wall
    time runs until the device is done."""
    device = torch.device(device)
    sync(device)
    if world_of(group) > 1:
        dist.barrier(group=group)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        with record_function(PROFILED):
            fn()
        sync(device)
        wall = time.perf_counter() - t0
    return prof, wall


def breakdown(prof, wall: float, on_gpu: bool, top: int) -> tuple[dict, list]:
    """Where the ``wall`` seconds of a call made by :func:`profiled` went: -> (summary, activities).
    The activities are its kernels on a GPU (elsewhere the CPU ops right inside the call, on its
    thread: they do not overlap) as ``(name, start_us, end_us, category)``; the summary holds the
    time at least one ran (``gpu_busy_s`` / ``cpu_busy_s``, the union of their intervals), the host
    gaps (wall minus busy: the device waited for the host), each category's time (``categories_s``;
    kernels on different streams overlap, so these can add up to more than busy) and the ``top``
    kernels by time."""
    evs = kernel_events(prof.events()) if on_gpu else [
        e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU and e.cpu_parent is not None
        and e.cpu_parent.name == PROFILED]
    per_cat: dict[str, float] = {}
    per_kernel: dict[str, list] = {}
    acts = []
    for e in evs:
        dur = e.time_range.elapsed_us()
        c = category(e.name)
        acts.append((e.name, e.time_range.start, e.time_range.end, c))
        per_cat[c] = per_cat.get(c, 0.0) + dur
        k = per_kernel.setdefault(e.name, [c, 0.0, 0])
        k[1] += dur
        k[2] += 1
    busy_us = union([(a[1], a[2]) for a in acts])
    summary = {
        "gpu_busy_s" if on_gpu else "cpu_busy_s": busy_us / 1e6,
        "host_gap_s": max(0.0, wall * 1e6 - busy_us) / 1e6,
        "categories_s": {c: v / 1e6 for c, v in sorted(per_cat.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:160], "category": c, "total_s": t / 1e6, "calls": k}
                        for n, (c, t, k) in sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:top]],
    }
    return summary, acts


def category_lines(summary, wall: float, call: str) -> list[str]:
    """A breakdown's table for a terminal: each category's seconds and share of the ``call``'s
    wall time (``call``: what was profiled, e.g. "step"), then the host gaps."""
    out = [f"{'category':<24} {'s':>8} {'share of ' + call:>14}"]
    for c, t in summary["categories_s"].items():
        out.append(f"{c:<24} {t:>8.3f} {t / wall:>14.1%}")
    return out + [f"{'host gaps':<24} {summary['host_gap_s']:>8.3f} {summary['host_gap_s'] / wall:>14.1%}"]


def idle_lines(row) -> list[str]:
    """The GPU's idle time by its host-side cause, and the allocator's counts, for a terminal."""
    idle, alloc = row.get("idle") or {}, row.get("allocator") or {}
    out = []
    if idle:
        out.append(f"GPU idle {idle['gaps_s']:.3f} s in gaps of >= {idle['min_gap_us']:g} us "
                   f"(+ {idle['short_gaps_s']:.3f} s in shorter ones); by what the host was doing:")
        out += [f"  {c['s']:8.3f} s {c['gaps']:6d} gaps  {c['op']}   [{c['inside']}]" for c in idle["causes"]]
    if alloc:
        out.append("allocator in the step: " + ", ".join(f"{k[4:]} {v}" for k, v in alloc.items()))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="preset (default: llama-8b on GPU, tiny on CPU)")
    p.add_argument("--seq", type=int, default=None, help="total sequence length [131072 on GPU, 512 on CPU]")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config overrides (e.g. checkpoint=none)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the profiled one [%(default)s]")
    p.add_argument("--name", default=None, help="record name [profile_<model>_<seq>]")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--top", type=int, default=25, help="kernels listed in the record [%(default)s]")
    p.add_argument("--trace", default=None, help="also write the Chrome trace to this path")
    p.add_argument("--memory-trace", action="store_true",
                   help="GPU: one more step with the allocator's history recorded: per stream, the memory held at "
                        "the step's peak and before each release of cached memory (allocator retries)")
    p.add_argument("--world", type=int, default=1, help="ranks to spawn without torchrun [%(default)s]")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before spawned ranks are stopped")


_TRANSFER = re.compile(r"memcpy (dtoh|htod)", re.I)


def timeline(kernels, wall_us: float) -> dict:
    """Where the compute stream waited, from GPU activities ``(name, start_us, end_us, category)``:
    the step's time with no compute kernel running, before the first attention backward kernel
    (forward) and from it on (backward), and the host<->device transfers (offloaded activations)
    with how much of their time no compute kernel covers: that part is a wait of the step, not
    a copy hidden under work."""
    start = min((k[1] for k in kernels), default=0.0)
    bwd = min((k[1] for k in kernels if k[3] == "attention backward"), default=start + wall_us)
    compute = [(k[1], k[2]) for k in kernels if not _TRANSFER.search(k[0])]
    moved = {d: [(k[1], k[2]) for k in kernels if (m := _TRANSFER.search(k[0])) and m.group(1).lower() == d]
             for d in ("dtoh", "htod")}
    everything = [iv for ivs in moved.values() for iv in ivs]

    def covered(lo, hi):
        return union([(max(a, lo), min(b, hi)) for a, b in compute if b > lo and a < hi])

    end = start + wall_us
    return {"compute_gaps_s": {"forward": (bwd - start - covered(start, bwd)) / 1e6,
                               "backward": (end - bwd - covered(bwd, end)) / 1e6},
            "transfers_s": {d: union(ivs) / 1e6 for d, ivs in moved.items()},
            "transfer_only_s": (union(everything + compute) - union(compute)) / 1e6,
            "collectives_s": exposure(kernels)}


# FSDP's collectives vs the ring's point-to-point traffic, by NCCL kernel name
_FSDP = re.compile(r"allgather|reducescatter|all_gather|reduce_scatter|allreduce|all_reduce", re.I)


def exposure(kernels, kinds=("fsdp", "ring")) -> dict:
    """Each kind of collective, named by ``kinds`` (a training step's: FSDP's all-gather /
    reduce-scatter / all-reduce, then the ring's send/recv): its kernel time and the part of it
    no computing kernel covers (exposed: the step waits on it, or nothing else was ready).  A NCCL
    kernel runs for as long as it waits for its peer, so its own time is an upper bound of the
    traffic; the exposed part is what overlap missed."""
    compute = [(k[1], k[2]) for k in kernels if k[3] != "collective" and not _TRANSFER.search(k[0])]
    base = union(compute)
    out = {}
    for kind, pick in zip(kinds, (lambda n: bool(_FSDP.search(n)), lambda n: not _FSDP.search(n))):
        ivs = [(k[1], k[2]) for k in kernels if k[3] == "collective" and pick(k[0])]
        out[kind] = {"kernel_s": union(ivs) / 1e6, "exposed_s": (union(ivs + compute) - base) / 1e6}
    return out


def host_ops(events) -> list[tuple]:
    """The host side of a profile: every CPU op, on any thread (the backward runs on autograd's),
    as ``(name, start_us, end_us, parent)``, ``parent`` the index of the op that encloses it or
    -1; the range around the profiled call itself is left out."""
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.name != PROFILED]
    at = {id(e): i for i, e in enumerate(cpu)}
    return [(e.name, e.time_range.start, e.time_range.end, at.get(id(e.cpu_parent), -1)) for e in cpu]


def _free(free: list, j: int) -> int:
    """The first piece at or after ``j`` no op has taken (``free``: a piece's next candidate)."""
    root = j
    while free[root] != root:
        root = free[root]
    while free[j] != root:  # shorten the path for the next look-up
        free[j], j = root, free[j]
    return root


def gap_causes(ops, busy, lo: float, hi: float, min_us: float = 10.0, top: int = 10) -> dict:
    """Why the GPU sat idle: the stretches of [``lo``, ``hi``] (us) that no interval of ``busy``
    (the GPU's activities) covers, each moment of one at least ``min_us`` long charged to the
    shortest host op of ``ops`` (:func:`host_ops`) running then -- the most specific thing the
    host was doing (a cudaMalloc inside an allocation inside a layer's op, a synchronize, a
    Python-side hook) -- or to "(no host op)".  Shorter gaps (the launch latency between
    back-to-back kernels) are summed apart.  -> {"gaps_s", "short_gaps_s", "causes": the ``top``
    causes by seconds, each with its gap count and the enclosing ops of its largest piece}."""
    gaps, end = [], lo
    for s, e in sorted(busy):
        if s > end:
            gaps.append((end, min(s, hi)))
        end = max(end, e)
        if end >= hi:
            break
    if end < hi:
        gaps.append((end, hi))
    long_gaps = [g for g in gaps if g[1] - g[0] >= min_us]
    order = sorted(range(len(ops)), key=lambda i: ops[i][1])
    heap, nxt, causes = [], 0, {}
    for gs, ge in long_gaps:
        while nxt < len(order) and ops[order[nxt]][1] < ge:
            heapq.heappush(heap, (ops[order[nxt]][2], order[nxt]))
            nxt += 1
        while heap and heap[0][0] <= gs:
            heapq.heappop(heap)
        # the gap cut where a live op starts or ends; each piece goes to the shortest op over it:
        # the ops, shortest first, take the pieces still free under them (linear in the live ops
        # per piece was minutes on a host-bound step's ~100K gaps under ~50 open ops)
        live = sorted((i for _, i in heap), key=lambda j: ops[j][2] - ops[j][1])
        cuts = sorted({gs, ge, *(max(ops[i][1], gs) for i in live), *(min(ops[i][2], ge) for i in live)})
        owner, free, left = [-1] * (len(cuts) - 1), list(range(len(cuts))), len(cuts) - 1
        for i in live:
            j = _free(free, bisect.bisect_left(cuts, max(ops[i][1], gs)))
            stop = bisect.bisect_left(cuts, min(ops[i][2], ge))
            while j < stop:
                owner[j], free[j], left = i, j + 1, left - 1
                j = _free(free, j + 1)
            if not left:
                break
        for a, b, i in zip(cuts, cuts[1:], owner):
            c = causes.setdefault(ops[i][0] if i >= 0 else "(no host op)", [0.0, set(), 0.0, i])
            c[0] += b - a
            c[1].add(gs)
            if b - a > c[2]:
                c[2], c[3] = b - a, i

    def path(i):
        names = []
        while i >= 0:
            names.append(ops[i][0])
            i = ops[i][3]
        return " < ".join(names[:6])

    ranked = sorted(causes.items(), key=lambda kv: -kv[1][0])[:top]
    return {"gaps_s": sum(b - a for a, b in long_gaps) / 1e6,
            "short_gaps_s": sum(b - a for a, b in gaps if b - a < min_us) / 1e6,
            "min_gap_us": min_us,
            "causes": [{"op": n[:120], "s": t / 1e6, "gaps": len(g), "inside": path(i)[:300]}
                       for n, (t, g, _, i) in ranked]}


# the caching allocator's counters a step moves: retries (an allocation that failed, freed the
# cache and tried again: a device-wide sync), and cudaMalloc / cudaFree calls
_ALLOC = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams", "num_ooms")


def idle_causes(prof, acts, top: int = 10) -> dict:
    """:func:`gap_causes` of a call made by :func:`profiled`, over the host's span of the call
    (from its start to the later of its end and its last kernel's)."""
    events = prof.events()
    root = next((e for e in events if e.name == PROFILED and e.device_type == torch.autograd.DeviceType.CPU), None)
    if root is None or not acts:
        return {}
    lo = root.time_range.start
    hi = max(root.time_range.end, max(a[2] for a in acts))
    return gap_causes(host_ops(events), [(a[1], a[2]) for a in acts], lo, hi, top=top)


def stream_names(model, device) -> dict[int, str]:
    """Labels of the CUDA streams a training step allocates on (best effort): the compute stream,
    FSDP2's shared streams and the activation offloader's side stream; others keep their handle."""
    names = {torch.cuda.current_stream(device).cuda_stream: "compute"}
    for m in model.modules():
        state = getattr(m, "_get_fsdp_state", None)
        ctx = getattr(state(), "_comm_ctx", None) if callable(state) else None
        for attr in ("all_gather_copy_in_stream", "all_gather_stream", "reduce_scatter_stream", "all_reduce_stream"):
            st = getattr(ctx, attr, None)
            if st is not None:
                names.setdefault(st.cuda_stream, "fsdp " + attr[:-len("_stream")].replace("_", " "))
        side = getattr(getattr(m, "offloader", None), "side", None)
        if side is not None:
            names.setdefault(side.cuda_stream, "activation offload")
    return names


_IN_USE = ("active_allocated", "active_awaiting_free")


def _held(snapshot, index: int):
    """Per stream, (reserved, allocated) bytes of the caching allocator's segments now.  A block
    freed while another stream still used it ("active_awaiting_free") counts as allocated: the
    history's free_completed for it comes later (else a stream's allocated bytes go negative)."""
    reserved, allocated = {}, {}
    for seg in snapshot["segments"]:
        if seg.get("device", index) != index:
            continue
        st = seg["stream"]
        reserved[st] = reserved.get(st, 0) + seg["total_size"]
        allocated[st] = allocated.get(st, 0) + sum(b["size"] for b in seg["blocks"] if b["state"] in _IN_USE)
    return reserved, allocated


_GROW, _SHRINK = ("segment_alloc", "segment_map"), ("segment_free", "segment_unmap")


def memory_trace(fn, device, names: dict[int, str], releases: int = 8) -> dict:
    """Run ``fn`` (a step) with the caching allocator's history recorded (no stacks) and say,
    per stream, what it held: at the step's highest reserved total, and before each release of
    cached memory (a retry after a failed cudaMalloc frees every stream's cache, so the step's
    allocator retries show as these) with the allocation that came right after it.  Bytes in GiB.
    Why: the allocator caches per stream, so memory one stream freed is not another's to use;
    this is where a step that meets the card's size while allocating far less is told apart."""
    index = torch.device(device).index
    if index is None:
        index = torch.cuda.current_device()
    reserved, allocated = _held(torch.cuda.memory._snapshot(), index)
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=4_000_000)
    try:
        fn()
        torch.cuda.synchronize(device)
    finally:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
    return replay(reserved, allocated, snap["device_traces"][index], names, releases)


def replay(reserved: dict, allocated: dict, trace: list, names: dict[int, str], releases: int = 8) -> dict:
    """:func:`memory_trace`'s summary from the per-stream bytes held when the history began
    (``reserved``, ``allocated``: updated in place) and the history's events."""
    def label(st):
        return names.get(st, f"stream {st}")

    def view():
        return {label(st): {"reserved": round(reserved.get(st, 0) / 2**30, 3),
                            "allocated": round(allocated.get(st, 0) / 2**30, 3)}
                for st in sorted(set(reserved) | set(allocated), key=lambda s: -reserved.get(s, 0))}

    peak, at_peak, out, prev = sum(reserved.values()), view(), [], None
    rec = None  # the release being told: from its first release of cached memory to the next allocation
    for ev in trace:
        a, st, n = ev["action"], ev["stream"], ev["size"]
        if a in _SHRINK and prev not in _SHRINK:  # a release begins; those past the first ``releases`` untold
            rec = {"before": view(), "freed": {}, "next_alloc": None} if len(out) < releases else None
            if rec is not None:
                out.append(rec)
        if a in _SHRINK and rec is not None:
            rec["freed"][label(st)] = round(rec["freed"].get(label(st), 0) + n / 2**30, 3)
        if a == "alloc" and rec is not None:
            if prev in _SHRINK + _GROW:  # the allocation that retried (an empty_cache asks for none)
                rec["next_alloc"] = {"stream": label(st), "gib": round(n / 2**30, 3)}
            rec = None  # a later release, or a later allocation, is not this release's
        if a in _GROW:
            reserved[st] = reserved.get(st, 0) + n
        elif a in _SHRINK:
            reserved[st] = reserved.get(st, 0) - n
        elif a == "alloc":
            allocated[st] = allocated.get(st, 0) + n
        elif a == "free_completed":
            allocated[st] = allocated.get(st, 0) - n
        if a in _GROW and sum(reserved.values()) > peak:
            peak, at_peak = sum(reserved.values()), view()
        if a != "free_requested":
            prev = a
    return {"events": len(trace), "peak_reserved_gib": round(peak / 2**30, 3), "at_peak": at_peak,
            "releases": out, "ooms": sum(ev["action"] == "oom" for ev in trace)}


def memory_lines(mt: dict) -> list[str]:
    """The memory trace's summary as text (rank 0's, printed after the profile)."""
    def held(v):
        return "; ".join(f"{k} {x['reserved']:.1f} held / {x['allocated']:.1f} used" for k, x in v.items()
                         if x["reserved"] >= 0.05)
    out = [f"allocator history ({mt['events']} events): reserved at most {mt['peak_reserved_gib']:.1f} GiB, by "
           f"stream (GiB): {held(mt['at_peak'])}"]
    for i, r in enumerate(mt["releases"]):
        out.append(f"  release {i + 1}: before it {held(r['before'])}; freed {released(r)}")
    return out


def released(r: dict) -> str:
    """What one release of a memory trace freed, per stream, and the allocation that followed it."""
    nxt = r["next_alloc"]
    return (", ".join(f"{k} {v:.1f}" for k, v in r["freed"].items())
            + (f"; then {nxt['gib']:.2f} GiB on {nxt['stream']}" if nxt else ""))


def allocator_counts(device) -> dict:
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in _ALLOC}


def _model(args) -> str:
    """The preset profiled: --model, else llama-8b on GPU and tiny on CPU."""
    return args.model or ("llama-8b" if torch.cuda.is_available() else "tiny")


def run_rank(args) -> int:
    with arg_checks(step_check_level()):  # what `burstengine train` runs (cli/train.py)
        return _profile(args)


def _profile(args) -> int:
    on_gpu = torch.cuda.is_available()
    model = _model(args)
    seq = args.seq or (131072 if on_gpu else 512)
    # cp=0 (every rank in the ring) unless --set cp=N keeps data parallelism beside it, as in bench train
    over = ["cp=0"] + list(args.overrides) + [f"seq_len={seq}", "progress=false", f"steps={args.warmup + 1}",
                                              "batch_size=1", "grad_accum=1", "eval_every=0"]
    cfg = load(model, over)
    try:
        trainer = Trainer(cfg, echo=False, lock=False)  # never writes a run directory
    except ValueError as e:  # the data or the model: the same on every rank, said once
        if dist.get_rank() == 0:
            print(f"burstengine bench profile: error: {e}", file=sys.stderr, flush=True)
        return 2
    dev = trainer.device
    for step in range(args.warmup):
        trainer.train_step(trainer.batch(step), step)
    batch = trainer.batch(args.warmup)
    alloc = allocator_counts(dev) if on_gpu else None
    prof, wall = profiled(lambda: trainer.train_step(batch, args.warmup), dev)
    if on_gpu:
        alloc = {k: v - alloc[k] for k, v in allocator_counts(dev).items()}
    if args.trace and dist.get_rank() == 0:
        prof.export_chrome_trace(args.trace)
    summary, acts = breakdown(prof, wall, on_gpu, args.top)
    mesh = trainer.mesh
    tokens = seq * mesh.dp // dist.get_world_size()  # a GPU's share of the step's dp sequences of seq tokens
    row = {
        "model": model, "seq_len": seq, "overrides": args.overrides, "world": dist.get_world_size(),
        "cp": mesh.cp, "dp": mesh.dp, "step_wall_s": wall,
        "tokens_per_s_per_gpu": tokens / wall, "flops_per_token": trainer.flops_per_token,
        "mfu": tokens / wall * trainer.flops_per_token / trainer.peak if trainer.peak else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if on_gpu else None,
        # what the allocator held at its peak (cached blocks too): a retry happens when this meets the card
        "peak_reserved_gib": torch.cuda.max_memory_reserved(dev) / 2**30 if on_gpu else None,
        **summary,
    }
    if on_gpu:
        row.update(timeline(acts, wall * 1e6))
        row["idle"] = idle_causes(prof, acts)
        row["allocator"] = alloc
        if args.memory_trace:  # its own step: recording the history slows the allocator
            nxt = trainer.batch(args.warmup + 1)
            row["memory_trace"] = memory_trace(lambda: trainer.train_step(nxt, args.warmup + 1), dev,
                                               stream_names(trainer.model, dev))
    if dist.get_rank() == 0:
        print(f"{model} S={seq} on {torch.cuda.get_device_name() if on_gpu else 'cpu'}: step {wall:.3f} s, "
              f"busy {row['gpu_busy_s' if on_gpu else 'cpu_busy_s']:.3f} s, host gaps {row['host_gap_s']:.3f} s"
              + (f", MFU {row['mfu']:.1%}" if row["mfu"] else ""))
        print("\n".join(category_lines(row, wall, "step")))
        if on_gpu:
            g, t = row["compute_gaps_s"], row["transfers_s"]
            print(f"no compute kernel running: {g['forward']:.3f} s in the forward, {g['backward']:.3f} s in the "
                  f"backward; host transfers {t['dtoh']:.3f} s to the host, {t['htod']:.3f} s back, "
                  f"{row['transfer_only_s']:.3f} s of them under no compute")
            for kind, c in row["collectives_s"].items():
                print(f"{kind} collectives: {c['kernel_s']:.3f} s of kernels, {c['exposed_s']:.3f} s exposed")
            print("\n".join(idle_lines(row)))
            if "memory_trace" in row:
                print("\n".join(memory_lines(row["memory_trace"])))
        name = args.name or f"profile_{model}_{seq}"
        print("record:", write_record(name, row, out_dir=args.out_dir))
    return 0


def validate(args) -> str | None:
    """One line for arguments that cannot work (before any rank starts), else None."""
    if args.warmup < 0 or (args.seq is not None and args.seq < 1):
        return "--warmup must be >= 0 and --seq >= 1"
    refused = step_overrides_refused(args.overrides, "bench profile")
    if refused:
        return refused
    try:
        load(_model(args), list(args.overrides))
    except ValueError as e:
        return str(e)
    return None


build_parser, main = ranked_bench("profile", __doc__, add_arguments, run_rank, validate)

# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    wall = rec["step_wall_s"]
    busy = rec.get("gpu_busy_s", rec.get("cpu_busy_s"))
    mfu = f", MFU {rec['mfu'] * 100:.1f}%" if rec.get("mfu") else ""
    mem = f", peak {fixed(rec['peak_mem_gib'], 1)} GiB" if rec.get("peak_mem_gib") else ""
    head = [f"{rec['model']} at {rec['seq_len']} tokens on {rec['world']} rank(s), overrides "
            f"`{' '.join(rec.get('overrides') or []) or 'none'}`: one step {fixed(wall, 3)} s, kernels busy "
            f"{fixed(busy, 3)} s{mfu}{mem}.", ""]
    body = [[c, fixed(t, 3), f"{100 * t / wall:.1f}%"] for c, t in rec["categories_s"].items()]
    body.append(["host gaps (nothing running)", fixed(rec["host_gap_s"], 3), f"{100 * rec['host_gap_s'] / wall:.1f}%"])
    tail = []
    if "compute_gaps_s" in rec:  # bench profile's timeline (later records)
        g, t = rec["compute_gaps_s"], rec["transfers_s"]
        tail = ["", f"No compute kernel running: {fixed(g['forward'], 3)} s in the forward, {fixed(g['backward'], 3)} s "
                    f"in the backward; host transfers {fixed(t['dtoh'], 3)} s to the host and {fixed(t['htod'], 3)} s "
                    f"back, {fixed(rec['transfer_only_s'], 3)} s of them under no compute kernel."]
    if "collectives_s" in rec:  # which collectives the step waited on (later records)
        tail += ["", "Collectives: " + "; ".join(
            f"{kind} {fixed(c['kernel_s'], 3)} s of kernels, {fixed(c['exposed_s'], 3)} s under no computing kernel"
            for kind, c in rec["collectives_s"].items()) + " (fsdp: all-gather / reduce-scatter; ring: send / recv)."]
    if rec.get("idle"):  # the idle time by its host-side cause (later records)
        idle = rec["idle"]
        tail += ["", f"The GPU idle {fixed(idle['gaps_s'], 3)} s in gaps of at least {idle['min_gap_us']:g} us "
                     f"({fixed(idle['short_gaps_s'], 3)} s more in shorter ones), by the host op running then "
                     f"(the shortest one, on any thread):", ""]
        tail += table(["host op", "seconds", "gaps", "inside"],
                      [[f"`{c['op']}`", fixed(c["s"], 3), str(c["gaps"]), c["inside"]] for c in idle["causes"]])
    if rec.get("allocator"):
        held = f" (at most {fixed(rec['peak_reserved_gib'], 1)} GiB held)" if rec.get("peak_reserved_gib") else ""
        tail += ["", f"The caching allocator in the step{held}: " + ", ".join(
            f"{k[4:].replace('_', ' ')} {v}" for k, v in rec["allocator"].items()) + "."]
    tail.append("")
    return head + table(["category", "seconds", "share of the step"], body) + tail


SECTIONS = (Section("Where a training step's time goes", r"^profile_", render,
                    "`burstengine bench profile`: one step under torch.profiler, kernel time by category."),)


# docs/training.md: the 7B step at 128K on 2 GPUs under three plans, one device call (what idles it)
IDLE_RUNS = (("the default plan then (offload off)", "profile_7b_2gpu_131072_idle.json"),
             ("activation offload on", "profile_7b_2gpu_131072_offload.json"),
             ("7 GiB less activation memory planned", "profile_7b_2gpu_131072_budget66.json"),
             ("offload on, the ring's last gradient hop home in bf16 (32275b9)", "profile_7b_2gpu_131072_home16.json"),
             ("the same, before its allocator-history step (ba22062)", "profile_7b_2gpu_131072_memtrace.json"),
             ("the same, allocator garbage_collection_threshold 0.9", "profile_7b_2gpu_131072_gc09.json"),
             ("the same, allocator garbage_collection_threshold 0.75", "profile_7b_2gpu_131072_gc075.json"),
             ("the sharded gradients from the compute stream's pool (4d5154c)", "profile_7b_2gpu_131072_pool.json"))
# bench profile --memory-trace: what each stream held when the allocator retried
MEMORY_RUN = "profile_7b_2gpu_131072_memtrace.json"


def block_profile_idle(records):
    body = []
    for what, name in IDLE_RUNS:
        rec = record(records, name)
        idle, top = rec["idle"], rec["idle"]["causes"][0]
        moved = rec.get("transfers_s", {})
        body.append([what, fixed(rec["step_wall_s"], 2), f"{100 * rec['mfu']:.1f}%", fixed(idle["gaps_s"], 2),
                     f"{fixed(top['s'], 2)} in `{top['op']}` ({top['inside'].split(' < ')[1] if ' < ' in top['inside'] else ''})",
                     str(rec["allocator"]["num_alloc_retries"]), fixed(rec["collectives_s"]["ring"]["exposed_s"], 2),
                     f"{fixed(moved.get('dtoh', 0.0), 2)} / {fixed(rec.get('transfer_only_s', 0.0), 3)}",
                     fixed(rec["peak_mem_gib"], 1), f"`{name}` ({str(rec['commit'])[:7]})"])
    return "\n".join(["`bench profile --model llama-7b --seq 131072` over 2 ranks, one step profiled after one warm-up, "
                      f"on {device_of(record(records, IDLE_RUNS[0][1]))}:", ""]
                     + table(["plan", "s/step", "MFU", "GPU idle s", "largest idle cause s", "allocator retries",
                              "ring exposed s", "to host s / of it exposed", "peak GiB", "record"], body))


def block_memory_streams(records):
    """docs/training.md: per stream, what the caching allocator held at the 7B step's peak and
    before each release of cached memory (its retries), from the --memory-trace record."""
    rec = record(records, MEMORY_RUN)
    mt = rec["memory_trace"]
    body = [["the step's highest reserved total", ""] + [_held_cell(mt["at_peak"], k) for k in _STREAMS]]
    for i, r in enumerate(mt["releases"]):
        body.append([f"before release {i + 1}", released(r)] + [_held_cell(r["before"], k) for k in _STREAMS])
    return "\n".join([f"`bench profile --memory-trace`, llama-7b at 128K over 2 ranks on {device_of(rec)} (rank 0, "
                      f"`{MEMORY_RUN}`, {str(rec['commit'])[:7]}): GiB held / in use per stream, reserved at most "
                      f"{fixed(mt['peak_reserved_gib'], 1)} GiB:", ""]
                     + table(["moment", "freed by the release (GiB)"] + [f"{k} held / used" for k in _STREAMS], body))


_STREAMS = ("compute", "fsdp reduce scatter", "fsdp all gather copy in")


def _held_cell(view, k):
    x = view.get(k)
    return "—" if x is None else f"{fixed(x['reserved'], 1)} / {fixed(x['allocated'], 1)}"


BLOCKS = {"profile-idle": block_profile_idle, "memory-streams": block_memory_streams}

