"""Our Triton kernels' variants for the single-GPU kernel benches (`bench lao-bench`, `bench
lao-check`): compiling many of them at once in worker processes (the compiled kernels land in
Triton's on-disk cache, so the measuring process only loads them), and the tile configs a sweep
chose."""
from __future__ import annotations

import json
import multiprocessing as mp
import os

import torch

from ..kernels.triton.kernel import TileConfig, TritonKernel
from ..masks import MaskSpec


def _warm(task):
    """Run one kernel variant on tiny inputs so Triton compiles it (in a worker process)."""
    try:
        cfg = TileConfig.from_dict(task["config"])
        D, dtype = task["D"], getattr(torch, task["dtype"])
        kern = TritonKernel({D: cfg})
        dev = torch.device("cuda")
        S, H, Hkv = 300, task.get("H", 4), task.get("Hkv", 2)
        q = torch.randn(1, S, H, D, device=dev, dtype=dtype)
        k = torch.randn(1, S, Hkv, D, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        doc = torch.arange(S, device=dev) // 100
        mask = MaskSpec(causal=True,
                        q_doc=doc if task["doc"] else None, k_doc=doc if task["doc"] else None,
                        block_mask=torch.ones(3, 3, dtype=torch.bool) if task["block"] else None,
                        block_size=100 if task["block"] else 0)
        out, lse = kern.forward(q, k, v, D ** -0.5, mask)
        kern.forward_into(q, k, v, D ** -0.5, mask, out.float(), lse.clone())
        delta = (out.float() * q.float()).sum(-1).transpose(1, 2).contiguous()
        kern.backward(q, q, k, v, lse, delta, D ** -0.5, mask)
        # the ring's float32 accumulators are another specialisation
        acc = [torch.zeros(t.shape, device=dev) for t in (q, k, v)]
        kern.backward_into(q, q, k, v, lse, delta, D ** -0.5, mask, *acc)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported, not fatal: the measuring process will meet it again
        return f"{task}: {type(e).__name__}: {e}"[:2000]


def warm_variants(tasks: list[dict], jobs: int = 8) -> list[str]:
    """Compile every task's kernels in ``jobs`` processes; returns the errors."""
    if not tasks:
        return []
    with mp.get_context("spawn").Pool(min(jobs, len(tasks))) as pool:
        return [e for e in pool.map(_warm, tasks, chunksize=1) if e]


def log(*a):
    print(*a, flush=True)


def load_configs(path):
    """Configs from a sweep's JSON; the CONFIGS table when there is none (e.g. the sweep failed)."""
    if not path or not os.path.exists(path):
        log(f"no configs at {path!r}: using the CONFIGS table")
        return None
    return {int(D): TileConfig.from_dict(c) for D, c in json.load(open(path)).items()}
