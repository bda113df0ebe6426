"""Calls a hostile user makes, run inside the gloo workers of tests/attention/test_hostile.py: double
backward through every autograd Function of the library, softmax_scale of odd types, sparse
masks that differ between ranks, and settings from the environment that differ per rank."""
from __future__ import annotations

import os
import sys
import time
from contextlib import contextmanager

import numpy as np
import torch
import torch.distributed as dist

import burstengine as be
from burstengine.loss import fused_linear_cross_entropy
from burstengine.testing import rel_err


def _qkv(world, rank, seed=0, B=1, n=4, H=4, Hkv=2, D=8, layout="zigzag", dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    S = n * world
    glob = [torch.randn(B, S, h, D, generator=g, dtype=dtype) for h in (H, Hkv, Hkv)]
    return [be.shard(t, layout, rank, world).requires_grad_() for t in glob]


def _second_order(fn, inputs):
    """(first-order grads plain, the same under create_graph=True, what the second backward did)."""
    plain = torch.autograd.grad(fn(*inputs).sum(), inputs)
    graphed = torch.autograd.grad(fn(*inputs).sum(), inputs, create_graph=True)
    try:
        torch.autograd.grad(sum((g * g).sum() for g in graphed), inputs)
        second = "returned"
    except RuntimeError as e:
        second = str(e)
    return max(rel_err(a.detach(), b) for a, b in zip(graphed, plain)), second


def double_backward(group, which):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if which in ("burst", "ring"):
        q, k, v = _qkv(world, rank)
        return _second_order(lambda q, k, v: be.burst_attn_func(q, k, v, group=group, causal=True, layout="zigzag",
                                                                 backward=which), (q, k, v))
    if which == "hybrid":
        q, k, v = _qkv(world, rank, layout="contiguous")
        return _second_order(lambda q, k, v: be.hybrid_attn_func(q, k, v, ulysses=world, group=group, causal=True),
                             (q, k, v))
    if which == "seqckpt":
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(1, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
        w = torch.randn(16, 48, generator=g, dtype=torch.float64) / 4

        def pre(x):
            q, k, v = (x @ w).split(16, dim=-1)
            return q.reshape(1, 4, 2, 8), k.reshape(1, 4, 2, 8), v.reshape(1, 4, 2, 8)

        def post(x, o):
            return x + o.reshape(1, 4, 16)

        return _second_order(lambda x: be.seq_checkpoint(x, pre, post, split=0.5, group=group, causal=True), (x,))
    if which == "fused_ce":
        g = torch.Generator().manual_seed(rank)
        h = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
        w = torch.randn(11, 8, generator=g, dtype=torch.float64, requires_grad=True)
        labels = torch.randint(0, 11, (6,), generator=g)
        return _second_order(lambda h, w: fused_linear_cross_entropy(h, w, labels, group=group), (h, w))
    raise ValueError(which)


def scale_types(group):
    """softmax_scale as a 0-d tensor, numpy float and int: the same result as the float."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = (t.detach() for t in _qkv(world, rank))
    want = be.burst_attn_func(q, k, v, group=group, causal=True, layout="zigzag", softmax_scale=0.25)
    errs = {}
    for name, s in (("tensor", torch.tensor(0.25)), ("tensor_f32", torch.tensor(0.25, dtype=torch.float32)),
                    ("np_float64", np.float64(0.25)), ("np_float32", np.float32(0.25))):
        errs[name] = rel_err(be.burst_attn_func(q, k, v, group=group, causal=True, layout="zigzag", softmax_scale=s),
                             want)
    msgs = {}
    for name, s in (("tensor_1d", torch.tensor([0.25])), ("tensor_nan", torch.tensor(float("nan"))),
                    ("np_neg", np.float64(-1.0)), ("string", "0.25")):
        try:
            be.burst_attn_func(q, k, v, group=group, causal=True, layout="zigzag", softmax_scale=s)
            msgs[name] = "returned"
        except ValueError as e:
            msgs[name] = str(e)
    return errs, msgs


def mask_disagree(group, case):
    """One rank (the last) passes another sparse mask: the message shows the values."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    n = 8
    S = n * world
    q, k, v = (t.detach() for t in _qkv(world, rank, n=n, layout="contiguous"))
    odd = rank == world - 1
    kw = dict(group=group, causal=True, layout="contiguous")
    if case == "window":
        kw["window"] = 5 if odd else 4
    elif case == "cu_seqlens":
        cu = [0, 3, 7, S]
        kw["cu_seqlens"] = [0, 3, 6, S] if odd else cu
    elif case == "cu_len":
        kw["cu_seqlens"] = [0, 3, S] if odd else [0, 3, 7, S]
    elif case == "block_mask":
        bm = torch.tril(torch.ones(S // 4, S // 4, dtype=torch.bool))
        if odd:
            bm[2, 1] = False
        kw["block_mask"] = bm
    elif case == "block_shape":
        kw["block_mask"] = torch.tril(torch.ones(S // (4 if odd else 2), S // (4 if odd else 2), dtype=torch.bool))
    try:
        be.burst_attn_func(q, k, v, **kw)
        return "returned"
    except ValueError as e:
        return str(e)


@contextmanager
def _env(**kv):
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update({k: v for k, v in kv.items() if v is not None})
    for k, v in kv.items():
        if v is None:
            os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def env_disagree(group, case):
    """One setting from the environment differs between ranks: every rank raises the same
    ValueError naming the ranks and values, before any ring traffic."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    q, k, v = (t.detach() for t in _qkv(world, rank))
    env = {}
    half = rank < world // 2
    if case == "local_world_size":
        env["LOCAL_WORLD_SIZE"] = str(world // 2 if half else world)
    elif case == "topology_one_rank":
        env["BURST_TOPOLOGY"] = "2x2" if rank == 1 else None
    elif case == "cluster":
        env["BURST_CLUSTER"] = "a800-paper" if rank == 0 else None
    elif case == "checks":
        env["BURST_CHECKS"] = "agree" if rank == 0 else "full"
    elif case == "timeout":
        env["BURST_TIMEOUT"] = "30" if rank == 0 else "20"
    with _env(**env):
        try:
            be.burst_attn_func(q, k, v, group=group, causal=True, layout="zigzag")
            return "returned"
        except ValueError as e:
            return str(e)


_KEPT = []


def exit_with(code_by_rank):
    """A spawn entry: this rank's exit code from ``code_by_rank`` (an exception for "raise")."""
    code = code_by_rank[dist.get_rank()]
    if code == "raise":
        raise RuntimeError("a config error on this rank")
    if code == "kill":
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    if code == "lock":  # a multiprocessing lock kept until the rank leaves, as tqdm's write lock is
        import multiprocessing

        _KEPT.append(multiprocessing.RLock())
        code = 0
    if isinstance(code, tuple):  # (code, seconds): say why after a while, as a slow rank 0 does
        time.sleep(code[1])
        print(f"rank {dist.get_rank()} says why it leaves", file=sys.stderr, flush=True)
        code = code[0]
    return code


def settings_disagree(group, case, out_dir):
    """The ranks of a training job start with different settings (a per-rank --set, another
    config file, an exported BURST_* variable): every rank raises the same ValueError naming
    the setting, the values and the ranks, before the job's first collective but that check."""
    import train_cases
    from burstengine.train import Trainer

    rank = dist.get_rank(group)
    extra, env = [f"out_dir={out_dir}", "steps=1", "eval_every=0"], {}
    if case == "activation_checkpoint":
        extra.append("activation_checkpoint=" + ("pointwise" if rank == 0 else "none"))
    elif case == "lr":  # the silent case: FSDP would step each rank's shard with its own lr
        extra.append("lr=" + ("0.001" if rank == 2 else "0.0003"))
    elif case == "env":
        env["BURST_KERNEL"] = "reference" if rank == 0 else None
    cfg = train_cases.small_config(extra)
    if case == "invalid_one_rank" and rank == 1:
        cfg.activation_checkpoint_split = 1.5
    with _env(**env):
        try:
            Trainer(cfg, group=group, echo=False).fit(overwrite=True)
            return "returned"
        except ValueError as e:
            return str(e)
