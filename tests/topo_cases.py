"""Functions run inside the gloo workers for tests/comm/test_double_ring.py and tests/attention/test_hybrid.py."""
import itertools
import os

import torch
import torch.distributed as dist

import burstengine as be
from burstengine.schedule import backward_bytes, forward_bytes, home_bytes, hop_bytes
from burstengine.schedule import Topology, link_hops
from burstengine.testing import dense_attention, rel_err


def _case(seed, world, B, H, Hkv, D, n, causal):
    g = torch.Generator().manual_seed(seed)
    S = n * world
    q = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(B, H, S, generator=g, dtype=torch.float64)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = dense_attention(qr, kr, vr, causal)
    ((ref * do).sum() + (ref_lse * dlse).sum()).backward()
    return (q, k, v, do, dlse), (ref.detach(), ref_lse.detach(), qr.grad, kr.grad, vr.grad)


def _run(fn, inputs, loc):
    """fn(q, k, v) -> (out, lse) on this rank's shards; -> (out, lse, dq, dk, dv, stats)."""
    q, k, v, do, dlse = inputs
    ql, kl, vl = (loc(t).detach().requires_grad_() for t in (q, k, v))
    with be.comm_stats() as st:
        out, lse = fn(ql, kl, vl)
        ((out * loc(do)).sum() + (lse * loc(dlse, 2)).sum()).backward()
    return out.detach(), lse.detach(), ql.grad, kl.grad, vl.grad, st


def double_ring_matrix(group, shape, seed, n=8, dtype=torch.float32):
    """Every layout x causal x backward x GQA on the double ring of ``shape``: errors against
    float64, the largest difference from the single ring, and bytes per link seen vs predicted."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    topo = Topology.parse(shape)
    hops = link_hops(topo.nodes, topo.gpus_per_node)
    rows = []
    for i, (layout, causal, backward, hkv) in enumerate(itertools.product(be.LAYOUTS, (False, True),
                                                                          ("burst", "ring"), (4, 2))):
        B, H, D = 1 + i % 2, 4, 16
        inputs, refs = _case(seed * 1000 + i, world, B, H, hkv, D, n, causal)

        def loc(t, dim=1):
            return be.shard(t, layout, rank, world, dim=dim).to(dtype)

        kw = dict(group=group, causal=causal, layout=layout, backward=backward, return_lse=True)
        dbl = _run(lambda q, k, v: be.burst_attn_func(q, k, v, topology=shape, **kw), inputs, loc)
        one = _run(lambda q, k, v: be.burst_attn_func(q, k, v, topology=None, **kw), inputs, loc)
        want = [loc(refs[0]), loc(refs[1], 2)] + [loc(t) for t in refs[2:]]
        st = dbl[5]
        e = torch.tensor([], dtype=dtype).element_size()
        fdata, _ = hop_bytes("forward", B, n, H, hkv, D, e)
        bdata, bgrad = hop_bytes(backward, B, n, H, hkv, D, e)
        bhome = home_bytes(backward, B, n, H, hkv, D, e)
        want_link = {}
        for link in ("intra", "inter"):
            want_link[f"forward.{link}"] = hops["data"][link] * fdata
            want_link[f"backward.{link}"] = (hops["data"][link] * bdata + hops["grad"][link] * bgrad
                                             + hops["home"][link] * bhome)
        rows.append(dict(
            layout=layout, causal=causal, backward=backward, hkv=hkv,
            err=max(rel_err(a, b) for a, b in zip(dbl[:5], want)),
            vs_single=max(rel_err(a, b) for a, b in zip(dbl[:5], one[:5])),
            fwd=(st.forward_bytes, forward_bytes(B, n, hkv, D, e, world)),
            bwd=(st.backward_bytes, backward_bytes(backward, B, n, H, hkv, D, e, world)),
            links=({k: st.by_link.get(k, 0) for k in want_link}, want_link),
            split=(st.intra_bytes + st.inter_bytes, st.total_bytes),
        ))
    return rows


def one_node_is_the_single_ring(group, seed):
    """topology "1xG", None and "auto" (one node) run the same ring: bitwise equal results and
    identical byte counts."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    inputs, _ = _case(seed, world, 2, 4, 2, 16, 6, True)
    loc = lambda t, dim=1: be.shard(t, "zigzag", rank, world, dim=dim).float()
    res = []
    for topology in (None, "auto", f"1x{world}", Topology(1, world), "single"):
        res.append(_run(lambda q, k, v: be.burst_attn_func(q, k, v, group=group, causal=True, layout="zigzag",
                                                           return_lse=True, topology=topology), inputs, loc))
    same = all(torch.equal(a, b) for r in res[1:] for a, b in zip(r[:5], res[0][:5]))
    stats = [(r[5].forward_bytes, r[5].backward_bytes, r[5].inter_bytes) for r in res]
    return same, stats


def env_topology(group, spec, seed):
    """BURST_TOPOLOGY picks the double ring for topology="auto"; -> (error, inter bytes, intra bytes)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    inputs, refs = _case(seed, world, 1, 4, 4, 16, 8, True)
    loc = lambda t, dim=1: be.shard(t, "zigzag", rank, world, dim=dim).float()
    os.environ["BURST_TOPOLOGY"] = spec
    try:
        r = _run(lambda q, k, v: be.burst_attn_func(q, k, v, group=group, causal=True, layout="zigzag",
                                                    return_lse=True), inputs, loc)
        # a single ring on the same nodes: its bytes are labelled by the hop each rank makes
        s = _run(lambda q, k, v: be.burst_attn_func(q, k, v, group=group, causal=True, layout="zigzag",
                                                    return_lse=True, topology=None), inputs, loc)
    finally:
        del os.environ["BURST_TOPOLOGY"]
    want = [loc(refs[0]), loc(refs[1], 2)] + [loc(t) for t in refs[2:]]
    return dict(err=max(rel_err(a, b) for a, b in zip(r[:5], want)), inter=r[5].inter_bytes,
                intra=r[5].intra_bytes, single_inter=s[5].inter_bytes, single_intra=s[5].intra_bytes,
                single_links={k: s[5].by_link.get(k, 0) for k in
                              ("forward.intra", "forward.inter", "backward.intra", "backward.inter")})


def mesh_topology(group, seed):
    """A 2-D DeviceMesh (inter, intra) as the topology."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("inter", "intra"))
    inputs, refs = _case(seed, world, 1, 4, 2, 16, 8, False)
    loc = lambda t, dim=1: be.shard(t, "striped", rank, world, dim=dim).float()
    r = _run(lambda q, k, v: be.burst_attn_func(q, k, v, group=group, layout="striped", return_lse=True,
                                                topology=mesh), inputs, loc)
    want = [loc(refs[0]), loc(refs[1], 2)] + [loc(t) for t in refs[2:]]
    return max(rel_err(a, b) for a, b in zip(r[:5], want)), r[5].inter_bytes


def bad_topology(group, topology):
    q = torch.randn(1, 8, 4, 16)
    try:
        be.burst_attn_func(q, q, q, group=group, topology=topology)
    except ValueError as e:
        return str(e)
    return None


def hybrid_matrix(group, ulysses, H, hkvs, seed, n=8):
    """hybrid_attn_func for every layout x causal x backward x kv heads against float64."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rows = []
    for i, (layout, causal, backward, hkv) in enumerate(itertools.product(be.LAYOUTS, (False, True),
                                                                          ("burst", "ring"), hkvs)):
        B, D = 1 + i % 2, 16
        inputs, refs = _case(seed * 1000 + i, world, B, H, hkv, D, n, causal)
        loc = lambda t, dim=1: be.shard(t, layout, rank, world, dim=dim).float()
        r = _run(lambda q, k, v: be.hybrid_attn_func(q, k, v, ulysses=ulysses, group=group, causal=causal,
                                                     layout=layout, backward=backward, return_lse=True), inputs, loc)
        want = [loc(refs[0]), loc(refs[1], 2)] + [loc(t) for t in refs[2:]]
        rows.append(dict(layout=layout, causal=causal, backward=backward, hkv=hkv,
                         errs=[rel_err(a, b) for a, b in zip(r[:5], want)], a2a=r[5].by_tensor.get("forward.a2a", 0)))
    return rows


def hybrid_no_lse(group, ulysses):
    """Without return_lse the output and gradients are the same as with it (lse unused)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    inputs, refs = _case(5, world, 1, 4, 2, 16, 8, True)
    q, k, v, do, _ = inputs
    loc = lambda t: be.shard(t, "zigzag", rank, world).float()
    ql, kl, vl = (loc(t).requires_grad_() for t in (q, k, v))
    out = be.hybrid_attn_func(ql, kl, vl, ulysses=ulysses, group=group, causal=True, layout="zigzag")
    out.backward(loc(do))
    # refs include the lse term in their gradients; compare the output only, and that grads exist
    return rel_err(out.detach(), loc(refs[0])), all(t.grad is not None for t in (ql, kl, vl))


def bad_hybrid(group, ulysses, H, Hkv):
    q = torch.randn(1, 8, H, 16)
    k = torch.randn(1, 8, Hkv, 16)
    try:
        be.hybrid_attn_func(q, k, k, ulysses=ulysses, group=group)
    except ValueError as e:
        return str(e)
    return None


def bench_tiny(group, out_dir):
    """burstengine bench topo's run at a tiny size; rank 0 writes the record and returns it."""
    from burstengine.bench.peers import topo as tb
    from burstengine.bench.records import write_record

    args = tb.build_parser().parse_args(["--device", "cpu", "--seqs", "64,128", "--heads", "4", "--head-dim", "8",
                                         "--warmup", "0", "--iters", "1", "--link-sizes", "1024,8192,65536"])
    rec = tb.run(group, args, log=lambda *a: None)
    if rec is None:
        return None
    import io

    buf = io.StringIO()
    tb.print_table(rec, file=buf)
    return dict(rec=rec, table=buf.getvalue(), path=write_record("topo_bench_tiny", rec, out_dir))


def bench_tiny_slow(group, out_dir):
    """bench topo's --inter-ctas run on gloo, its NCCL options replaced by the default (None):
    the copy of the group and its sub-groups are made up front, and the attention calls find them."""
    from burstengine.bench.peers import topo as tb
    from burstengine.bench.records import write_record
    from burstengine.comm import topology as topo

    slowed = []  # one entry per group made with the slow options
    args = tb.build_parser().parse_args(["--device", "cpu", "--seqs", "64", "--heads", "4", "--head-dim", "8",
                                         "--warmup", "0", "--iters", "1", "--link-sizes", "1024,8192",
                                         "--topology", "2x2"])
    args.inter_ctas = 3  # validate() refuses it on gloo; run() is what is tested here
    made = topo._MADE[0]
    real, tb.nccl_channels = tb.nccl_channels, lambda ctas: slowed.append(ctas)  # gloo: default options
    try:
        rec = tb.run(group, args, log=lambda *a: None)
    finally:
        tb.nccl_channels = real
    sets = topo._MADE[0] - made
    if rec is None:
        return dict(slowed=slowed, sets=sets)
    return dict(slowed=slowed, sets=sets, rec=rec, path=write_record("topo_bench_tiny_slow", rec, out_dir))
