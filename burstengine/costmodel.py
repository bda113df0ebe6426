"""Predicted time of one attention forward + backward for each context-parallel scheme.

Inputs: a :class:`Cluster` (nodes, GPUs per node, per-link bandwidth and latency, local kernel
throughput or measured kernel times) and an :class:`Attn` shape.  The ring schemes are
simulated step by step on the same steps the code runs (schedule.order.double_ring_steps), with
the overlap rules of the implementation:

* each link ("intra", "inter") is one NCCL stream: transfers posted on it run one after the
  other, each taking ``latency + bytes / bandwidth``; different links run at once;
* a step's transfers are posted before its compute and waited for after it, so a step takes
  max(compute, what it waits for); the inter-node hop of the double ring is posted at the
  start of a round and waited for at its end;
* gradient partials go one step behind the data (Fig. 5); the last hop home is exposed;
* a single ring that crosses nodes goes at the pace of its inter-node hops;
* all-to-alls (Ulysses, the hybrid) are not overlapped with anything.

``predict(scheme, cluster, attn)`` gives a :class:`Prediction`; ``compare`` all schemes;
``choose_call`` is what ``burst_attn_func``'s "auto" choices use.  Without link figures the
choice degenerates to the byte count (backward) and to the double ring whenever there is more
than one node (topology).

Cluster figures come from ``burstengine bench topo`` (it writes a cluster JSON), from
``PRESETS``, or from the command line (``burstengine plan``); ``BURST_CLUSTER`` (a JSON path or
a preset name) gives them to ``burst_attn_func``.  It must be the same on every rank (it is
when set in the launch environment): the choice is a pure function of it and the shapes.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

from .schedule.order import Topology, double_ring_steps
from .schedule.traffic import backward_by_bytes, home_bytes, hop_bytes

GB = 1e9
ENV = "BURST_CLUSTER"  # read by attention/planning.py (cluster_from_env)


@dataclass(frozen=True)
class Link:
    """One direction of one GPU's link, measured with every GPU of the ring sending and
    receiving at once (what a ring shift does)."""

    gbps: float
    latency_us: float = 10.0

    def time(self, nbytes: float) -> float:
        return 0.0 if nbytes <= 0 else self.latency_us * 1e-6 + nbytes / (self.gbps * GB)


@dataclass(frozen=True)
class Cluster:
    nodes: int = 1
    gpus_per_node: int = 8
    intra: Link = Link(278.0, 10.0)
    inter: Link = Link(24.0, 20.0)
    fwd_tflops: float = 600.0        # local attention kernel, forward FLOPs / s per GPU
    bwd_tflops: float = 520.0        # backward: 2.5x the forward FLOPs / time
    a2a_intra: Link | None = None    # per-GPU all-to-all bandwidth inside a node (default: intra)
    a2a_inter: Link | None = None    # ... across nodes (default: inter)
    kernel_times: tuple = ()         # measured (key, fwd_s, bwd_s), key = kernel_key(...)
    name: str = "custom"
    notes: str = ""

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def topology(self) -> Topology:
        return Topology(self.nodes, self.gpus_per_node)

    def with_shape(self, nodes: int, gpus_per_node: int) -> "Cluster":
        return dataclasses.replace(self, nodes=nodes, gpus_per_node=gpus_per_node)

    def kernel_time(self, direction: str, B: int, sq: int, sk: int, H: int, Hkv: int, D: int, mask: str) -> float:
        """Seconds of one local kernel call (fwd, or bwd) on a (sq x sk) block."""
        for key, f, b in self.kernel_times:
            if tuple(key) == kernel_key(B, sq, sk, H, Hkv, D, mask):
                return f if direction == "fwd" else b
        flops = block_flops(B, sq, sk, H, D, mask) * (1.0 if direction == "fwd" else 2.5)
        return flops / ((self.fwd_tflops if direction == "fwd" else self.bwd_tflops) * 1e12)

    # --- JSON --------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["kernel_times"] = [dict(zip(KEY_FIELDS, key), fwd_s=f, bwd_s=b) for key, f, b in self.kernel_times]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Cluster":
        d = dict(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown cluster fields {sorted(unknown)}")
        for name in ("intra", "inter", "a2a_intra", "a2a_inter"):
            if isinstance(d.get(name), dict):
                d[name] = Link(**d[name])
        d["kernel_times"] = tuple((tuple(e[k] for k in KEY_FIELDS), float(e["fwd_s"]), float(e["bwd_s"]))
                                  for e in d.get("kernel_times", ()))
        return cls(**d)


KEY_FIELDS = ("B", "sq", "sk", "H", "Hkv", "D", "mask")


def kernel_key(B, sq, sk, H, Hkv, D, mask) -> tuple:
    return (int(B), int(sq), int(sk), int(H), int(Hkv), int(D), str(mask))


def block_flops(B: int, sq: int, sk: int, H: int, D: int, mask: str) -> float:
    """Forward FLOPs of one block: 4 B H D x visible pairs (a causal block is square)."""
    pairs = sq * sk if mask == "full" else sq * (sq + 1) / 2
    return 4.0 * B * H * D * pairs


# Figures for `burstengine plan --preset` (the measured ones are in docs/results.md, the paper's are
# nominal; kernel throughput of the A800 is an assumption, see notes).
PRESETS = {
    "h200-nvlink": Cluster(
        nodes=1, gpus_per_node=2, intra=Link(278.0, 15.0), inter=Link(24.0, 25.0), fwd_tflops=600.0, bwd_tflops=520.0,
        name="h200-nvlink",
        notes="2xH200 measured 2026-11-22: NCCL send/recv 278 GB/s per direction over NVLink, 24 GB/s with "
              "NCCL_P2P_DISABLE=1; cuDNN ~577 fwd / ~515 fwd+bwd TFLOP/s inside the ring at 128K (probe_speed_2gpu)"),
    "h200-shm": Cluster(
        nodes=1, gpus_per_node=2, intra=Link(24.0, 25.0), inter=Link(24.0, 25.0), fwd_tflops=600.0, bwd_tflops=520.0,
        name="h200-shm", notes="2xH200 with NCCL_P2P_DISABLE=1 (host shared memory, ~ one 200 Gb/s NIC)"),
    "a800-paper": Cluster(
        nodes=4, gpus_per_node=8, intra=Link(200.0, 10.0), inter=Link(25.0, 20.0), fwd_tflops=220.0, bwd_tflops=180.0,
        name="a800-paper",
        notes="BurstEngine's 32xA800: 400 GB/s NVLink (bidirectional: 200 GB/s per direction), 8x200 Gb/s IB "
              "(one 25 GB/s NIC per GPU); kernel throughput ASSUMED (FlashAttention-2 class on an A100-class GPU: "
              "~70% / ~58% of the 312 TFLOP/s bf16 peak forward / backward); latencies assumed"),
}


def load_cluster(spec: str) -> Cluster:
    """A preset name, a JSON file (a cluster dict, or a topo_bench record holding one under
    "cluster") or an inline JSON object."""
    if spec in PRESETS:
        return PRESETS[spec]
    if spec.lstrip().startswith("{"):
        d = json.loads(spec)
    elif os.path.exists(spec):
        with open(spec) as f:
            d = json.load(f)
    else:
        raise ValueError(f"cluster {spec!r} is neither a preset ({sorted(PRESETS)}), a JSON file nor inline JSON")
    return Cluster.from_dict(d.get("cluster", d))


@dataclass(frozen=True)
class Attn:
    """One attention call: global sequence, heads, ... (elem: bytes per element of q, k, v)."""

    seq: int
    heads: int
    kv_heads: int | None = None
    head_dim: int = 128
    batch: int = 1
    causal: bool = True
    elem: int = 2
    layout: str = "zigzag"

    @property
    def hkv(self) -> int:
        return self.kv_heads or self.heads

    def flops(self) -> float:
        """fwd + bwd FLOPs of the whole call (docs/design.md, "FLOP conventions": 3.5 x 4 B H S^2 D, halved for causal)."""
        return 3.5 * 4.0 * self.batch * self.heads * self.seq ** 2 * self.head_dim * (0.5 if self.causal else 1.0)


@dataclass
class Prediction:
    scheme: str
    feasible: bool = True
    why: str = ""
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    compute_s: float = 0.0      # kernel time alone, fwd + bwd
    comm_s: float = 0.0         # time this rank's links are busy, fwd + bwd (overlapped or not)
    comm_only_s: float = 0.0    # the same schedule with instant compute: Table 1's communication time
    intra_bytes: int = 0        # what one rank sends
    inter_bytes: int = 0
    config: dict = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s

    @property
    def exposed_s(self) -> float:
        """Time not covered by compute: communication (and waiting) on the critical path."""
        return max(0.0, self.total_s - self.compute_s)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(total_s=self.total_s, exposed_s=self.exposed_s)
        return d


SCHEMES = {
    "ring": "RingAttention: single ring, K/V and dK/dV travel",
    "double_ring": "DoubleRing (LoongTrain): double ring, gradient hops not overlapped",
    "burst": "Burst, single ring (Q/dO/lse/D and dQ travel)",
    "burst_double": "Burst, topology-aware double ring (BurstEngine)",
    "ring_double": "Burst double ring with the ring backward (K/V/dK/dV)",
    "ulysses": "Ulysses: all-to-all over heads, no overlap",
    "hybrid": "Hybrid: Ulysses over heads x Burst ring (USP)",
}
# schemes burstengine runs (DoubleRing is a peer the model describes from the paper), in the
# order that breaks ties
OURS = ("burst_double", "ring_double", "burst", "ring", "hybrid", "ulysses")


# --- ring schemes -----------------------------------------------------------------------------

def _step_blocks(attn: Attn, G: int) -> list[tuple[int, int, str]]:
    """(sq, sk, mask) of the block the slowest rank computes at each ring step."""
    n = attn.seq // G
    if not attn.causal:
        return [(n, n, "full")] * G
    if attn.layout == "zigzag" and G > 1:
        return [(n, n, "causal")] + [(n, n // 2, "full")] * (G - 1)
    if attn.layout == "striped":
        return [(n, n, "causal")] * G
    return [(n, n, "causal")] + [(n, n, "full")] * (G - 1)  # contiguous: the last rank's full blocks


def _simulate(steps, comp, data, grad, links: dict, home: Link, grads="overlap",
              home_grad=None) -> tuple[float, float, dict]:
    """Run the steps on the clock: -> (time, link busy time, bytes sent per link).  ``home_grad``:
    the bytes of the last partial's hop home (default ``grad``; the code sends it in the input
    dtype, schedule.home_bytes)."""
    home_grad = grad if home_grad is None else home_grad
    now, busy = 0.0, 0.0
    free = {"intra": 0.0, "inter": 0.0}
    sent = {"intra": 0, "inter": 0}
    data_at, grad_at = {}, {}

    def send(link, nbytes, t0):
        nonlocal busy
        start = max(t0, free[link])
        dt = links[link].time(nbytes)
        free[link] = start + dt
        busy += dt
        sent[link] += nbytes
        return free[link]

    for i, p in enumerate(steps):
        if p.data_inter:
            data_at["inter"] = send("inter", data, now)
        if p.data_intra:
            data_at["intra"] = send("intra", data, now)
        if grad and p.grad_out and grads == "overlap":
            grad_at[p.grad_out] = send(p.grad_out, grad, now)
        t = now + comp[i]
        if grad and grads == "overlap":
            for link in p.grad_in:
                t = max(t, grad_at.pop(link))
        elif grad and i + 1 < len(steps):
            # not overlapped: the partial leaves after the compute and lands before the next step
            t = send(steps[i + 1].grad_out, grad, t)
        if p.next_from:
            t = max(t, data_at.pop(p.next_from))
        now = t
    if grad and len(steps) > 1:
        dt = home.time(home_grad)
        busy += dt
        sent[home_link_name(steps)] += home_grad
        now += dt
    return now, busy, sent


def home_link_name(steps) -> str:
    return "inter" if steps[-1].round > 0 else "intra"


def _ring(cluster: Cluster, attn: Attn, backward: str, double: bool, grads="overlap", scheme="") -> Prediction:
    G = cluster.world
    if attn.seq % G or (attn.layout == "zigzag" and (attn.seq // G) % 2):
        return Prediction(scheme, False, f"sequence {attn.seq} does not split over {G} ranks in layout {attn.layout}")
    if attn.heads % attn.hkv:
        return Prediction(scheme, False, "heads not a multiple of kv heads")
    nodes, m = (cluster.nodes, cluster.gpus_per_node) if double else (1, G)
    steps = double_ring_steps(nodes, m)
    if double:
        links = {"intra": cluster.intra, "inter": cluster.inter}
        home = cluster.inter if nodes > 1 else cluster.intra
    else:
        # one ring: every step waits for its slowest hop, inter-node as soon as it crosses nodes
        slow = cluster.intra
        if cluster.nodes > 1:
            slow = Link(min(cluster.intra.gbps, cluster.inter.gbps), max(cluster.intra.latency_us, cluster.inter.latency_us))
        links = {"intra": slow, "inter": slow}
        home = slow
    B, n, H, Hkv, D, e = attn.batch, attn.seq // G, attn.heads, attn.hkv, attn.head_dim, attn.elem
    blocks = _step_blocks(attn, G)
    cf = [cluster.kernel_time("fwd", B, sq, sk, H, Hkv, D, mk) for sq, sk, mk in blocks]
    cb = [cluster.kernel_time("bwd", B, sq, sk, H, Hkv, D, mk) for sq, sk, mk in blocks]
    fdata, _ = hop_bytes("forward", B, n, H, Hkv, D, e)
    bdata, bgrad = hop_bytes(backward, B, n, H, Hkv, D, e)
    bhome = home_bytes(backward, B, n, H, Hkv, D, e)
    tf, busy_f, sf = _simulate(steps, cf, fdata, 0, links, home)
    tb, busy_b, sb = _simulate(steps, cb, bdata, bgrad, links, home, grads, bhome)
    zero = [0.0] * G
    only = (_simulate(steps, zero, fdata, 0, links, home)[0]
            + _simulate(steps, zero, bdata, bgrad, links, home, grads, bhome)[0])
    labels = cluster.topology if double else None
    intra, inter = _split(sf, sb, labels, cluster)
    return Prediction(scheme, True, "", tf, tb, sum(cf) + sum(cb), busy_f + busy_b, only, intra, inter,
                      dict(topology=str(Topology(nodes, m)), backward=backward))


def _split(sf, sb, labels, cluster):
    tot = {k: sf[k] + sb[k] for k in sf}
    if labels is None and cluster.nodes > 1:
        # a single ring across nodes: the rank at a node's edge sends every hop inter-node
        return 0, tot["intra"] + tot["inter"]
    return tot["intra"], tot["inter"]


# --- all-to-all schemes -----------------------------------------------------------------------

def _a2a(cluster: Cluster, nbytes: float, size: int, per_node: int) -> tuple[float, float, float]:
    """All-to-all of ``nbytes`` per rank over ``size`` ranks, ``per_node`` of them per node:
    -> (time, intra bytes sent, inter bytes sent)."""
    if size == 1:
        return 0.0, 0.0, 0.0
    a_in = cluster.a2a_intra or cluster.intra
    a_out = cluster.a2a_inter or cluster.inter
    b_in = nbytes * (per_node - 1) / size
    b_out = nbytes * (size - per_node) / size
    t = max(a_in.latency_us if per_node > 1 else 0.0, a_out.latency_us if size > per_node else 0.0) * 1e-6
    t += max(b_in / (a_in.gbps * GB) if b_in else 0.0, b_out / (a_out.gbps * GB) if b_out else 0.0)
    return t, b_in, b_out


def head_split(H: int, Hkv: int, U: int) -> int:
    """The hybrid head-split rule: K/V heads after sharding H query heads U ways (Ulysses) --
    Hkv when U divides them, else U when Hkv divides U (each K/V head repeated U / Hkv times, so
    that every rank gets one).  ValueError when U does not divide H or neither holds.  What
    hybrid_attn_func runs (attention/hybrid.py) and what the model predicts."""
    if H % U:
        raise ValueError(f"ulysses={U} does not divide the {H} query heads")
    if Hkv % U == 0:
        return Hkv
    if U % Hkv == 0:
        return U
    raise ValueError(f"{Hkv} k/v heads can be neither split nor repeated {U} ways")


def kv_heads_for(H: int, Hkv: int, U: int) -> int | None:
    """:func:`head_split`, None where it is impossible."""
    try:
        return head_split(H, Hkv, U)
    except ValueError:
        return None


def _ulysses_part(cluster, attn, U, per_node):
    """The all-to-alls of U-way head parallelism around a local computation: fwd a2a of
    q, k, v and out; bwd a2a of dout, dq, dk, dv.  -> (fwd_s, bwd_s, intra, inter)."""
    hkv = kv_heads_for(attn.heads, attn.hkv, U)
    n = attn.seq // cluster.world
    unit = attn.batch * n * attn.head_dim * attn.elem
    tensors = [attn.heads, hkv, hkv, attn.heads]  # q, k, v, out (fwd) = dout, dq, dk, dv (bwd)
    t, bi, bo = 0.0, 0.0, 0.0
    for h in tensors:
        dt, a, b = _a2a(cluster, unit * h, U, per_node)
        t, bi, bo = t + dt, bi + a, bo + b
    return t, t, 2 * bi, 2 * bo


def _ulysses(cluster: Cluster, attn: Attn) -> Prediction:
    G = cluster.world
    hkv = kv_heads_for(attn.heads, attn.hkv, G)
    if hkv is None:
        return Prediction("ulysses", False, f"{attn.heads} heads / {attn.hkv} kv heads do not shard {G} ways")
    if attn.seq % G:
        return Prediction("ulysses", False, f"sequence {attn.seq} does not split over {G} ranks")
    mask = "causal" if attn.causal else "full"
    args = (attn.batch, attn.seq, attn.seq, attn.heads // G, hkv // G, attn.head_dim, mask)
    kf, kb = cluster.kernel_time("fwd", *args), cluster.kernel_time("bwd", *args)
    af, ab, bi, bo = _ulysses_part(cluster, attn, G, min(G, cluster.gpus_per_node))
    return Prediction("ulysses", True, "", af + kf, ab + kb, kf + kb, af + ab, af + ab, int(bi), int(bo),
                      dict(ulysses=G))


def hybrid_degrees(cluster: Cluster, attn: Attn) -> list[int]:
    """Head-parallel degrees U (1 < U < world) the hybrid can use: U divides the world and the
    heads, and stays inside a node or spans whole nodes (head-first placement)."""
    G, m = cluster.world, cluster.gpus_per_node
    out = []
    for U in range(2, G):
        if G % U or kv_heads_for(attn.heads, attn.hkv, U) is None:
            continue
        if (U <= m and m % U) or (U > m and U % m):
            continue
        out.append(U)
    return out


def _hybrid(cluster: Cluster, attn: Attn, U: int, backward: str | None = None) -> Prediction:
    G, m = cluster.world, cluster.gpus_per_node
    R = G // U
    hkv = kv_heads_for(attn.heads, attn.hkv, U)
    per_node = min(U, m)
    af, ab, bi, bo = _ulysses_part(cluster, attn, U, per_node)
    # the ring over R ranks U apart: inter-node once the whole mesh spans nodes
    link = cluster.inter if G > m else cluster.intra
    inner = dataclasses.replace(cluster, nodes=1, gpus_per_node=R, intra=link, inter=link)
    sub = Attn(attn.seq, attn.heads // U, hkv // U, attn.head_dim, attn.batch, attn.causal, attn.elem, attn.layout)
    rings = [_ring(inner, sub, b, False, scheme="hybrid") for b in ((backward,) if backward else ("burst", "ring"))]
    r = min(rings, key=lambda p: (not p.feasible, p.total_s))
    if not r.feasible:
        return dataclasses.replace(r, scheme="hybrid")
    ring_inter = r.intra_bytes + r.inter_bytes if G > m else 0
    return Prediction("hybrid", True, "", r.fwd_s + af, r.bwd_s + ab, r.compute_s, r.comm_s + af + ab,
                      r.comm_only_s + af + ab, int(bi + (r.intra_bytes + r.inter_bytes - ring_inter)),
                      int(bo + ring_inter),
                      dict(ulysses=U, ring=R, backward=r.config["backward"]))


# --- the public entry points ------------------------------------------------------------------

def predict(scheme: str, cluster: Cluster, attn: Attn, *, ulysses: int | None = None) -> Prediction:
    """Predicted time of one fwd + bwd of ``scheme`` (see SCHEMES) on ``cluster``."""
    if scheme == "ring":
        return _ring(cluster, attn, "ring", False, scheme=scheme)
    if scheme == "burst":
        return _ring(cluster, attn, "burst", False, scheme=scheme)
    if scheme == "burst_double":
        return _ring(cluster, attn, "burst", True, scheme=scheme)
    if scheme == "ring_double":
        return _ring(cluster, attn, "ring", True, scheme=scheme)
    if scheme == "double_ring":
        return _ring(cluster, attn, "ring", True, grads="exposed", scheme=scheme)
    if scheme == "ulysses":
        return _ulysses(cluster, attn)
    if scheme == "hybrid":
        degrees = [ulysses] if ulysses else hybrid_degrees(cluster, attn)
        if not degrees:
            return Prediction("hybrid", False, "no head-parallel degree 1 < U < world divides the heads and the mesh")
        return min((_hybrid(cluster, attn, U) for U in degrees), key=lambda p: (not p.feasible, p.total_s))
    raise ValueError(f"unknown scheme {scheme!r}; expected one of {sorted(SCHEMES)}")


def compare(cluster: Cluster, attn: Attn) -> list[Prediction]:
    """Every scheme; on one node (or one GPU per node) the double rings are the single ones."""
    out = []
    for s in SCHEMES:
        if s in ("burst_double", "ring_double") and (cluster.nodes == 1 or cluster.gpus_per_node == 1):
            out.append(Prediction(s, False, "one ring level only: the same as the single ring"))
        else:
            out.append(predict(s, cluster, attn))
    return out


def best(preds: list[Prediction]) -> Prediction:
    """The fastest feasible scheme burstengine runs (ties: less communication, then the order of
    OURS)."""
    ours = [p for p in preds if p.feasible and p.scheme in OURS]
    return min(ours, key=lambda p: (p.total_s, p.comm_only_s, OURS.index(p.scheme)))


def choose_call(detected: Topology, B: int, n: int, H: int, Hkv: int, D: int, elem: int, causal: bool,
                layout: str, backward: str, cluster: Cluster | None) -> tuple[Topology, str]:
    """burst_attn_func's "auto": (ring shape, backward scheme) from shared inputs only.

    Without link figures: the detected node shape (double ring across nodes) and the backward
    that sends fewer bytes.  With them: the candidate the model predicts fastest; candidates
    are tried in a fixed order and a tie keeps the earlier one."""
    G = detected.world
    by_bytes = backward_by_bytes(B, n, H, Hkv, D, elem, G)
    backs = [backward] if backward != "auto" else [by_bytes, "ring" if by_bytes == "burst" else "burst"]
    if cluster is None:
        return detected, backs[0]
    shapes = [detected]
    if detected.nodes > 1 and detected.gpus_per_node > 1:
        shapes.append(Topology(1, G))
    attn = Attn(n * G, H, Hkv, D, B, causal, elem, layout)
    hw = cluster.with_shape(detected.nodes, detected.gpus_per_node)
    best_t, pick = math.inf, (shapes[0], backs[0])
    for shape in shapes:
        for b in backs:
            t = _ring(hw, attn, b, double=shape.nodes > 1).total_s
            if t < best_t:
                best_t, pick = t, (shape, b)
    return pick


def table1(cluster: Cluster, attn: Attn) -> dict:
    """BurstEngine Table 1's communication times with P = one K shard (B n H_kv D elem bytes) and
    N = world (the ring's steps): Ring 6 max(N Ti, N To); DoubleRing 4 max((N-No) Ti, No To) +
    2 ((N-No) Ti + No To); Burst 5 max((N-No) Ti, No To)."""
    G, No = cluster.world, cluster.nodes
    P = attn.batch * (attn.seq // G) * attn.hkv * attn.head_dim * attn.elem
    ti, to = cluster.intra.time(P), cluster.inter.time(P)
    return {
        "P_bytes": P,
        "T_intra_s": ti,
        "T_inter_s": to,
        "ring": 6 * max(G * ti, G * to),
        "double_ring": 4 * max((G - No) * ti, No * to) + 2 * ((G - No) * ti + No * to),
        "burst_double": 5 * max((G - No) * ti, No * to),
    }
