"""Sparse-mask cases run inside the gloo workers (importable by module name).

Every case builds the same global float64 q, k, v, dO, dlse on all ranks from its seed, takes
the float64 dense oracle with the explicit mask of testing.sparse_mask, runs burst_attn_func
on this rank's float32 shard, and reports the errors, the empty-row checks and the bytes sent
against the byte model at the schedule's last step.
"""
import contextlib

import torch
import torch.distributed as dist

import burstengine as be
from burstengine.masks import Pattern
from burstengine.schedule import backward_by_bytes, backward_bytes, forward_bytes, run_steps
from burstengine.testing import dense_attention, rel_err, sparse_mask


@contextlib.contextmanager
def _piecewise_kernel():
    """kernel="pieces" for the duration: stands in for the SDPA kernels on CPU, sparse blocks
    cut into FULL / CAUSAL pieces (kernels/pieces.py) run by the reference kernel.  Removed
    afterwards so that other tests see the usual kernel list."""
    from burstengine import kernels
    from burstengine.kernels.pieces import PiecewiseMasks
    from burstengine.kernels.reference import ReferenceKernel

    class Pieces(PiecewiseMasks, ReferenceKernel):
        name = "pieces"
        max_rows = 3  # many small tiles, so the tiling itself is exercised

    kernels.KERNELS["pieces"] = Pieces()
    try:
        yield
    finally:
        del kernels.KERNELS["pieces"]


def random_block_mask(nb, seed, density=0.5, empty_rows=1):
    """A random (nb, nb) bool block mask with ``empty_rows`` block rows switched off entirely."""
    g = torch.Generator().manual_seed(seed)
    bm = torch.rand(nb, nb, generator=g) < density
    if empty_rows:
        bm[torch.randperm(nb, generator=g)[:empty_rows]] = False
    return bm


def run_case(group, case):
    """One call of burst_attn_func with case = dict(layout, n, backward, hkv, seed, causal,
    window, cu_seqlens, block=(nb, density, empty_rows) or None, B, D, kernel, topology)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    layout, n, backward = case["layout"], case["n"], case["backward"]
    B, H, Hkv, D = case.get("B", 1), 4, case.get("hkv", 2), case.get("D", 16)
    S = n * world
    causal, window, cu = case.get("causal", True), case.get("window"), case.get("cu_seqlens")
    bm = None
    if case.get("block"):
        nb, density, empty = case["block"]
        bm = random_block_mask(nb, case["seed"], density, empty)
    g = torch.Generator().manual_seed(case["seed"])
    q = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, S, Hkv, D, generator=g, dtype=torch.float64)
    do = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    mask = sparse_mask(S, causal, window, cu, bm)
    seen = mask.any(-1)  # rows that see at least one key
    # the loss reaches lse too, except on empty rows (their lse is -inf)
    dlse = torch.randn(B, H, S, generator=g, dtype=torch.float64) * seen
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref, ref_lse = dense_attention(qr, kr, vr, mask=mask)
    ((ref * do).sum() + (torch.where(seen, ref_lse, 0.0) * dlse).sum()).backward()

    def loc(t, dim=1):
        return be.shard(t, layout, rank, world, dim=dim)

    ql, kl, vl = (loc(t).float().requires_grad_() for t in (q, k, v))
    with be.comm_stats() as st:
        out, lse = be.burst_attn_func(ql, kl, vl, group=group, causal=causal, layout=layout, backward=backward,
                                      return_lse=True, window=window, cu_seqlens=cu, block_mask=bm,
                                      kernel=case.get("kernel"), topology=case.get("topology", "auto"))
        ((out * loc(do).float()).sum() + (torch.where(torch.isinf(lse), 0.0, lse) * loc(dlse, 2).float()).sum()).backward()
    bs = 0 if bm is None else S // bm.shape[0]
    pattern = Pattern(causal=causal, window=window, cu_seqlens=None if cu is None else tuple(cu), block_mask=bm,
                      block_size=bs)
    steps = run_steps(layout, pattern, world, n)
    hops = len(steps) - 1
    elem = ql.element_size()
    scheme = backward if backward != "auto" else backward_by_bytes(B, n, H, Hkv, D, elem, world, hops, layout=layout,
                                                                 mask=pattern)
    # the double ring (a pattern that runs every step, on a topology of several nodes) moves
    # whole shards; the single ring only the rows later steps read
    double = case.get("topology") is not None and len(steps) == world
    trim = {} if double else dict(layout=layout, mask=pattern, rank=rank)
    empty = ~loc(seen, 0)
    lse_seen = loc(ref_lse.detach(), 2)[:, :, ~empty]
    grads = (ql.grad, kl.grad, vl.grad)
    return dict(
        out=rel_err(out, loc(ref.detach())),
        lse=rel_err(lse[:, :, ~empty], lse_seen) if lse_seen.numel() else 0.0,
        dq=rel_err(ql.grad, loc(qr.grad)), dk=rel_err(kl.grad, loc(kr.grad)), dv=rel_err(vl.grad, loc(vr.grad)),
        finite=all(bool(torch.isfinite(t).all()) for t in (out,) + grads),
        empty_rows=int(empty.sum()),
        empty_ok=bool((out[:, empty] == 0).all() and torch.isneginf(lse[:, :, empty]).all()
                      and (ql.grad[:, empty] == 0).all()),
        fwd_bytes=st.forward_bytes, bwd_bytes=st.backward_bytes,
        want_fwd=forward_bytes(B, n, Hkv, D, elem, world, hops, **trim),
        want_bwd=backward_bytes(scheme, B, n, H, Hkv, D, elem, world, hops, **trim),
        # what whole shards would have cost (the ring before it trimmed its messages)
        full_fwd=forward_bytes(B, n, Hkv, D, elem, world, hops),
        full_bwd=backward_bytes(scheme, B, n, H, Hkv, D, elem, world, hops),
        by_tensor=dict(st.by_tensor),
        hops=hops, steps=steps,
    )


def run_cases(group, cases):
    with _piecewise_kernel():
        return [run_case(group, c) for c in cases]


def bad_sparse_call(group, case):
    """One bad sparse call; the ValueError message or None."""
    world = dist.get_world_size(group)
    n = 8
    q = torch.randn(1, n, 2, 8)
    k = torch.randn(1, n, 2, 8)
    kw = dict(group=group, causal=True)
    S = n * world
    if case == "window_not_causal":
        kw.update(causal=False, window=4)
    elif case == "window_zero":
        kw["window"] = 0
    elif case == "window_float":
        kw["window"] = 2.5
    elif case == "cu_not_from_zero":
        kw["cu_seqlens"] = [1, S]
    elif case == "cu_short_of_length":
        kw["cu_seqlens"] = [0, S - 1]
    elif case == "cu_decreasing":
        kw["cu_seqlens"] = [0, 5, 3, S]
    elif case == "cu_float_tensor":
        kw["cu_seqlens"] = torch.tensor([0.0, float(S)])
    elif case == "cu_not_ints":
        kw["cu_seqlens"] = [0, "a", S]
    elif case == "block_not_bool":
        kw["block_mask"] = torch.ones(world, world)
    elif case == "block_not_square":
        kw["block_mask"] = torch.ones(2, 4, dtype=torch.bool)
    elif case == "block_not_dividing":
        kw["block_mask"] = torch.ones(S + 1, S + 1, dtype=torch.bool)
    elif case == "block_size_mismatch":
        kw.update(block_mask=torch.ones(world, world, dtype=torch.bool), block_size=3)
    elif case == "block_striped_not_multiple":
        # blocks of 1 token cannot be shared out evenly by striped ranks
        kw.update(layout="striped", block_mask=torch.ones(S, S, dtype=torch.bool))
    elif case == "block_contiguous_straddles":
        kw.update(layout="contiguous", block_mask=torch.ones(S // (n * 2), S // (n * 2), dtype=torch.bool))
    elif case == "block_with_window":
        kw.update(window=4, block_mask=torch.ones(world, world, dtype=torch.bool))
    elif case == "block_size_alone":
        kw["block_size"] = 4
    else:
        raise AssertionError(case)
    try:
        be.burst_attn_func(q, k, k, **kw)
    except ValueError as e:
        return str(e)
    return None


def bench(group, argv):
    """The sparse benchmark (burstengine/bench/peers/sparse.py) on this group; rank 0's record."""
    from burstengine.bench.peers.sparse import run

    rec = run(group, argv)
    return rec if dist.get_rank(group) == 0 else None
