"""Can a multi-rank decode step live in a CUDA graph, and what does each collective cost there?

    torchrun --nproc_per_node 2 benchmarks/probe_nccl_graph.py [--layers 32] [--out DIR]

A stand-in for one decode step over 2+ ranks: per layer a small matmul (the projections of a few
tokens), an all-gather of B x H x (D + 1) float32 (the merge of the ranks' partial attentions) and
an all-reduce of B x dim (a row-parallel projection's partial sums).  The same step runs eagerly
and captured in one CUDA graph (NCCL collectives are captured when the communicator exists before
the capture); the probe checks that both give the same bits, and times them: the per-collective
cost in a graph is what a graph-captured decode step over ranks pays per layer.  Writes a record.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def step(x, w, gathered, layers: int, group=None):
    h = x
    for _ in range(layers):
        part = (h @ w).float()                                   # (B, H * (D + 1))
        dist.all_gather_into_tensor(gathered, part, group=group)  # every rank's partials
        merged = gathered.view(-1, *part.shape).sum(0)
        red = merged[:, : h.shape[1]].to(h.dtype).contiguous()
        dist.all_reduce(red, group=group)                         # a row-parallel projection
        h = red * 0.5
    return h


def timed(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=os.environ.get("BURST_RESULTS", "."))
    a = p.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    torch.manual_seed(rank)
    dim, width = a.heads * a.head_dim, a.heads * (a.head_dim + 1)
    x = torch.randn(a.batch, dim, device=dev, dtype=torch.bfloat16)
    w = torch.randn(dim, width, device=dev, dtype=torch.bfloat16) / dim ** 0.5
    gathered = torch.empty(world * a.batch, width, device=dev, dtype=torch.float32)
    eager = step(x, w, gathered, a.layers)          # warms the communicator and the kernels
    torch.cuda.synchronize()
    eager_s = timed(lambda: step(x, w, gathered, a.layers), a.iters)
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(x, w, gathered, a.layers)
    torch.cuda.current_stream().wait_stream(side)
    error = None
    try:
        with torch.cuda.graph(g):
            out = step(x, w, gathered, a.layers)
        g.replay()
        torch.cuda.synchronize()
        same = bool(torch.equal(out, eager))
        graph_s = timed(g.replay, a.iters)
    except Exception as e:  # the answer is the record: capture does or does not work here
        error, same, graph_s = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}", False, []
    colls = 2 * a.layers
    row = {"world": world, "layers": a.layers, "batch": a.batch, "collectives_per_step": colls,
           "eager_step_ms": statistics.median(eager_s) * 1e3,
           "graph_step_ms": statistics.median(graph_s) * 1e3 if graph_s else None,
           "graph_us_per_collective": statistics.median(graph_s) * 1e6 / colls if graph_s else None,
           "graph_equals_eager": same, "error": error, "eager_s": eager_s, "graph_s": graph_s,
           "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "nccl": ".".join(map(str, torch.cuda.nccl.version())), "commit": os.environ.get("BURST_COMMIT")}
    if rank == 0:
        print(json.dumps({k: v for k, v in row.items() if not k.endswith("_s")}, indent=1))
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"probe_nccl_graph_{world}gpu.json"), "w") as f:
            json.dump({"command": "torchrun --nproc_per_node %d benchmarks/probe_nccl_graph.py" % world, **row}, f,
                      indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if (error is None and same) else 1


if __name__ == "__main__":
    raise SystemExit(main())
