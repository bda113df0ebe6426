"""Do torch's symmetric-memory collectives beat NCCL for a decode step's small messages in a CUDA graph?

    torchrun --nproc_per_node 2 benchmarks/probe_symm.py [--layers 32] [--out DIR]

A tensor-parallel decode step over W ranks runs, per layer, four collectives of a few KB: the
all-gather of the step's q, k, v heads (bf16), the all-gather of the partial attentions and their
LSE (float32), and two all-reduces (bf16) after wo and w2.  NCCL costs ~7 us each there (the 8B
profile: 129 a step, 0.92 ms of 6.4).  torch's ``symm_mem.one_shot_all_reduce`` reads every
peer's buffer over NVLink in one kernel; an all-gather is the same op on a buffer where each rank
writes only its own slot (the others stay zero: x + 0 is exact).  The probe runs that pattern
(32 layers, a tiny kernel between collectives so each depends on the last) both ways, eagerly and
captured in a CUDA graph, checks both give the same values on every rank, and times them.
Writes one record.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


class Nccl:
    def __init__(self, group):
        self.group = group

    def all_gather(self, every, mine):
        dist.all_gather_into_tensor(every, mine, group=self.group)

    def all_reduce_(self, x):
        dist.all_reduce(x, group=self.group)


class Symm:
    """One symmetric buffer per message shape, zeroed once; an all-gather writes only its slot."""

    def __init__(self, group, rank, world, dev):
        import torch.distributed._symmetric_memory as symm_mem
        self.symm_mem, self.group, self.rank, self.world, self.dev = symm_mem, group, rank, world, dev
        self.name = group.group_name
        try:
            symm_mem.enable_symm_mem_for_group(self.name)
        except Exception:  # noqa: BLE001 -- newer torch: not needed
            pass
        self.bufs = {}

    def _buf(self, key, n, dtype):
        b = self.bufs.get(key)
        if b is None:
            b = self.symm_mem.empty(n, dtype=dtype, device=self.dev)
            self.symm_mem.rendezvous(b, self.name)
            b.zero_()
            torch.cuda.synchronize()
            dist.barrier(group=self.group)
            self.bufs[key] = b
        return b

    def all_gather(self, every, mine):
        n = mine.numel()
        b = self._buf(("g", n, mine.dtype), self.world * n, mine.dtype)
        b[self.rank * n:(self.rank + 1) * n].copy_(mine.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(b, "sum", self.name, every.view(-1))

    def all_reduce_(self, x):
        n = x.numel()
        b = self._buf(("r", n, x.dtype), n, x.dtype)
        b.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(b, "sum", self.name, x.view(-1))


def step(c, h, wq, layers, world, heads, hd):
    """The decode step's collectives with a little work between them."""
    B, dim = h.shape
    qkv_local = (dim + dim // 2) // world   # q plus k, v at 8 of 32 heads, this rank's share
    parts_local = B * heads * (hd + 1)
    every_qkv = torch.empty(world, qkv_local, device=h.device, dtype=h.dtype)
    every_parts = torch.empty(world, parts_local, device=h.device, dtype=torch.float32)
    for _ in range(layers):
        mine = (h[:, :qkv_local] * 1.01).contiguous()
        c.all_gather(every_qkv, mine)
        part = (every_qkv.sum(0, dtype=torch.float32)[None, :1].expand(B, parts_local) + 0.5).contiguous()
        c.all_gather(every_parts, part)
        o = (every_parts.sum(0)[:dim] * 1e-3).to(h.dtype).view(1, dim).expand(B, dim).contiguous()
        c.all_reduce_(o)
        h = (h + o) @ wq
        c.all_reduce_(h)
        h = h * 0.5
    return h


def timed(fn, iters):
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return out


def run(c, h, wq, a, world):
    f = lambda: step(c, h, wq, a.layers, world, a.heads, a.head_dim)  # noqa: E731
    eager = f()
    torch.cuda.synchronize()
    eager_s = timed(f, a.iters)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        f()
    torch.cuda.current_stream().wait_stream(side)
    g, error, graph_s, same = torch.cuda.CUDAGraph(), None, [], False
    try:
        with torch.cuda.graph(g):
            out = f()
        g.replay()
        torch.cuda.synchronize()
        same = bool(torch.equal(out, eager))
        graph_s = timed(g.replay, a.iters)
    except Exception as e:  # noqa: BLE001 -- the answer is the record
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    return eager, {"eager_step_ms": statistics.median(eager_s) * 1e3,
                   "graph_step_ms": statistics.median(graph_s) * 1e3 if graph_s else None,
                   "graph_equals_eager": same, "error": error, "eager_s": eager_s, "graph_s": graph_s}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=os.environ.get("BURST_RESULTS", "."))
    p.add_argument("--tag", default="", help="appended to the record's name (e.g. a run under another environment)")
    a = p.parse_args()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    torch.manual_seed(0)
    dim = a.heads * a.head_dim
    h = torch.randn(a.batch, dim, device=dev, dtype=torch.bfloat16)
    wq = torch.randn(dim, dim, device=dev, dtype=torch.bfloat16) / dim ** 0.5
    rows, outs = {}, {}
    for name, make in (("nccl", lambda: Nccl(group)), ("symm", lambda: Symm(group, rank, world, dev))):
        try:
            outs[name], rows[name] = run(make(), h, wq, a, world)
        except Exception as e:  # noqa: BLE001
            rows[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
    agree = None
    if "nccl" in outs and "symm" in outs:
        agree = float((outs["nccl"].float() - outs["symm"].float()).abs().max())
        # every rank must hold the same values (tensor parallelism's invariant)
        mine = outs["symm"].float().contiguous()
        every = torch.empty(world, *mine.shape, device=dev)
        dist.all_gather_into_tensor(every, mine)
        rows["symm"]["ranks_equal"] = bool((every == every[0]).all())
    colls = 4 * a.layers
    rec = {"command": f"torchrun --nproc_per_node {world} benchmarks/probe_symm.py --layers {a.layers}",
           "commit": os.environ.get("BURST_COMMIT"), "world": world, "layers": a.layers, "batch": a.batch,
           "collectives_per_step": colls,
           "env": {k: os.environ.get(k) for k in ("ENABLE_INTRA_NODE_COMM", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                   "NCCL_NVLS_ENABLE")}, "max_abs_diff_nccl_vs_symm": agree, "rows": rows,
           "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
           "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    if rank == 0:
        print(json.dumps({k: ({m: {x: y for x, y in r.items() if not x.endswith("_s")} for m, r in v.items()}
                              if k == "rows" else v) for k, v in rec.items()}, indent=1))
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, f"probe_symm_{world}gpu{a.tag}.json"), "w") as f:
            json.dump(rec, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
