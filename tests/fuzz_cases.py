"""Random calls of burst_attn_func and the layout helpers, run inside the gloo workers.

Every rank builds the same list of cases from a seed.  A case is a valid base call (random
shapes, GQA ratio, layout, mask, backward) plus one or two mutations, each made on every rank
or on one rank only.  A mutation is either bad (the call must raise a ValueError, on every
rank, naming the problem) or harmless (odd strides, another dtype, an explicit default: the
call must still match the float64 oracle).  The worker returns what happened; the test judges.
"""
from __future__ import annotations

import math
import os
import random
import sys
import time

import torch
import torch.distributed as dist

import burstengine as be
from burstengine.schedule import backward_by_bytes
from burstengine.testing import dense_attention, rel_err


class Call:
    """One rank's arguments to burst_attn_func, edited in place by mutations."""

    def __init__(self, q, k, v, kw):
        self.q, self.k, self.v, self.kw = q, k, v, kw


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape).to(dtype)


def _weird(t: torch.Tensor, how: int) -> torch.Tensor:
    """The same values as ``t`` with other strides."""
    if how == 0:  # heads-first storage seen through a transpose
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    if how == 1:  # every other element of a wider buffer along the head dim
        buf = torch.full((*t.shape[:-1], 2 * t.shape[-1]), float("nan"), dtype=t.dtype)
        buf[..., ::2] = t
        return buf[..., ::2]
    if how == 2:  # sequence-major storage, batch innermost
        return t.permute(1, 2, 3, 0).contiguous().permute(3, 0, 1, 2)
    # a slice out of a longer sequence
    buf = torch.full((t.shape[0], t.shape[1] + 3, *t.shape[2:]), float("nan"), dtype=t.dtype)
    buf[:, 2:2 + t.shape[1]] = t
    return buf[:, 2:2 + t.shape[1]]


def _set(attr, fn):
    def m(c, rng):
        setattr(c, attr, fn(getattr(c, attr), rng))
    return m


def _kw(key, value):
    def m(c, rng):
        c.kw[key] = value(rng) if callable(value) else value
    return m


def _poison(attr, value):
    def m(c, rng):
        t = getattr(c, attr)
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point or t.numel() == 0:
            return  # already bad in another way
        t = t.detach().clone()
        t.view(-1)[rng.randrange(t.numel())] = value
        setattr(c, attr, t)
    return m


def _shape(attr, dim, size):
    # another size along one dim: +size, or 3 for heads (divides neither 2 nor 4), 0 for size 0
    # (random values: the call is bad, its values do not matter)
    def m(c, rng):
        t = getattr(c, attr)
        shape = list(t.shape)
        shape[dim] = 0 if size == 0 else (3 if dim == 2 and size == 3 else shape[dim] + size)
        setattr(c, attr, _randn(*shape, dtype=t.dtype))
    return m


def _all(*fns):
    def m(c, rng):
        for f in fns:
            f(c, rng)
    return m


# Bad on any rank: (name, keyword the message must hold, mutation).  Each is applied either on
# every rank or on one rank only.
LOCAL_BAD = [
    ("q_3d", "4-D", _set("q", lambda t, r: t[0])),
    ("k_5d", "4-D", _set("k", lambda t, r: t[None])),
    ("q_int", "floating-point", _set("q", lambda t, r: t.round().to(torch.int32))),
    ("v_bool", "floating-point", _set("v", lambda t, r: t > 0)),
    ("k_complex", "floating-point", _set("k", lambda t, r: t.to(torch.complex64))),
    ("k_f64", "dtypes differ", _set("k", lambda t, r: t.double())),
    ("v_bf16", "dtypes differ", _set("v", lambda t, r: t.bfloat16())),
    ("k_meta", "different devices", _set("k", lambda t, r: t.to("meta"))),
    ("all_meta", "gloo", _all(*(_set(a, lambda t, r: t.to("meta")) for a in "qkv"))),
    ("heads_indivisible", "multiple of k/v heads", _all(_shape("k", 2, 3), _shape("v", 2, 3))),
    ("kv_heads_zero", "multiple of k/v heads", _all(_shape("k", 2, 0), _shape("v", 2, 0))),
    ("head_dim", "head dims differ", _all(_shape("k", 3, 8), _shape("v", 3, 8))),
    ("kv_differ", "k and v shapes differ", _shape("v", 1, 2)),
    ("batch", "batch sizes differ", _all(_shape("k", 0, 1), _shape("v", 0, 1))),
    ("q_len", "local tokens", _shape("q", 1, 2)),
    ("empty_seq", "empty input", _all(*(_shape(a, 1, 0) for a in "qkv"))),
    ("empty_batch", "empty input", _all(*(_shape(a, 0, 0) for a in "qkv"))),
    ("zero_heads", "empty input", _shape("q", 2, 0)),
    ("zigzag_odd", "even number", _all(*(_set(a, lambda t, r: t[:, :-1]) for a in "qkv"), _kw("layout", "zigzag"))),
    ("layout_name", "unknown layout", _kw("layout", lambda r: r.choice(["diagonal", "Zigzag", "", None, 3]))),
    ("backward_name", "unknown backward", _kw("backward", lambda r: r.choice(["sideways", None, "BURST", 1]))),
    ("causal_type", "causal must be a bool", _kw("causal", lambda r: r.choice([1, "yes", None, 0.0]))),
    ("scale_value", "softmax_scale", _kw("softmax_scale", lambda r: r.choice(
        [0.0, -0.125, float("nan"), float("inf"), -float("inf"), "0.1", True, [0.1]]))),
    ("kernel_name", "unknown kernel", _kw("kernel", lambda r: r.choice(["magic", "Reference"]))),
    ("kernel_gpu", "cannot run on device", _kw("kernel", lambda r: r.choice(["cudnn", "flash"]))),
    ("q_nan", "nan or inf", _poison("q", float("nan"))),
    ("k_inf", "nan or inf", _poison("k", float("inf"))),
    ("v_neg_inf", "nan or inf", _poison("v", -float("inf"))),
    ("q_list", "torch.tensor", _set("q", lambda t, r: t.tolist())),
    ("v_none", "torch.tensor", _set("v", lambda t, r: None)),
]

# Fine on each rank alone, bad when only one rank does it: (name, keyword, mutation)
DISAGREE = [
    ("flip_causal", "causal", None),
    ("other_layout", "layout", None),
    ("other_backward", "backward scheme", None),
    ("other_scale", "softmax_scale", _kw("softmax_scale", lambda r: r.choice([0.5, 1e-3, 2.0]))),
    ("other_dtype", "dtype", _all(*(_set(a, lambda t, r: t.double()) for a in "qkv"))),
    ("other_seq", "q shape", _all(*(_shape(a, 1, 2) for a in "qkv"))),
    ("wrong_world_shard", "q shape|even number", None),
    ("other_heads", "shape", None),
    ("other_head_dim", "q shape", _all(*(_shape(a, 3, 8) for a in "qkv"))),
    ("other_batch", "q shape", _all(*(_shape(a, 0, 1) for a in "qkv"))),
    ("other_kv_heads", "k/v shape", None),
]

# Harmless everywhere: the call must match the oracle.
GOOD = ["strides_q", "strides_k", "strides_v", "strides_all", "f64", "bf16", "f16", "scale_tiny", "scale_big",
        "explicit_default_scale_one", "resolved_backward_one", "explicit_kernel_one", "no_grad", "return_lse",
        "grad_q_only", "expanded_kv"]

TOL = {torch.float64: 1e-9, torch.float32: 2e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def make_cases(seed: int, world: int, count: int) -> list[dict]:
    """The same list on every rank: base shapes plus mutations (name, kind, target rank)."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        H = rng.choice([2, 4])
        base = dict(B=rng.choice([1, 2]), H=H, Hkv=rng.choice([h for h in (1, 2, 4) if H % h == 0]),
                    D=rng.choice([8, 16]), n=rng.choice([2, 4, 6]), layout=rng.choice(be.LAYOUTS),
                    causal=rng.random() < 0.6, backward=rng.choice(["auto", "burst", "ring"]),
                    dtype=torch.float32, seed=seed * 10007 + i)
        muts = []
        for _ in range(1 if rng.random() < 0.6 else 2):
            u = rng.random()
            target = rng.randrange(world)
            if u < 0.45:
                name = rng.choice(LOCAL_BAD)[0]
                muts.append((name, "local", "all" if rng.random() < 0.4 else target))
            elif u < 0.75:
                muts.append((rng.choice(DISAGREE)[0], "disagree", target))
            else:
                muts.append((rng.choice(GOOD), "good", "all"))
        cases.append(dict(base=base, muts=muts, mut_seed=rng.randrange(1 << 30)))
    return cases


def _build(base, world, rank, dtype, n_world=None):
    """This rank's shard of seeded global q, k, v (and the globals, for the oracle)."""
    g = torch.Generator().manual_seed(base["seed"])
    S = base["n"] * world
    shapes = [(base["B"], S, base["H"], base["D"])] + [(base["B"], S, base["Hkv"], base["D"])] * 2
    glob = [torch.randn(*s, generator=g, dtype=torch.float64).to(dtype) for s in shapes]
    if n_world:  # a shard cut for another world size: n / 2 tokens (odd ones break zigzag first)
        layout = base["layout"] if S % (2 * n_world) == 0 else "contiguous"
        return [be.shard(t, layout, rank, n_world) for t in glob], glob
    return [be.shard(t, base["layout"], rank, world) for t in glob], glob


def _apply(case, rank, world):
    """(Call, expected) for this rank: expected is None for a good call, else keywords."""
    base = dict(case["base"])
    rng = random.Random(case["mut_seed"] * 31 + rank)
    shared_rng = random.Random(case["mut_seed"])
    good = [m for m, kind, _ in case["muts"] if kind == "good"]
    dtype = {"f64": torch.float64, "bf16": torch.bfloat16, "f16": torch.float16}.get(
        next((m for m in good if m in ("f64", "bf16", "f16")), None), torch.float32)
    base["dtype"] = dtype
    (q, k, v), _ = _build(base, world, rank, dtype)
    kw = dict(causal=base["causal"], layout=base["layout"], backward=base["backward"])
    c = Call(q, k, v, kw)
    expected = []
    # mutations that rebuild the tensors first, so that the others still show
    order = {"disagree": 0, "good": 1, "local": 2}
    for name, kind, target in sorted(case["muts"], key=lambda m: order[m[1]]):
        mine = target == "all" or target == rank
        if kind == "good":
            _good(c, name, base, rank, world, shared_rng)
            continue
        if kind == "local":
            kwd, fn = next((kw_, f) for n_, kw_, f in LOCAL_BAD if n_ == name)
            expected.append(kwd)
            if mine:
                fn(c, rng)
            continue
        kwd, fn = next((kw_, f) for n_, kw_, f in DISAGREE if n_ == name)
        expected.append(kwd)
        if not mine:
            continue
        if fn is not None:
            fn(c, rng)
        elif name == "flip_causal":
            c.kw["causal"] = not base["causal"]
        elif name == "other_layout":
            c.kw["layout"] = next(l for l in be.LAYOUTS if l != base["layout"])
        elif name == "other_backward":
            B, n, H, D = base["B"], base["n"], base["H"], base["D"]
            resolved = base["backward"] if base["backward"] != "auto" else backward_by_bytes(
                B, n, H, base["Hkv"], D, 4, world)
            c.kw["backward"] = "ring" if resolved == "burst" else "burst"
        elif name == "wrong_world_shard":
            (c.q, c.k, c.v), _ = _build(base, world, rank, dtype, n_world=2 * world)
        elif name == "other_heads":
            c.q, c.k, c.v = (torch.cat([t, t], dim=2) for t in (c.q, c.k, c.v))
        elif name == "other_kv_heads":
            c.k, c.v = (t[:, :, :1] if t.shape[2] > 1 else torch.cat([t, t], 2) for t in (c.k, c.v))
            if c.q.shape[2] % c.k.shape[2]:
                c.q = torch.cat([c.q, c.q], dim=2)
    return c, (expected or None), base


def _good(c, name, base, rank, world, rng):
    if name.startswith("strides"):
        for a in ("qkv" if name == "strides_all" else name[-1]):
            setattr(c, a, _weird(getattr(c, a), rng.randrange(4)))
    elif name == "scale_tiny":
        c.kw["softmax_scale"] = 1e-6
    elif name == "scale_big":
        c.kw["softmax_scale"] = 3.0
    elif name == "explicit_default_scale_one" and rank == 0:
        c.kw["softmax_scale"] = 1.0 / math.sqrt(base["D"])
    elif name == "resolved_backward_one" and rank == 0 and c.kw["backward"] == "auto":
        c.kw["backward"] = backward_by_bytes(base["B"], base["n"], base["H"], base["Hkv"], base["D"],
                                           c.q.element_size(), world)
    elif name == "explicit_kernel_one" and rank == 0:
        c.kw["kernel"] = "reference"
    elif name == "no_grad":
        c.kw["_no_grad"] = True
    elif name == "return_lse":
        c.kw["return_lse"] = True
    elif name == "grad_q_only":
        c.kw["_grad"] = "q"
    elif name == "expanded_kv":
        # kv head 0 broadcast over every kv head (stride 0): degenerate along the sequence would
        # make dq exactly 0 (identical keys), where a normwise error means nothing
        c.k, c.v = (t[:, :, :1].expand(t.shape) for t in (c.k, c.v))
        c.kw["_expanded"] = True


def _run_good(c, base, group, rank, world):
    """Run a call that must succeed; return its worst normwise error against float64."""
    kw = dict(c.kw)
    no_grad = kw.pop("_no_grad", False)
    only = kw.pop("_grad", "qkv")
    expanded = kw.pop("_expanded", False)
    dtype = c.q.dtype
    g = torch.Generator().manual_seed(base["seed"] + 1)
    _, glob = _build(base, world, rank, dtype)
    if expanded:
        glob = [glob[0]] + [t[:, :, :1].expand(t.shape) for t in glob[1:]]
    gq, gk, gv = (t.double().requires_grad_() for t in glob)
    scale = kw.get("softmax_scale")
    ref, ref_lse = dense_attention(gq, gk, gv, kw["causal"], scale)
    do = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    (ref * do).sum().backward()

    def loc(t, dim=1):
        return be.shard(t.detach(), base["layout"], rank, world, dim=dim)

    if no_grad:
        with torch.no_grad():
            res = be.burst_attn_func(c.q, c.k, c.v, group=group, **kw)
    else:
        # detach() keeps the odd strides; expanded k/v stay leaves without grad
        q, k, v = (x.detach().requires_grad_(a in only and not (expanded and a != "q"))
                   for a, x in zip("qkv", (c.q, c.k, c.v)))
        res = be.burst_attn_func(q, k, v, group=group, **kw)
    out, lse = res if kw.get("return_lse") else (res, None)
    errs = [rel_err(out, loc(ref))]
    if lse is not None:
        errs.append(rel_err(lse, loc(ref_lse, 2)))
    if not no_grad:
        (out * loc(do).to(out.dtype)).sum().backward()
        for a, x, gx in zip("qkv", (q, k, v), (gq, gk, gv)):
            if x.requires_grad:
                errs.append(rel_err(x.grad, loc(gx.grad)))
    return max(errs)


def fuzz_batch(group, seed: int, count: int) -> list[dict]:
    """Run ``count`` random cases on this rank; one result dict per case."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    results = []
    for i, case in enumerate(make_cases(seed, world, count)):
        names = [m for m, _, _ in case["muts"]]
        row = dict(i=i, names=names, targets=[t for _, _, t in case["muts"]])
        try:
            c, expected, base = _apply(case, rank, world)
        except Exception as e:  # a bug in this file: still make a (bad) call, so no rank is left waiting
            row["harness"] = f"{type(e).__name__}: {e}"
            c, expected, base = Call(None, None, None, {}), ["harness"], case["base"]
        row["expected"] = expected
        t0 = time.perf_counter()
        if os.environ.get("FUZZ_DEBUG"):
            print(f"rank {rank} case {i} {names} {row['targets']}", file=sys.stderr, flush=True)
        try:
            if expected is None:
                row["err"] = _run_good(c, base, group, rank, world)
                row["tol"] = TOL[c.q.dtype] * (10 if "scale_big" in names else 1)
                row["outcome"] = "ok"
            else:
                kw = {k: v for k, v in c.kw.items() if not k.startswith("_")}
                be.burst_attn_func(c.q, c.k, c.v, group=group, **kw)
                row["outcome"] = "returned"
        except ValueError as e:
            row["outcome"], row["msg"] = "ValueError", str(e)
        except Exception as e:  # anything else is a defect the test reports
            row["outcome"], row["msg"] = type(e).__name__, str(e)
        row["secs"] = time.perf_counter() - t0
        results.append(row)
    # a collective at the end: a rank left inside a half-started ring would hang or mix it up
    tag = torch.tensor([float(rank)])
    dist.all_reduce(tag, group=group)
    results.append(dict(rank_sum=tag.item()))
    return results


# --- layout helpers -------------------------------------------------------------------------------

def _positions(S, layout, rank, world):
    """Independent model of the layouts: the global positions rank ``rank`` holds."""
    n = S // world
    if layout == "contiguous":
        return list(range(rank * n, rank * n + n))
    if layout == "striped":
        return [t for t in range(S) if t % world == rank]
    c = n // 2
    chunk = lambda j: list(range(j * c, j * c + c))  # noqa: E731
    return chunk(rank) + chunk(2 * world - 1 - rank)


def _unit(layout, world):
    return 2 * world if layout == "zigzag" else world


def _set_arg(key, choices, kwd):
    return lambda a, rng: (a.__setitem__(key, rng.choice(choices)), kwd)[1]


def _resize_x(size):
    def m(a, rng):
        shape = list(a["x"].shape)
        shape[a["dim"]] = size(shape[a["dim"]], a)
        a["x"] = torch.randn(*shape)
        return "sequence length" if size(1, a) == 0 else "not divisible"
    return m


def _edit_shard(how, kwd):
    def m(a, rng):
        shards = list(a["shards"])
        if len(shards) == 1:  # one shard cannot disagree with itself
            return None
        j = rng.randrange(len(shards))
        shards[j] = how(shards[j], a)
        a["shards"] = shards
        return kwd
    return m


_COMMON = [
    _set_arg("layout", ["Zigzag", "", None, 1], "unknown layout"),
    _set_arg("rank", [-1, 4, 9, 1.0, "0", True], "rank"),
    _set_arg("world", [0, -2, 2.0, None], "world size"),
]
LAYOUT_BAD = {
    "position_ids": _COMMON + [
        _set_arg("seq_len", [2.5, "8", None], "sequence length"),
        _set_arg("seq_len", [0, -4], "sequence length"),
        lambda a, rng: (a.__setitem__("seq_len", a["seq_len"] + 1), "not divisible")[1]
        if _unit(a["layout"], a["world"]) > 1 else None,
        _set_arg("device", ["nonsense", 3.5, "cuda:x"], "device"),
    ],
    "shard": _COMMON + [
        _set_arg("x", [None, [[1.0, 2.0]], torch.tensor(1.0)], "tensor"),
        _set_arg("dim", [3, -4, 1.5, "1"], "dim"),
        _resize_x(lambda s, a: 0),
        lambda a, rng: _resize_x(lambda s, a: s + 1)(a, rng) if _unit(a["layout"], a["world"]) > 1 else None,
    ],
    "unshard": [
        _set_arg("layout", ["Zigzag", "", None, 1], "unknown layout"),
        lambda a, rng: (a.__setitem__("shards", rng.choice([a["shards"][0], {"a": 1}, None])), "list or tuple")[1],
        lambda a, rng: (a.__setitem__("shards", []), "at least one")[1],
        lambda a, rng: (a.__setitem__("shards", list(a["shards"]) + [[1.0]]), "tensor")[1],
        _set_arg("dim", [3, -4, 1.5], "dim"),
        _edit_shard(lambda t, a: t.narrow(a["dim"], 0, t.shape[a["dim"]] - 1) if t.shape[a["dim"]] > 1
                    else torch.cat([t, t], a["dim"]), "differ in length"),
        _edit_shard(lambda t, a: t.double(), "float64"),
        _edit_shard(lambda t, a: torch.cat([t, t], (a["dim"] + 1) % 3), "has shape"),
        lambda a, rng: (a.__setitem__("shards", [t.narrow(a["dim"], 0, 0) for t in a["shards"]]), "empty")[1],
        lambda a, rng: (a.__setitem__("shards", [t.narrow(a["dim"], 0, 1) for t in a["shards"]]),
                        "even length")[1] if a["layout"] == "zigzag" else None,
    ],
}


def layout_batch(group, seed: int, count: int) -> list[dict]:
    """Random (mostly bad) calls of shard / unshard / position_ids; the valid ones are checked
    against ``_positions``.  No communication: each rank runs its own list."""
    rank = dist.get_rank(group)
    rng = random.Random(seed * 7 + rank)
    rows = []
    for i in range(count):
        world, layout = rng.choice([1, 2, 3, 4]), rng.choice(be.LAYOUTS)
        S, r, dim = 2 * world * rng.choice([1, 2, 3]), rng.randrange(world), rng.choice([0, 1, 2])
        shape = [3, 2, 5]
        shape[dim] = S
        x = torch.randn(*shape)
        pos = [torch.tensor(_positions(S, layout, rr, world)) for rr in range(world)]
        fn = rng.choice(sorted(LAYOUT_BAD))
        args = {"position_ids": dict(seq_len=S, layout=layout, rank=r, world=world, device=None),
                "shard": dict(x=x, layout=layout, rank=r, world=world, dim=dim),
                "unshard": dict(shards=[x.index_select(dim, p) for p in pos], layout=layout, dim=dim)}[fn]
        kwd = rng.choice(LAYOUT_BAD[fn])(args, rng) if rng.random() < 0.75 else None
        row = dict(i=i, fn=fn, expected=kwd)
        t0 = time.perf_counter()
        try:
            got = getattr(be, fn)(**args)
            want = {"position_ids": pos[r], "shard": x.index_select(dim, pos[r]), "unshard": x}[fn]
            row["outcome"] = "returned" if kwd else ("ok" if torch.equal(got, want) else "WRONG")
        except ValueError as e:
            row["outcome"], row["msg"] = "ValueError", str(e)
        except Exception as e:
            row["outcome"], row["msg"] = type(e).__name__, str(e)
        row["secs"] = time.perf_counter() - t0
        rows.append(row)
    return rows


def nan_levels(group):
    """NaN in one key at level full (raises), agree (propagates to exactly the rows that see
    it) and a bad call at level local (raises with no collective)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(3)
    B, n, H, Hkv, D, layout = 2, 4, 4, 2, 8, "zigzag"
    S = n * world
    q, k, v = (torch.randn(B, S, h, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv))
    p, hk = S // 2 + 1, 1
    ref, _ = dense_attention(q, k, v, causal=True)  # k still finite: the rows that cannot see p
    k[:, p, hk] = float("nan")
    ql, kl, vl = (be.shard(t, layout, rank, world).float() for t in (q, k, v))
    res = {}
    try:
        be.burst_attn_func(ql, kl, vl, group=group, causal=True, layout=layout)
        res["full"] = "returned"
    except ValueError as e:
        res["full"] = str(e)
    with be.arg_checks("agree"):
        out = be.burst_attn_func(ql, kl, vl, group=group, causal=True, layout=layout)
    pos = be.position_ids(S, layout, rank, world)
    sees = (pos >= p)[None, :, None].expand(B, n, H) & (torch.arange(H) // (H // Hkv) == hk)[None, None, :]
    nan_rows = torch.isnan(out).any(-1)
    res["agree_nan_rows"], res["want_nan_rows"] = int(nan_rows.sum()), int(sees.sum())
    res["same_rows"] = bool(torch.equal(nan_rows, sees))
    mine = be.shard(ref, layout, rank, world)
    res["agree_err"] = rel_err(out[~sees], mine[~sees])
    calls = []
    orig = {name: getattr(dist, name, None) for name in ("all_gather_single", "all_gather_into_tensor")}
    try:
        for name, fn in orig.items():
            if fn is not None:
                setattr(dist, name, lambda *a, _n=name, **kw: calls.append(_n))
        with be.arg_checks("local"):
            try:
                be.burst_attn_func(ql[0], kl, vl, group=group)
            except ValueError as e:
                res["local_bad"] = str(e).split(" (")[0]
    finally:
        for name, fn in orig.items():
            if fn is not None:
                setattr(dist, name, fn)
    res["local_collectives"] = len(calls)
    return res


def extra_hook(group, case):
    """check_call(planner=...): the hook other arguments (masks, topology) use to join the checks."""
    from burstengine.attention.call import AttnCall, MaskArgs
    from burstengine.attention.prepare import check_call

    rank = dist.get_rank(group)
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)
    bm = torch.ones(4, 4, dtype=torch.bool)

    def extra(world):
        if case == "raise_one" and rank == 1:
            raise ValueError(f"window must be a positive int, got -1 (world {world})")
        mask = bm.clone()
        if case == "tensor_differ" and rank == 1:
            mask[0, 3] = False
        return {"window": 8 if case == "differ" and rank == 0 else 4, "block_mask": mask, "cu_seqlens": (0, 4, 8)}

    try:
        call = AttnCall(group=group, layout="zigzag", mask=MaskArgs(causal=True))
        got = check_call(q, k, v, call, lambda world: (None, extra(world))).shared
        return ("ok", sorted(got))
    except ValueError as e:
        return ("ValueError", str(e))


# --- settings from the environment, per rank ------------------------------------------------------

# (name, keyword the message must hold, env(rank, world, rng) -> {var: value or None}); each
# differs between ranks, so the call is bad: every rank must raise the same ValueError
ENV_BAD = [
    ("local_world_size_split", "topology",
     lambda r, w, rng: {"LOCAL_WORLD_SIZE": str(w // 2 if r < w // 2 else w)} if w % 2 == 0 and w >= 4 else None),
    ("topology_one_rank", "topology", lambda r, w, rng: {"BURST_TOPOLOGY": f"2x{w // 2}" if r == 1 else None}
     if w % 2 == 0 and w >= 4 else None),
    ("checks_full_agree", "BURST_CHECKS", lambda r, w, rng: {"BURST_CHECKS": "agree" if r == 0 else "full"}),
    ("checks_once_full", "BURST_CHECKS", lambda r, w, rng: {"BURST_CHECKS": "once" if r == w - 1 else "full"}),
    ("timeout_differs", "BURST_TIMEOUT", lambda r, w, rng: {"BURST_TIMEOUT": "30" if r == 0 else "40"}),
    ("timeout_one_rank", "BURST_TIMEOUT", lambda r, w, rng: {"BURST_TIMEOUT": "30" if r == w - 1 else None}),
    ("cluster_one_rank", "BURST_CLUSTER", lambda r, w, rng: {"BURST_CLUSTER": "a800-paper" if r == 0 else None}),
    ("cluster_two", "BURST_CLUSTER", lambda r, w, rng: {"BURST_CLUSTER": "a800-paper" if r % 2 else "h200-nvlink"}),
    ("bad_timeout_one", "BURST_TIMEOUT", lambda r, w, rng: {"BURST_TIMEOUT": "soon" if r == 0 else None}),
    ("bad_checks_one", "BURST_CHECKS", lambda r, w, rng: {"BURST_CHECKS": "paranoid" if r == w - 1 else None}),
    ("requires_grad_one", "gradients", lambda r, w, rng: {"_grad": r != 0}),
]
# the same on every rank: the call must match the oracle
ENV_GOOD = [
    ("checks_once", lambda r, w: {"BURST_CHECKS": "once"}),
    ("checks_agree", lambda r, w: {"BURST_CHECKS": "agree"}),
    ("topology_all", lambda r, w: {"BURST_TOPOLOGY": f"2x{w // 2}"} if w % 2 == 0 and w >= 4 else {}),
    ("local_world_size_all", lambda r, w: {"LOCAL_WORLD_SIZE": "2"} if w % 2 == 0 else {}),
    ("timeout_all", lambda r, w: {"BURST_TIMEOUT": "60"}),
    ("cluster_all", lambda r, w: {"BURST_CLUSTER": "a800-paper"}),
]


def _with_env(env: dict):
    saved = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    return saved


def env_batch(group, seed: int, count: int) -> list[dict]:
    """``count`` calls whose settings from the environment (or requires_grad) differ per rank
    (bad: the same ValueError everywhere, naming the setting) or agree (good: the oracle)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        base = dict(B=1, H=rng.choice([2, 4]), Hkv=2, D=8, n=rng.choice([4, 8]), layout=rng.choice(be.LAYOUTS),
                    causal=rng.random() < 0.7, backward=rng.choice(["auto", "burst", "ring"]), dtype=torch.float64,
                    seed=seed * 7919 + i)
        base["Hkv"] = rng.choice([h for h in (1, 2) if base["H"] % h == 0])
        crng = random.Random(seed * 31 + i)
        if rng.random() < 0.8:
            name, kwd, fn = rng.choice(ENV_BAD)
            env = fn(rank, world, crng)
            if env is None:  # not possible at this world size: a good case instead
                name, kwd, env = "noop", None, {}
        else:
            name, fn = rng.choice(ENV_GOOD)
            kwd, env = None, fn(rank, world)
        grad = env.pop("_grad", True)
        row = dict(i=i, names=[name], targets=["all"], expected=[kwd] if kwd else None)
        saved = _with_env(env)
        t0 = time.perf_counter()
        try:
            if kwd is None:
                kw = dict(causal=base["causal"], layout=base["layout"], backward=base["backward"])
                c = Call(*_build(base, world, rank, torch.float64)[0], kw)
                row["err"] = _run_good(c, base, group, rank, world)
                row["tol"] = TOL[torch.float64]
                row["outcome"] = "ok"
            else:
                (q, k, v), _ = _build(base, world, rank, torch.float64)
                q, k, v = (t.requires_grad_(grad) for t in (q, k, v))
                out = be.burst_attn_func(q, k, v, group=group, causal=base["causal"], layout=base["layout"],
                                         backward=base["backward"])
                row["outcome"] = "returned"
                if out.requires_grad:
                    out.sum().backward()
        except ValueError as e:
            row["outcome"], row["msg"] = "ValueError", str(e)
        except Exception as e:
            row["outcome"], row["msg"] = type(e).__name__, str(e)
        finally:
            _with_env(saved)
        row["secs"] = time.perf_counter() - t0
        rows.append(row)
    tag = torch.tensor([float(rank)])
    dist.all_reduce(tag, group=group)
    rows.append(dict(rank_sum=tag.item()))
    return rows


def run_all(env_cases: int = 60) -> dict:
    """The fuzz of tests/attention/test_fuzz.py in one go, for `burstengine bench faults`'s record: calls
    tried, bad calls, failures, hangs (a batch that never came back) and silent wrong answers
    (a call that returned where it must raise, or a valid one off the oracle), per world."""
    import test_fuzz  # the judge of the test suite itself

    from burstengine.testing import DistPool

    pool = DistPool(world=4, timeout=600)
    out = dict(worlds={}, calls=0, bad=0, good=0, failures=0, hangs=0, silent_wrong=0)
    try:
        for world in (2, 3, 4):
            for kind, per_rank in (("args", lambda: pool.run(fuzz_batch, 100 + world, test_fuzz.CASES, world=world)),
                                   ("env", lambda: pool.run(env_batch, 200 + world, env_cases, world=world))):
                t0 = time.perf_counter()
                try:
                    res = per_rank()
                except TimeoutError:
                    out["hangs"] += 1
                    continue
                bad, good, failures = test_fuzz._judge(world, res)
                wrong = [f for f in failures if "WRONG RESULT" in f or "got ['returned'" in f]
                slowest = max(r["secs"] for rows in res for r in rows[:-1])
                out["worlds"][f"{kind}_{world}"] = dict(
                    bad=bad, good=good, failures=len(failures), silent_wrong=len(wrong),
                    seconds=round(time.perf_counter() - t0, 1), slowest_call_s=round(slowest, 3))
                out["calls"] += (bad + good) * world
                out["bad"] += bad
                out["good"] += good
                out["failures"] += len(failures)
                out["silent_wrong"] += len(wrong)
    finally:
        pool.close()
    return out
