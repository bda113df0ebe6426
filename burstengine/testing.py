"""Helpers for testing distributed code on one machine: a float64 dense attention oracle and
a pool of gloo processes spawned once and reused for many cases."""
from __future__ import annotations

import math
import os
import socket
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from . import processes


def dense_attention(q, k, v, causal=False, scale=None, mask=None):
    """Plain softmax attention on full (B, S, H, D) tensors, differentiable; returns (out, lse).

    ``mask``: optional bool (S, S), True where query i may see key j (and-ed with ``causal``).
    Rows that see nothing give out = 0 and lse = -inf with zero gradients, not NaN.
    Written independently of the kernels so it can serve as the oracle."""
    H, Hkv = q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    s = qh @ kh.transpose(-1, -2) * scale
    Sq, Sk = q.shape[1], k.shape[1]
    vis = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device)
    if causal:
        vis = vis.tril()
    if mask is not None:
        vis = vis & mask.to(q.device)
    if bool(vis.all()):
        return (torch.softmax(s, -1) @ vh).transpose(1, 2), torch.logsumexp(s, -1)
    seen = vis.any(-1)
    # empty rows: softmax over zeros (finite, so no NaN reaches the gradient), then zeroed
    s = torch.where(vis, s, float("-inf")).masked_fill(~seen[:, None], 0.0)
    lse = torch.logsumexp(s, -1).masked_fill(~seen, float("-inf"))
    out = (torch.softmax(s, -1) * seen[:, None]) @ vh
    return out.transpose(1, 2), lse


def sparse_mask(seq_len, causal=False, window=None, cu_seqlens=None, block_mask=None):
    """The dense bool (S, S) mask of burst_attn_func's sparse arguments, straight from their
    definitions (for the oracle; deliberately not the schedule's or the kernels' code)."""
    i = torch.arange(seq_len)[:, None]
    j = torch.arange(seq_len)[None, :]
    vis = torch.ones(seq_len, seq_len, dtype=torch.bool)
    if causal:
        vis &= j <= i
    if window is not None:
        vis &= i - j < window
    if cu_seqlens is not None:
        doc = torch.zeros(seq_len, dtype=torch.int64)
        for d, (a, b) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
            doc[a:b] = d
        vis &= doc[:, None] == doc[None, :]
    if block_mask is not None:
        bs = seq_len // block_mask.shape[0]
        vis &= block_mask.cpu()[i // bs, j // bs]
    return vis


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max |ref| (normwise, so near-zero reference entries don't blow it up)."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def fro_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref||_F / ||ref||_F: the normwise error METHOD-style GPU checks use."""
    x, ref = x.double(), ref.double()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def suite_on_path(tests_dir: str) -> None:
    """Put a checkout's test suite on ``sys.path``: ``tests_dir`` (the shared helpers, the
    ``*_cases`` modules) and each folder under it (the tests, grouped like the package).  The
    suite's modules import each other by basename, unique across the folders; the gloo workers
    spawned afterwards inherit the path."""
    root = os.path.abspath(tests_dir)
    dirs = [root] + sorted(os.path.join(root, d) for d in os.listdir(root)
                           if os.path.isdir(os.path.join(root, d)) and not d.startswith((".", "_")))
    for d in reversed(dirs):
        if d not in sys.path:
            sys.path.insert(0, d)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, conn, inherited):
    processes.adopt(inherited)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                           timeout=timedelta(seconds=120))
    # one group per size 1..world-1 over the lowest ranks; the full world uses the default group
    groups = {w: dist.new_group(list(range(w))) for w in range(1, world)}
    groups[world] = None
    conn.send(("ready", None))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        fn, args, kwargs, w = msg
        if rank < w:
            try:
                res = ("ok", fn(groups[w], *args, **kwargs))
            except BaseException:
                res = ("err", traceback.format_exc())
        else:
            res = ("ok", None)
        conn.send(res)
    dist.destroy_process_group()


class DistPool:
    """``world`` gloo processes, started once; ``run(fn, ..., world=w)`` calls
    ``fn(group, *args)`` on ranks 0..w-1 (group = a w-rank group, None for the full world) and
    returns their results in rank order.  ``fn`` must be importable (module level)."""

    def __init__(self, world: int = 4, timeout: float = 300.0):
        ctx = processes.context()  # ranks forked from a server that imported torch once
        port = _free_port()
        self.world, self.timeout = world, timeout
        self.procs, self.conns = [], []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, world, port, child, processes.Inherited()), daemon=True)
            p.start()
            self.procs.append(p)
            self.conns.append(parent)
        self._collect()

    def _collect(self):
        out = []
        for r, c in enumerate(self.conns):
            if not c.poll(self.timeout):
                self.close(force=True)
                raise TimeoutError(f"rank {r} gave no answer within {self.timeout:.0f}s")
            out.append(c.recv())
        errs = [f"rank {r}:\n{v}" for r, (s, v) in enumerate(out) if s == "err"]
        if errs:
            raise RuntimeError("\n".join(errs))
        return [v for _, v in out]

    def run(self, fn, *args, world: int | None = None, **kwargs):
        w = self.world if world is None else world
        for c in self.conns:
            c.send((fn, args, kwargs, w))
        return self._collect()[:w]

    def close(self, force=False):
        # every rank told first: each leaves through destroy_process_group, which waits for the others
        for c in self.conns if not force else ():
            try:
                c.send(None)
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=5 if not force else 0)
            if p.is_alive():
                p.kill()
