"""Functions run inside the gloo worker processes (they must be importable by module name)."""
import itertools

import torch
import torch.distributed as dist

import burstengine as be
from burstengine.schedule import backward_by_bytes, backward_bytes, forward_bytes
from burstengine.testing import dense_attention, rel_err


def _world(group):
    return dist.get_rank(group), dist.get_world_size(group)


def attention_matrix(group, seed, causal, layout, backward, n=12, dtype=torch.float32, kernel=None):
    """Every GQA ratio x head dim x batch for one (causal, layout, backward); returns worst errors
    and the byte counts seen vs predicted."""
    rank, world = _world(group)
    rows = []
    for i, (hkv, D, B) in enumerate(itertools.product((4, 2, 1), (32, 64), (1, 2))):
        H = 4
        g = torch.Generator().manual_seed(seed * 1000 + i)
        S = n * world
        q = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
        k = torch.randn(B, S, hkv, D, generator=g, dtype=torch.float64)
        v = torch.randn(B, S, hkv, D, generator=g, dtype=torch.float64)
        do = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
        dlse = torch.randn(B, H, S, generator=g, dtype=torch.float64)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        ref, ref_lse = dense_attention(qr, kr, vr, causal)
        # the loss also reaches lse, so the lse gradient path is checked too
        ((ref * do).sum() + (ref_lse * dlse).sum()).backward()

        def loc(t, dim=1):
            return be.shard(t, layout, rank, world, dim=dim).to(dtype)

        ql, kl, vl = (loc(t).detach().requires_grad_() for t in (q, k, v))
        with be.comm_stats() as st:
            out, lse = be.burst_attn_func(ql, kl, vl, group=group, causal=causal, layout=layout, backward=backward,
                                          return_lse=True, kernel=kernel)
            ((out * loc(do)).sum() + (lse * loc(dlse, dim=2)).sum()).backward()
        scheme = backward if backward != "auto" else backward_by_bytes(B, n, H, hkv, D, ql.element_size(), world)
        rows.append(dict(
            hkv=hkv, D=D, B=B,
            out=rel_err(out, loc(ref.detach(), 1)), lse=rel_err(lse, loc(ref_lse.detach(), 2)),
            dq=rel_err(ql.grad, loc(qr.grad)), dk=rel_err(kl.grad, loc(kr.grad)), dv=rel_err(vl.grad, loc(vr.grad)),
            fwd_bytes=st.forward_bytes, bwd_bytes=st.backward_bytes,
            want_fwd=forward_bytes(B, n, hkv, D, ql.element_size(), world),
            want_bwd=backward_bytes(scheme, B, n, H, hkv, D, ql.element_size(), world),
            scheme=scheme,
        ))
    return rows


def bad_call(group, case):
    """Make one bad call; return the ValueError message (or a description of what went wrong)."""
    rank, world = _world(group)
    q = torch.randn(1, 8, 4, 16)
    k = torch.randn(1, 8, 2, 16)
    v = torch.randn(1, 8, 2, 16)
    kw = dict(group=group)
    if case == "shape_mismatch":
        k = torch.randn(1, 6, 2, 16)
        v = torch.randn(1, 6, 2, 16)
    elif case == "kv_mismatch":
        v = torch.randn(1, 8, 1, 16)
    elif case == "dtype_mismatch":
        k = k.double()
    elif case == "heads_not_divisible":
        k = torch.randn(1, 8, 3, 16)
        v = torch.randn(1, 8, 3, 16)
    elif case == "zigzag_odd":
        q, k, v = (t[:, :7] for t in (q, k, v))
        kw["layout"] = "zigzag"
    elif case == "int_dtype":
        q, k, v = (torch.ones(t.shape, dtype=torch.int32) for t in (q, k, v))
    elif case == "not_4d":
        q = q[0]
    elif case == "head_dim":
        k = torch.randn(1, 8, 2, 8)
        v = torch.randn(1, 8, 2, 8)
    elif case == "bad_layout":
        kw["layout"] = "diagonal"
    elif case == "bad_backward":
        kw["backward"] = "sideways"
    elif case == "bad_scale":
        kw["softmax_scale"] = -1.0
    elif case == "device_meta":
        k = torch.randn(1, 8, 2, 16, device="meta")
    elif case == "gloo_with_meta":
        q, k, v = (torch.randn(t.shape, device="meta") for t in (q, k, v))
    elif case == "bad_group":
        kw["group"] = "not a group"
    elif case == "bad_kernel":
        kw["kernel"] = "magic"
    elif case == "cuda_kernel_on_cpu":
        kw["kernel"] = "cudnn"
    else:
        raise AssertionError(case)
    try:
        be.burst_attn_func(q, k, v, **kw)
    except ValueError as e:
        return str(e)
    return None


def layout_roundtrip(group, S):
    rank, world = _world(group)
    x = torch.randn(2, S, 3, generator=torch.Generator().manual_seed(S))
    out = {}
    for layout in be.LAYOUTS:
        mine = be.shard(x, layout, rank, world, dim=1)
        parts = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(parts, mine, group=group)
        out[layout] = bool(torch.equal(be.unshard(parts, layout, dim=1), x))
    return out


def bad_call_more(group, case):
    """bad_call plus a few more bad inputs; returns the ValueError message or None."""
    q = torch.randn(1, 8, 4, 16)
    k = torch.randn(1, 8, 2, 16)
    v = torch.randn(1, 8, 2, 16)
    kw = dict(group=group)
    if case == "causal_not_bool":
        kw["causal"] = "yes"
    elif case == "batch_mismatch":
        k = torch.randn(2, 8, 2, 16)
        v = torch.randn(2, 8, 2, 16)
    elif case == "empty":
        q, k, v = (t[:, :0] for t in (q, k, v))
    elif case == "not_tensor":
        q = q.tolist()
    elif case == "nan_scale":
        kw["softmax_scale"] = float("nan")
    else:
        return bad_call(group, case)
    try:
        be.burst_attn_func(q, k, v, **kw)
    except ValueError as e:
        return str(e)
    return None


def good_call(group, seed, causal=True, layout="zigzag", backward="burst", n=8):
    """One small correct call (GQA 4:2) against the float64 oracle, plus a collective that would
    hang or mismatch if any rank were out of step: returns errors, bytes and the collective's sum."""
    rank, world = _world(group)
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv, D, S = 1, 4, 2, 16, n * world
    q = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, _ = dense_attention(qr, kr, vr, causal)
    (ref * do).sum().backward()
    loc = lambda t: be.shard(t, layout, rank, world).float()
    ql, kl, vl = (loc(t).requires_grad_() for t in (q, k, v))
    with be.comm_stats() as st:
        out = be.burst_attn_func(ql, kl, vl, group=group, causal=causal, layout=layout, backward=backward)
        (out * loc(do)).sum().backward()
    tag = torch.tensor([float(rank)])
    dist.all_reduce(tag, group=group)
    return dict(
        err=max(rel_err(out, loc(ref.detach())), rel_err(ql.grad, loc(qr.grad)), rel_err(kl.grad, loc(kr.grad)),
                rel_err(vl.grad, loc(vr.grad))),
        fwd_bytes=st.forward_bytes, bwd_bytes=st.backward_bytes,
        want_fwd=forward_bytes(B, n, Hkv, D, 4, world), want_bwd=backward_bytes(backward, B, n, H, Hkv, D, 4, world),
        rank_sum=tag.item(),
    )


def home_hop(group, backward, causal, layout="zigzag"):
    """bf16 ring attention's gradients and backward bytes with the finished gradient sent home in
    the input dtype (now) and in float32 (Reducer.home's dtype ignored): they must be equal bit for
    bit, the bytes apart by half the home hop's float32 bytes."""
    from burstengine.comm import rings

    rank, world = _world(group)
    g = torch.Generator().manual_seed(7)
    B, H, hkv, D, n = 1, 4, 2, 32, 10
    S = n * world
    q, k, v, do = (torch.randn(B, S, h, D, generator=g) for h in (H, hkv, hkv, H))
    dlse = torch.randn(B, H, S, generator=g)
    real = rings.Reducer.home
    out = []
    for dtype_home in (True, False):
        rings.Reducer.home = real if dtype_home else (lambda self, dtype=None: real(self, None))
        try:
            ql, kl, vl = (be.shard(t, layout, rank, world).bfloat16().requires_grad_() for t in (q, k, v))
            with be.comm_stats() as st:
                o, lse = be.burst_attn_func(ql, kl, vl, group=group, causal=causal, layout=layout, backward=backward,
                                            return_lse=True)
                ((o * be.shard(do, layout, rank, world).bfloat16()).sum()
                 + (lse * be.shard(dlse, layout, rank, world, dim=2)).sum()).backward()
        finally:
            rings.Reducer.home = real
        out.append(((ql.grad, kl.grad, vl.grad), st.backward_bytes))
    return out
