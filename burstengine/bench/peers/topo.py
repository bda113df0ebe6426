"""Calibrate the cost model on this machine and check its predictions against measured runs.

    torchrun --nproc_per_node 2 -m burstengine bench topo --seqs 32768,131072
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node 2 -m burstengine bench topo --name topo_bench_2gpu_nop2p
    torchrun --nproc_per_node 4 -m burstengine bench topo --topology 2x2      # 2 emulated nodes x 2 GPUs
    torchrun --nproc_per_node 4 -m burstengine bench topo --topology 2x2 --inter-ctas 2   # ... a slow hop between

(a) Calibration: the local kernel's forward and backward time (``Kernel.forward_into`` /
``backward_into``, what the ring loops call) at every block shape the schemes below run; ring
shift bandwidth and latency (``batch_isend_irecv``, every rank sending and receiving at once, a
least-squares fit of latency + bytes / bandwidth over several sizes) on the whole group and on
the intra- and inter-node groups of ``--topology``; all-to-all bandwidth on the whole group.
(b) Measured: fwd+bwd of one attention call for the single-ring Burst and RingAttention
backward schemes, the double ring of ``--topology`` with both, the Ulysses peer and the hybrid
for every head-parallel degree that fits; median of ``--iters`` after ``--warmup``, slowest rank.
(c) The model's prediction of each from (a) alone, the error, and a JSON record holding the
raw times, the calibration and the cluster description (usable as ``BURST_CLUSTER`` or
``burstengine plan --cluster``).

``--inter-ctas N`` (NCCL) makes the hop between emulated nodes slow: every communicator whose
ranks span more than one node of ``--topology`` (a copy of the whole group, which the single
ring, the all-to-all and the double ring's last hop home run on, and the double ring's and the
hybrid's sub-groups that cross nodes) is made with ``ProcessGroupNCCL.Options`` whose
``config.min_ctas = max_ctas = N``: N channels, so a fraction of the link's bandwidth (NCCL
holds P2P channels to max_ctas too).  Groups inside a node stay default.  The calibration
measures every link on the communicator the schemes use, so the single ring's "world" link is
the slow one, as a real 2-node ring's step is bound by its inter-node hop.

``--device cpu`` runs the same on gloo processes at a tiny size (the test suite does); without\ntorchrun ``burstengine bench topo`` spawns --world local ranks itself.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

import torch
import torch.distributed as dist

import burstengine as be

from ... import costmodel as cm
from ...comm import topology as topo
from ...attention.hybrid import hybrid_mesh
from ...comm.ring import Ring
from ...kernels import get_kernel
from ...layout import LAYOUTS
from ...timing import median, timed
from ..harness import device_backend, ranked_bench
from ..launch import add_launch_arguments
from ..records import OUT_DIR_HELP, write_record
from ..tables import Section, med, ms, num, rate, table
from ..usage import fill_device_defaults, kernel_error
from . import peer_attention as peers

SCHEMES = ("burst", "ring", "burst_double", "ring_double", "ulysses", "hybrid")


# --device cpu: sizes that finish in well under a minute on 2 cores
CPU_DEFAULTS = dict(seqs="512,1024", heads=4, head_dim=16, warmup=1, iters=2)
GPU_DEFAULTS = dict(seqs="32768,131072", heads=32, head_dim=128, warmup=2, iters=5)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seqs", default=None, help="global sequence lengths, comma-separated "
                                                "[cuda: 32768,131072, cpu: 512,1024]")
    p.add_argument("--heads", type=int, default=None, help="[cuda: 32, cpu: 4]")
    p.add_argument("--kv-heads", type=int, default=None, help="[= heads]")
    p.add_argument("--head-dim", type=int, default=None, help="[cuda: 128, cpu: 16]")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--layout", default="zigzag")
    p.add_argument("--kernel", default=None, help="local kernel [cudnn on CUDA, reference on CPU]")
    p.add_argument("--topology", default=None,
                   help="nodes x GPUs per node of the double ring, e.g. 2x2 [2 x world/2]")
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--inter-ctas", type=int, default=None,
                   help="NCCL only: make the hop between emulated nodes slow, every communicator that spans "
                        "nodes held to this many channels (CTAs) [off]")
    p.add_argument("--link-sizes", default=None, help="message sizes (bytes) of the link fit, comma-separated")
    p.add_argument("--warmup", type=int, default=None, help="[cuda: 2, cpu: 1]")
    p.add_argument("--iters", type=int, default=None, help="[cuda: 5, cpu: 2]")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="[cuda when available]")
    p.add_argument("--name", default=None, help="record name [topo_bench_<world>gpu or _<world>cpu]")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    add_launch_arguments(p)


def fill_defaults(args):
    """The device's default sizes where none were given (``run`` calls it too)."""
    fill_device_defaults(args, CPU_DEFAULTS, GPU_DEFAULTS)
    return args


def validate(args) -> str | None:
    """One line for arguments that cannot work (before any rank starts), else None."""

    if args.device == "cuda" and not torch.cuda.is_available():
        return "--device cuda needs GPUs; use --device cpu for a gloo run"
    bad = [s for s in args.schemes.split(",") if s and s not in SCHEMES]
    if bad:
        return f"--schemes: unknown {bad}; known: {', '.join(SCHEMES)}"
    if args.layout not in LAYOUTS:
        return f"--layout: unknown {args.layout!r}; known: {', '.join(LAYOUTS)}"
    try:
        seqs = [int(x) for x in str(args.seqs).split(",") if x]
        sizes = [int(x) for x in str(args.link_sizes).split(",") if x] if args.link_sizes else [1]
    except ValueError:
        return f"--seqs and --link-sizes take comma-separated integers, got {args.seqs!r}, {args.link_sizes!r}"
    if not seqs or min(seqs + sizes) < 1:
        return "--seqs and --link-sizes must be positive"
    bad = [S for S in seqs if S % (2 * args.world)]
    if bad:
        return f"--seqs {bad}: each must be a multiple of 2 x {args.world} ranks"
    if min(args.heads, args.head_dim, args.iters) < 1 or args.warmup < 0:
        return "--heads, --head-dim and --iters must be >= 1, --warmup >= 0"
    if args.kv_heads is not None and (args.kv_heads < 1 or args.heads % args.kv_heads):
        return f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})"
    if args.topology:
        try:
            shape = topo.Topology.parse(args.topology)
        except ValueError as e:
            return f"--topology: {e}"
        if shape.world != args.world:
            return f"--topology {shape} does not describe the {args.world} ranks"
    if args.inter_ctas is not None:
        if args.device != "cuda":
            return "--inter-ctas limits NCCL's channels: it needs --device cuda (gloo has none)"
        if args.inter_ctas < 1:
            return f"--inter-ctas must be >= 1, got {args.inter_ctas}"
        shape = bench_shape(args.topology, args.world)
        if shape is None or shape.nodes == 1:
            return f"--inter-ctas needs a --topology of more than one node, got {shape or args.topology!r}"

    return kernel_error(args.kernel, args.device, backward=True)  # it times the backward too


def bench_shape(topology, G) -> topo.Topology | None:
    """The double ring's nodes x GPUs: ``--topology``, else 2 x G/2 when G is even, else None."""
    if topology:
        return topo.Topology.parse(topology)
    return topo.Topology(2, G // 2) if G % 2 == 0 and G > 1 else None


def fit_link(sizes, secs) -> cm.Link:
    """Least squares t = latency + bytes / bandwidth."""
    n = len(sizes)
    mx, my = sum(sizes) / n, sum(secs) / n
    sxx = sum((x - mx) ** 2 for x in sizes)
    slope = sum((x - mx) * (y - my) for x, y in zip(sizes, secs)) / sxx if sxx else 0.0
    if slope <= 0:  # flat or noisy: take the largest message's throughput, no latency
        return cm.Link(sizes[-1] / secs[-1] / 1e9, 0.0)
    lat = max(0.0, my - slope * mx)
    return cm.Link(1.0 / slope / 1e9, lat * 1e6)


# --- a slow hop between emulated nodes ------------------------------------------------------------

def nccl_channels(ctas: int):
    """Options of an NCCL communicator held to ``ctas`` channels (CTAs), fresh for each group
    (new_group writes the group's name and ranks into them).  Only reached on CUDA builds:
    validate() refuses --inter-ctas without --device cuda."""
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.min_ctas = opts.config.max_ctas = ctas
    return opts


def crossing(shape: topo.Topology, make):
    """``options_for`` of topology.block_group: ``make()`` for a block of ranks that spans nodes
    of ``shape``, None (the default options) for one inside a node."""
    return lambda block: make() if shape.spans(block) else None


def partitions(shape: topo.Topology, layout: str, hybrid_us) -> list[list[list[int]]]:
    """Every partition of the ranks into sub-groups the measured schemes make: the double ring's
    intra- and inter-node blocks, then each hybrid degree's Ulysses and ring blocks."""
    out = list(topo.node_blocks(shape))
    for U in hybrid_us:
        out += list(hybrid_mesh(layout, shape.world, U))
    return out


def slow_group(shape: topo.Topology, options_for, parts, timeout=None):
    """A copy of the whole job's group made with ``options_for`` and, under it, the sub-groups
    of ``parts`` (each with ``options_for`` of its block), all made here, in the same order on
    every rank: the attention calls run on the copy find them in block_group's cache."""
    whole = list(range(shape.world))
    group = topo.make_groups([whole], timeout, options_for)[tuple(whole)]
    for blocks in parts:
        topo.block_group(group, blocks, timeout, options_for)
    return group


def hybrid_cluster(single: cm.Cluster, shape: topo.Topology, layout: str, U: int, links: dict) -> cm.Cluster:
    """The one-level cluster the hybrid at ``U`` runs on when the hop between nodes is slow: its
    ring on the inter-node link when its ring groups span nodes, else the intra-node one; its
    all-to-all likewise (``links``: name -> Link as calibrated: intra, inter, a2a, a2a_intra)."""
    u_blocks, r_blocks = hybrid_mesh(layout, shape.world, U)
    ring = links["inter"] if any(shape.spans(b) for b in r_blocks) else links["intra"]
    a2a = links["a2a"] if any(shape.spans(b) for b in u_blocks) else links["a2a_intra"]
    return dataclasses.replace(single, intra=ring, inter=ring, a2a_intra=a2a, a2a_inter=a2a)


# --- calibration ------------------------------------------------------------------------------

def measure_link(group, sizes, device, warmup, iters):
    """Ring shift over ``group``: -> (fitted Link, median seconds per size)."""
    ring = Ring(group)
    raw = []
    for nbytes in sizes:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        raw.append(median(timed(lambda: ring.shift([buf], "forward", ["x"]).wait(), device, group, warmup, iters)))
    return fit_link(sizes, raw), raw


def measure_a2a(group, sizes, device, warmup, iters):
    """all_to_all_single of ``size`` bytes per rank; bandwidth counts what leaves a rank."""
    G = dist.get_world_size(group)
    raw = []
    for nbytes in sizes:
        nbytes -= nbytes % G
        x = torch.empty(nbytes, dtype=torch.uint8, device=device)
        y = torch.empty_like(x)
        raw.append(median(timed(lambda: dist.all_to_all_single(y, x, group=group), device, group, warmup, iters)))
    return fit_link([s * (G - 1) / G for s in sizes], raw), raw


def measure_kernel(kernel, device, dtype, B, sq, sk, H, Hkv, D, mask, group, warmup, iters):
    """(fwd_s, bwd_s) of one forward_into / backward_into call on a (sq x sk) block."""
    g = torch.Generator(device=device).manual_seed(sq * 7 + sk)
    q, do = (torch.randn(B, sq, H, D, device=device, dtype=dtype, generator=g) for _ in range(2))
    k, v = (torch.randn(B, sk, Hkv, D, device=device, dtype=dtype, generator=g) for _ in range(2))
    acc = torch.float32
    out = torch.zeros(B, sq, H, D, device=device, dtype=acc)
    lse = torch.full((B, H, sq), -math.inf, device=device, dtype=acc)
    scale = D ** -0.5
    kernel.forward_into(q, k, v, scale, mask, out, lse)
    delta = (do.to(acc) * out).sum(-1).transpose(1, 2).contiguous()
    lse0 = lse.clone()

    def fwd():
        out.zero_()
        lse.fill_(-math.inf)
        kernel.forward_into(q, k, v, scale, mask, out, lse)

    dq = torch.zeros(B, sq, H, D, device=device, dtype=acc)
    dk = torch.zeros(B, sk, Hkv, D, device=device, dtype=acc)
    dv = torch.zeros_like(dk)

    def bwd():
        kernel.backward_into(do, q, k, v, lse0, delta, scale, mask, dq, dk, dv)

    return median(timed(fwd, device, group, warmup, iters)), median(timed(bwd, device, group, warmup, iters))


# --- what runs --------------------------------------------------------------------------------

def hybrid_degrees(H, Hkv, G):
    """The head-parallel degrees U the bench runs the hybrid at on one group of G ranks: the cost
    model's (1 < U < G) and U = G itself (every head split: Ulysses through the hybrid's path)."""
    one_node = cm.Cluster(nodes=1, gpus_per_node=G)
    return cm.hybrid_degrees(one_node, cm.Attn(seq=G, heads=H, kv_heads=Hkv)) + (
        [G] if G > 1 and cm.kv_heads_for(H, Hkv, G) is not None else [])


def runs(schemes, H, Hkv, G, nodes):
    """(label, scheme, options) of every measured case."""
    out = []
    for s in schemes:
        if s in ("burst", "ring"):
            out.append((s, s, {}))
        elif s in ("burst_double", "ring_double") and nodes is not None:
            out.append((s, s, {}))
        elif s == "ulysses" and H % G == 0 and Hkv % G == 0:
            out.append((s, s, {}))
        elif s == "hybrid":
            out += [(f"hybrid:U={U}", s, {"ulysses": U}) for U in hybrid_degrees(H, Hkv, G)]
    return out


def make_fn(scheme, opts, group, shape, causal, layout, kernel, device):
    kw = dict(group=group, causal=causal, layout=layout, kernel=kernel)
    if scheme in ("burst", "ring"):
        return lambda q, k, v: be.burst_attn_func(q, k, v, backward=scheme, topology=None, **kw)
    if scheme in ("burst_double", "ring_double"):
        b = scheme.split("_")[0]
        return lambda q, k, v: be.burst_attn_func(q, k, v, backward=b, topology=shape, **kw)
    if scheme == "ulysses":
        fn = peers.ulysses(group, "cudnn" if device.type == "cuda" else "math")
        return lambda q, k, v: fn(q, k, v, causal)
    if scheme == "hybrid":
        return lambda q, k, v: be.hybrid_attn_func(q, k, v, ulysses=opts["ulysses"], backward="burst", **kw)
    raise ValueError(scheme)


def predict(scheme, opts, single: cm.Cluster, double: cm.Cluster | None, attn: cm.Attn) -> cm.Prediction:
    if scheme in ("burst", "ring"):
        return cm._ring(single, attn, scheme, False, scheme=scheme)
    if scheme in ("burst_double", "ring_double"):
        return cm._ring(double, attn, scheme.split("_")[0], True, scheme=scheme)
    if scheme == "ulysses":
        return cm._ulysses(single, attn)
    return cm._hybrid(single, attn, opts["ulysses"], backward="burst")


def kernel_shapes(attn: cm.Attn, G: int, hybrid_us) -> set:
    """Every (B, sq, sk, H, Hkv, D, mask) block the measured schemes compute."""
    keys = set()

    def add(a, world):
        for sq, sk, mk in cm._step_blocks(a, world):
            keys.add(cm.kernel_key(a.batch, sq, sk, a.heads, a.hkv, a.head_dim, mk))

    add(attn, G)
    for U in hybrid_us + [G]:
        hkv = cm.kv_heads_for(attn.heads, attn.hkv, U)
        if hkv is None:
            continue
        add(dataclasses.replace(attn, heads=attn.heads // U, kv_heads=hkv // U), G // U)
    return keys


# --- the run ----------------------------------------------------------------------------------

def run(group, args, log=print) -> dict | None:
    """Everything above on the ranks of ``group``; rank 0 returns the record."""
    fill_defaults(args)
    rank, G = dist.get_rank(group), dist.get_world_size(group)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernel = get_kernel(args.kernel, device)
    H, Hkv, D = args.heads, args.kv_heads or args.heads, args.head_dim
    seqs = [int(s) for s in str(args.seqs).split(",") if s]
    shape = bench_shape(args.topology, G)
    if shape is not None and shape.world != G:
        raise ValueError(f"--topology {shape} does not describe the {G} ranks")
    say = log if rank == 0 else (lambda *a, **k: None)
    t0 = time.perf_counter()
    hyb = hybrid_degrees(H, Hkv, G)
    slow = args.inter_ctas is not None
    if slow:
        # every scheme below runs on this copy of the group; what crosses nodes is slow
        group = slow_group(shape, crossing(shape, lambda: nccl_channels(args.inter_ctas)),
                           partitions(shape, args.layout, hyb))

    # (a) calibration: links
    if args.link_sizes:
        sizes = [int(s) for s in str(args.link_sizes).split(",")]
    else:
        sizes = [1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28] if device.type == "cuda" else [1 << 12, 1 << 15, 1 << 18]
    cal = {"links": {}}
    world_link, raw = measure_link(group, sizes, device, args.warmup, args.iters)
    cal["links"]["world"] = dict(sizes=sizes, secs=raw, fit=dataclasses.asdict(world_link))
    intra_link = inter_link = world_link
    if shape is not None:
        intra_b, inter_b = topo.node_blocks(shape)
        # made in the order RingComm makes them, so the double ring below reuses these groups
        ig, og = topo.block_group(group, intra_b), topo.block_group(group, inter_b)
        for name, g, size in (("intra", ig, shape.gpus_per_node), ("inter", og, shape.nodes)):
            if size == 1:  # one-rank groups: that level of the ring has no hops
                continue
            link, raw = measure_link(g, sizes, device, args.warmup, args.iters)
            cal["links"][name] = dict(sizes=sizes, secs=raw, fit=dataclasses.asdict(link))
            if name == "intra":
                intra_link = link
            else:
                inter_link = link
    a2a, raw = measure_a2a(group, sizes, device, args.warmup, args.iters)
    cal["links"]["a2a"] = dict(sizes=sizes, secs=raw, fit=dataclasses.asdict(a2a))
    a2a_intra = a2a
    if slow and shape.gpus_per_node > 1:  # the hybrid's all-to-all inside a node stays fast
        a2a_intra, raw = measure_a2a(ig, sizes, device, args.warmup, args.iters)
        cal["links"]["a2a_intra"] = dict(sizes=sizes, secs=raw, fit=dataclasses.asdict(a2a_intra))
    say(f"[{time.perf_counter() - t0:6.1f}s] links (GB/s, us): world {world_link.gbps:.1f} {world_link.latency_us:.0f}"
        f" | intra {intra_link.gbps:.1f} {intra_link.latency_us:.0f} | inter {inter_link.gbps:.1f} "
        f"{inter_link.latency_us:.0f} | a2a {a2a.gbps:.1f} {a2a.latency_us:.0f}"
        + (f" | a2a intra {a2a_intra.gbps:.1f} {a2a_intra.latency_us:.0f} (inter-node hop: --inter-ctas "
           f"{args.inter_ctas})" if slow else ""))

    # (a) calibration: kernel at every block shape
    attns = [cm.Attn(S, H, Hkv, D, 1, args.causal, torch.tensor([], dtype=dtype).element_size(), args.layout)
             for S in seqs]
    keys = sorted(set().union(*(kernel_shapes(a, G, [u for u in hyb if u < G]) for a in attns)))
    ktimes = []
    for key in keys:
        B, sq, sk, h, hkv, d, mask = key
        f, b = measure_kernel(kernel, device, dtype, B, sq, sk, h, hkv, d, mask, group, args.warmup, args.iters)
        ktimes.append((key, f, b))
        say(f"[{time.perf_counter() - t0:6.1f}s] kernel {kernel.name} {sq}x{sk} H={h} Hkv={hkv} {mask}: "
            f"fwd {f * 1e3:.2f} ms ({rate(cm.block_flops(B, sq, sk, h, d, mask) / f)}), "
            f"bwd {b * 1e3:.2f} ms ({rate(2.5 * cm.block_flops(B, sq, sk, h, d, mask) / b)})")
    flops = [cm.block_flops(k[0], k[1], k[2], k[3], k[5], k[6]) for k, _, _ in ktimes]
    fwd_tf = sum(flops) / sum(f for _, f, _ in ktimes) / 1e12
    bwd_tf = 2.5 * sum(flops) / sum(b for _, _, b in ktimes) / 1e12
    name = f"{device.type}-{G}x{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
    single = cm.Cluster(1, G, world_link, world_link, fwd_tf, bwd_tf, a2a, None, tuple(ktimes), name,
                        "calibrated by burstengine bench topo")
    double = dataclasses.replace(single, nodes=shape.nodes, gpus_per_node=shape.gpus_per_node, intra=intra_link,
                                 inter=inter_link) if shape is not None else None
    links = dict(intra=intra_link, inter=inter_link, a2a=a2a, a2a_intra=a2a_intra)

    # (b) measured and (c) predicted
    rows = []
    cases = runs([s for s in args.schemes.split(",") if s], H, Hkv, G, shape)
    for attn in attns:
        S, n = attn.seq, attn.seq // G
        g = torch.Generator(device=device).manual_seed(S)
        qkv = [torch.randn(1, n, h, D, device=device, dtype=dtype, generator=g).requires_grad_()
               for h in (H, Hkv, Hkv)]
        qkv.append(torch.randn(1, n, H, D, device=device, dtype=dtype, generator=g))  # dO
        for label, scheme, opts in cases:
            fn = make_fn(scheme, opts, group, shape, args.causal, args.layout, args.kernel, device)

            def step(fn=fn):
                fn(*qkv[:3]).backward(qkv[3])

            meas = timed(step, device, group, args.warmup, args.iters)
            p = predict(scheme, opts, hybrid_cluster(single, shape, args.layout, opts["ulysses"], links)
                        if slow and scheme == "hybrid" else single, double, attn)
            m = median(meas)
            rows.append(dict(label=label, scheme=scheme, S=S, H=H, Hkv=Hkv, D=D, causal=args.causal, world=G,
                             topology=str(shape) if scheme.endswith("double") else f"1x{G}", measured_s=m,
                             raw_s=meas, predicted_s=p.total_s, error=(p.total_s - m) / m,
                             prediction=p.to_dict(), tflops=attn.flops() / G / m / 1e12))
            say(f"[{time.perf_counter() - t0:6.1f}s] S={S} {label}: measured {m * 1e3:.2f} ms, predicted "
                f"{p.total_s * 1e3:.2f} ms ({100 * rows[-1]['error']:+.1f}%)")
        del qkv
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank != 0:
        return None
    hop = dict(inter_ctas=args.inter_ctas, intra_gbps=intra_link.gbps, inter_gbps=inter_link.gbps,
               world_gbps=world_link.gbps,
               how=(f"--inter-ctas {args.inter_ctas}: every NCCL communicator spanning emulated nodes made with "
                    f"ProcessGroupNCCL.Options config.min_ctas = max_ctas = {args.inter_ctas}; intra-node ones default"
                    if slow else "not slowed: every communicator default"))
    return dict(world=G, topology=str(shape) if shape else None, kernel=kernel.name, dtype=str(dtype),
                args=vars(args), calibration=cal, cluster=single.to_dict(),
                double_cluster=double.to_dict() if double else None, inter_hop=hop, rows=rows)


def print_table(rec, file=None):
    file = file or sys.stdout  # per call, not bound at import
    hdr = (f"{'case':14s} {'topology':>8s} {'S':>8s} {'measured ms':>12s} {'predicted ms':>12s} {'error':>7s} "
           f"{'compute ms':>10s} {'exposed ms':>10s} {'FLOP/s/rank':>11s}")
    print(hdr, file=file)
    print("-" * len(hdr), file=file)
    for r in rec["rows"]:
        p = r["prediction"]
        print(f"{r['label']:14s} {r['topology']:>8s} {r['S']:>8d} {r['measured_s'] * 1e3:12.2f} "
              f"{r['predicted_s'] * 1e3:12.2f} {100 * r['error']:+6.1f}% {p['compute_s'] * 1e3:10.2f} "
              f"{p['exposed_s'] * 1e3:10.2f} {rate(r['tflops'] * 1e12):>11s}", file=file)
    hop = rec.get("inter_hop")
    if hop:
        print(f"inter-node hop: {hop['how']}; intra {hop['intra_gbps']:.1f} GB/s, inter {hop['inter_gbps']:.1f} GB/s, "
              f"whole group {hop['world_gbps']:.1f} GB/s", file=file)
    worst = max((abs(r["error"]) for r in rec["rows"]), default=0.0)
    print(f"largest |error|: {100 * worst:.1f}%", file=file)


def run_rank(args) -> int:
    rec = run(None, args)
    if rec is not None:
        print_table(rec)
        unit = "gpu" if args.device == "cuda" else "cpu"
        slow = f"_interctas{args.inter_ctas}" if args.inter_ctas is not None else ""
        path = write_record(args.name or f"topo_bench_{rec['world']}{unit}{slow}", rec, args.out_dir)
        print(f"wrote {path}")
    return 0


build_parser, main = ranked_bench("topo", __doc__, add_arguments, run_rank, validate, prepare=fill_defaults,
                                  backend=device_backend)


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    body = [[r["label"], r["S"], f"{r['H']}/{r['Hkv']}", r["topology"], ms(med(r["raw_s"])), ms(r["predicted_s"]),
             f"{(r['predicted_s'] - med(r['raw_s'])) / med(r['raw_s']):+.1%}"] for r in rec["rows"]]
    c = rec.get("cluster") or {}
    head = []
    if c:
        head = [f"Calibrated: intra {num(c['intra']['gbps'])} GB/s + {num(c['intra']['latency_us'])} µs, "
                f"inter {num(c['inter']['gbps'])} GB/s + {num(c['inter']['latency_us'])} µs, kernels "
                f"{num(c['fwd_tflops'])} / {num(c['bwd_tflops'])} TFLOP/s fwd / bwd.", ""]
        hop = rec.get("inter_hop")
        if hop and hop.get("inter_ctas") is not None:
            head[-1:-1] = [f"Inter-node hop: {hop['how']}; measured intra {num(hop['intra_gbps'])} GB/s, inter "
                           f"{num(hop['inter_gbps'])} GB/s."]
    return head + table(["scheme", "S", "H/Hkv", "topology", "measured ms", "predicted ms", "prediction error"], body)


SECTIONS = (Section("Topology: measured against the cost model", r"^topo_bench", render,
                    "`burstengine bench topo`: every scheme timed, beside the cost model calibrated on the same "
                    "machine."),)
