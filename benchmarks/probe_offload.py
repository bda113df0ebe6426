"""Probe: the ``offload`` checkpointing policy on one GPU, at Llama-3.2-3B layer shapes with a few
layers.  (1) Its loss and gradients against ``pointwise`` (the same arithmetic: the bytes come
back unchanged) and the float64-free check that both are finite; (2) device memory held between
forward and backward, and the step's peak, under none / pointwise / offload / sequence; (3) the
step time of each, and of plans laid out as ``auto`` does (the first layers offloaded); (4) the host link's copy bandwidth (pinned, one direction at a time).

    python benchmarks/probe_offload.py [SEQ] [LAYERS]      # default 65536 6; record: probe_offload
"""
import dataclasses
import os
import sys
import time

import torch

from burstengine.model import offload as O
from burstengine.model import PRESETS, Transformer
from burstengine.bench.records import write_record
from burstengine.timing import median

seq = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
layers = int(sys.argv[2]) if len(sys.argv) > 2 else 6
dev = torch.device("cuda")
args = dataclasses.replace(PRESETS["llama-3b"], n_layers=layers)
torch.manual_seed(0)
base = Transformer(args, checkpoint="none", loss="fused").to(dev, torch.bfloat16)
base.init_weights(0)
tokens = torch.randint(0, args.vocab_size, (1, seq), device=dev)
labels = torch.randint(0, args.vocab_size, (1, seq), device=dev)
pos = torch.arange(seq, device=dev)
GiB = 2**30


def step(model):
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    loss = model(tokens, pos, labels) / seq
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return loss.item(), dt, held / GiB, (torch.cuda.max_memory_allocated() - before) / GiB


rows, grads = [], {}
# uniform plans, then plans as "auto" lays them out: the first layers offloaded (or sequence)
# under pointwise ones, so that each offloaded layer comes back during the backward of the one above
half = layers // 2
plans = {p: [p] * layers for p in ("pointwise", "offload", "none", "sequence")}
plans.update({f"{half} {p} + pointwise": [p] * half + ["pointwise"] * (layers - half) for p in ("offload", "sequence")})
for name, plan in plans.items():
    for b, policy in zip(base.layers, plan):
        b.policy, b.checkpoint_split = policy, 1.0
    try:
        times = []
        for i in range(4):
            loss, dt, held, peak = step(base)
            times.append(dt)
        grads[name] = {n: p.grad.float().clone() for n, p in base.named_parameters()}
        row = dict(plan=name, loss=loss, step_times_s=times, median_step_s=median(times[1:]),
                   held_after_forward_gib=held, peak_gib=peak)
        if base.offloader is not None:
            row["host_gib"] = base.offloader.host_bytes() / GiB
    except torch.OutOfMemoryError:
        row = dict(plan=name, error="out of memory")
    rows.append(row)
    print(row, flush=True)
    torch.cuda.empty_cache()


def rel(a, b):
    return max(((a[n] - b[n]).abs().max() / b[n].abs().max().clamp_min(1e-30)).item() for n in b)


checks = {}
if "offload" in grads and "pointwise" in grads:
    checks["offload_vs_pointwise_grad_rel"] = rel(grads["offload"], grads["pointwise"])
    checks["none_vs_pointwise_grad_rel"] = rel(grads["none"], grads["pointwise"]) if "none" in grads else None
    checks["finite"] = all(torch.isfinite(g).all().item() for g in grads["offload"].values())
print(checks, flush=True)

# the host link, pinned both ends
n = 2 * GiB
d = torch.empty(n, dtype=torch.uint8, device=dev)
h = O._HostBuffer(n, pin=True)
link = {}
for name, (dst, src) in {"d2h": (h.data, d), "h2d": (d, h.data)}.items():
    ts = []
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    link[name + "_gb_s"] = n / median(ts[1:]) / 1e9
h.release()
print(link, flush=True)
path = write_record("probe_offload", dict(
    command="python benchmarks/probe_offload.py " + " ".join(sys.argv[1:]), seq=seq, layers=layers,
    model="llama-3b shapes", device=torch.cuda.get_device_name(), rows=rows, checks=checks, link=link),
    out_dir=os.environ.get("OUT"))
print(path)
