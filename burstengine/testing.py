"""Helpers for testing distributed code on one machine: a float64 dense attention oracle and
a pool of gloo processes spawned once and reused for many cases."""
from __future__ import annotations

import math
import multiprocessing as mp
import os
import socket
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist


def dense_attention(q, k, v, causal=False, scale=None):
    """Plain softmax attention on full (B, S, H, D) tensors, differentiable; returns (out, lse).

    Written independently of the kernels so it can serve as the oracle."""
    H, Hkv = q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    s = qh @ kh.transpose(-1, -2) * scale
    if causal:
        S = q.shape[1]
        s = s.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1) @ vh
    return out.transpose(1, 2), lse


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, conn):
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
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.world, self.timeout = world, timeout
        self.procs, self.conns = [], []
        for r in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker, args=(r, world, port, child), daemon=True)
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
        for c, p in zip(self.conns, self.procs):
            if not force:
                try:
                    c.send(None)
                except Exception:
                    pass
            p.join(timeout=5 if not force else 0)
            if p.is_alive():
                p.kill()
