"""Functions run inside the gloo worker processes for tests/attention/test_compile.py: burst_attn_func and a
decoder block compiled with torch.compile(fullgraph=True) (inductor) against the eager call."""
import torch
import torch.distributed as dist

import burstengine as be
from burstengine.comm.dist import LOCAL
from burstengine.model import ContextParallel, ModelArgs, rope_tables
from burstengine.model.layers import Block
from burstengine.testing import rel_err

# a few variants, each compiled once: every mask kind, GQA and MHA, both backward schemes, a local
# length that divides nothing (5) where the layout allows it, gradients into lse
ATTENTION_CASES = (
    dict(causal=True, layout="contiguous", backward="burst", hkv=2, n=5, lse=True),
    dict(causal=False, layout="striped", backward="ring", hkv=4, n=5, lse=False),
    dict(causal=True, layout="zigzag", backward="ring", hkv=1, n=6, lse=True, window=4),
    dict(causal=True, layout="contiguous", backward="auto", hkv=2, n=5, lse=True, cu=(0, 3)),
)


def _world(group):
    return dist.get_rank(group), dist.get_world_size(group)


def _explain(fn, *args) -> tuple[int, int]:
    """(graph breaks, burstengine::burst_attn calls in the captured graphs) of ``fn(*args)``."""
    torch._dynamo.reset()
    ex = torch._dynamo.explain(fn)(*args)
    torch._dynamo.reset()
    # a checkpointed stage is a higher-order op whose body is a sub-module of the graph
    return ex.graph_break_count, sum(m.code.count("torch.ops.burstengine.burst_attn.default") for g in ex.graphs
                                     for m in g.modules() if isinstance(m, torch.fx.GraphModule))


def attention(group, seed, cases=None):
    """For each case (indices into ATTENTION_CASES; None: all): graph breaks, custom ops in the
    graph, and the compiled call's out, lse and q/k/v gradients' error relative to the eager call's."""
    rank, world = _world(group)
    rows = []
    for i, case in enumerate(ATTENTION_CASES):
        if cases is not None and i not in cases:
            continue
        n, H, D = case["n"], 4, 8
        S = n * world
        kw = dict(group=group, causal=case["causal"], layout=case["layout"], backward=case["backward"],
                  return_lse=True)
        if "window" in case:
            kw["window"] = case["window"]
        if "cu" in case:
            kw["cu_seqlens"] = list(case["cu"]) + [S]  # a list: the op takes it as a tensor
        g = torch.Generator().manual_seed(seed * 100 + i)
        full = [torch.randn(1, S, h, D, generator=g) for h in (H, case["hkv"], case["hkv"])]
        q, k, v = (be.shard(t, case["layout"], rank, world, dim=1) for t in full)
        do = torch.randn(1, n, H, D, generator=g)
        dlse = torch.randn(1, H, n, generator=g) if case["lse"] else None

        def f(q, k, v):
            # work on both sides of the call, so that the op sits inside one graph with others
            out, lse = be.burst_attn_func(q * 1.5, k, v.sin(), **kw)
            return out.tanh(), lse

        def run(fn):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            out, lse = fn(*leaves)
            loss = (out * do).sum() + ((lse * dlse).sum() if dlse is not None else 0)
            loss.backward()
            return [out.detach(), lse.detach()] + [t.grad for t in leaves]

        breaks, ops = _explain(f, q, k, v)
        want = run(f)
        got = run(torch.compile(f, fullgraph=True, backend="inductor"))
        torch._dynamo.reset()
        rows.append(dict(case=i, breaks=breaks, ops=ops, **{name: rel_err(a, b) for name, a, b in
                                                   zip(("out", "lse", "dq", "dk", "dv"), got, want)}))
    return rows


# Gemma 3's block: its RMSNorm, sandwich and q/k norms, GeGLU, attention scale, a sliding window
GEMMA = dict(qk_norm=True, norm_plus_one=True, sandwich_norm=True, activation="gelu_tanh",
             query_pre_attn_scalar=12.0, window=5)


def block(group, seed, policy, options=None):
    """A decoder Block (BurstAttention over the group; LOCAL on one rank) under checkpointing
    ``policy`` (with ModelArgs ``options``), compiled with fullgraph=True: graph breaks, custom ops
    in the graph, and the errors of output, input gradient and weight gradients relative to eager."""
    rank, world = _world(group)
    cp_group = LOCAL if world == 1 else (group if group is not None else dist.group.WORLD)
    a = ModelArgs(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=16, ffn_dim=48, **(options or {}))
    torch.manual_seed(seed)  # the same weights on every rank
    blk = Block(a, policy=policy)
    if a.norm_plus_one:  # weights near 0: a scale near 1
        with torch.no_grad():
            for name, p in blk.named_parameters():
                if "norm" in name:
                    p.uniform_(-0.5, 0.5)
    blk.cp = ContextParallel(group=cp_group, layout="zigzag", backward="burst")
    n = 6
    S = n * world
    g = torch.Generator().manual_seed(seed + 1)
    x = be.shard(torch.randn(1, S, a.dim, generator=g), "zigzag", rank, world, dim=1)
    dy = torch.randn(1, n, a.dim, generator=g)
    pos = be.shard(torch.arange(S), "zigzag", rank, world, dim=0)
    cos, sin = (t.float() for t in rope_tables(pos, a.head_dim, a.rope_theta))

    def run(fn):
        blk.zero_grad(set_to_none=True)
        xl = x.clone().requires_grad_()
        y = fn(xl, cos, sin)
        (y * dy).sum().backward()
        return [y.detach(), xl.grad] + [p.grad.clone() for p in blk.parameters()]

    breaks, ops = _explain(blk, x, cos, sin)
    want = run(blk)
    got = run(torch.compile(blk, fullgraph=True, backend="inductor"))
    torch._dynamo.reset()
    return dict(breaks=breaks, ops=ops, errs=[rel_err(a_, b_) for a_, b_ in zip(got, want)])


def bad_calls(group):
    """Bad calls under torch.compile: the error each one raises (type and message) on this rank.
    The ranks disagree on ``causal`` (caught by the agreement inside the op), one passes a negative
    window (its local check, reported on every rank), and a DeviceMesh topology cannot be compiled."""
    from torch.distributed.device_mesh import DeviceMesh

    rank, world = _world(group)
    q, k, v = torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    calls = {
        "disagree": dict(causal=rank == 0),
        "window": dict(causal=True, window=-1 if rank == world - 1 else 2),
        # from the existing group: a mesh that made sub-groups (new_group on some ranks of the pool
        # only) would leave the pool's ranks out of step for every later group creation
        "mesh": dict(topology=DeviceMesh.from_group(group if group is not None else dist.group.WORLD, "cpu")),
    }
    seen = {}
    for name, kw in calls.items():
        torch._dynamo.reset()
        fn = torch.compile(lambda q, k, v: be.burst_attn_func(q, k, v, group=group, **kw) * 2, fullgraph=True,
                           backend="inductor")
        try:
            fn(q, k, v)
            seen[name] = None
        except Exception as e:  # what a user would see, whatever wraps it
            seen[name] = (type(e).__name__, str(e))
    torch._dynamo.reset()
    return seen
