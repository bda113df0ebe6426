"""Memory and time against the split of sequence-level selective checkpointing (BurstEngine
§3.2, Fig. 7), on a stack of LLaMA-style blocks (RMSNorm, GQA attention with RoPE through
BurstAttention, SwiGLU MLP), forward + backward, bf16.

Modes: none (plain autograd), full (torch.utils.checkpoint of the whole block: attention is
recomputed), and seq@s for each --splits s (burstengine.seq_checkpoint: the attention output
of the back s of each rank's tokens is kept, the front recomputed; s = 0 keeps only the block
input like full, s = 1 keeps the whole attention output like selective checkpointing++).

Reported per mode: activation memory held between forward and backward (allocated after the
forward minus before it), peak during forward + backward beyond the parameters and input, and
the median step time.  Also the input-gradient difference of each mode against 'none'.

    burstengine bench seqckpt-memory                                   # one GPU
    torchrun --nproc_per_node 4 -m burstengine bench seqckpt-memory --seq 524288  # context parallel
    burstengine bench seqckpt-memory --device cpu --seq 256 --d-model 64 --heads 4 --kv-heads 2 \\
        --head-dim 16 --ffn 128 --layers 2                                 # smoke test
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..tables import Section, fixed, med, ms, num, table
import burstengine as be
from ...model.rope import rope_tables as model_rope_tables
from ...testing import fro_err
from ..records import write_record
from ..usage import command_parser


def rope_tables(positions, D, base=10000.0):
    """cos, sin (1, n, 1, D) float32 of model/rope.py's tables: the same angles (its float64 ones
    rounded once, where this bench once computed them in float32)."""
    return tuple(t.float()[None, :, None, :] for t in model_rope_tables(positions, D, base))


# the rotation in plain torch, eager: the checkpointing is what this bench measures, its records
# were taken so, and model/llama.py's apply_rope runs a compiled kernel on GPUs
def rope(x, cos, sin):
    a, b = x.chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-b, a], dim=-1).float() * sin).to(x.dtype)


class Block(nn.Module):
    def __init__(self, d, H, Hkv, D, ffn):
        super().__init__()
        self.H, self.Hkv, self.D = H, Hkv, D
        self.norm1, self.norm2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.wqkv = nn.Linear(d, (H + 2 * Hkv) * D, bias=False)
        self.wo = nn.Linear(H * D, d, bias=False)
        self.w13 = nn.Linear(d, 2 * ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)

    def pre_attn(self, x):
        B, n, _ = x.shape
        q, k, v = self.wqkv(self.norm1(x)).split([self.H * self.D, self.Hkv * self.D, self.Hkv * self.D], -1)
        q, k, v = q.view(B, n, self.H, self.D), k.view(B, n, self.Hkv, self.D), v.view(B, n, self.Hkv, self.D)
        return rope(q, self.cos, self.sin), rope(k, self.cos, self.sin), v

    def post_attn(self, x, o):
        h = x + self.wo(o.flatten(2))
        a, b = self.w13(self.norm2(h)).chunk(2, dim=-1)
        return h + self.w2(F.silu(a) * b)

    def forward(self, x, mode, split, attn):
        if mode == "none":
            return self.post_attn(x, be.burst_attn_func(*self.pre_attn(x), **attn))
        if mode == "full":
            return checkpoint(lambda t: self.post_attn(t, be.burst_attn_func(*self.pre_attn(t), **attn)), x,
                              use_reentrant=False)
        return be.seq_checkpoint(x, self.pre_attn, self.post_attn, split=split, **attn)


def main(argv=None):
    ap = command_parser("burstengine bench seqckpt-memory", __doc__)
    ap.add_argument("--seq", type=int, default=32768, help="global sequence length")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ffn", type=int, default=11008)
    ap.add_argument("--layout", default="striped")
    ap.add_argument("--splits", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    ap.add_argument("--modes", nargs="+", default=["none", "full", "seq"])
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--kernel", default=None)
    ap.add_argument("--name", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    group = None
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    cuda = device.type == "cuda"
    n = args.seq // world

    torch.manual_seed(0)
    blocks = nn.ModuleList(Block(args.d_model, args.heads, args.kv_heads, args.head_dim, args.ffn)
                           for _ in range(args.layers)).to(device, dtype)
    cos, sin = rope_tables(be.position_ids(args.seq, args.layout, rank, world, device=device), args.head_dim)
    for b in blocks:
        b.cos, b.sin = cos, sin
    x_full = torch.randn(1, args.seq, args.d_model, dtype=dtype, device=device)
    dy_full = torch.randn(1, args.seq, args.d_model, dtype=dtype, device=device)
    x = be.shard(x_full, args.layout, rank, world).clone().requires_grad_()
    dy = be.shard(dy_full, args.layout, rank, world).clone()
    del x_full, dy_full
    attn = dict(group=group, causal=True, layout=args.layout, kernel=args.kernel)

    def step(mode, split):
        y = x
        for b in blocks:
            y = b(y, mode, split, attn)
        held = torch.cuda.memory_allocated() if cuda else None
        y.backward(dy)
        return held

    runs = [(m, None) for m in args.modes if m != "seq"] + ([("seq", s) for s in args.splits] if "seq" in args.modes
                                                             else [])
    rows, ref_grad = [], None
    for mode, split in runs:
        label = mode if split is None else f"seq@{split:g}"
        for _ in range(args.warmup):
            x.grad = None
            blocks.zero_grad(set_to_none=True)
            step(mode, split)
        x.grad = None
        blocks.zero_grad(set_to_none=True)
        held = peak = None
        if cuda:
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        h = step(mode, split)
        if cuda:
            torch.cuda.synchronize()
            held = (h - base) / 2**30
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        grad = x.grad.detach().clone()
        if ref_grad is None and mode == "none":
            ref_grad = grad
        times = []
        for _ in range(args.iters):
            x.grad = None
            blocks.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            if dist.is_initialized():
                dist.barrier()
            t = time.perf_counter()
            step(mode, split)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        row = dict(mode=label, split=split, held_gib=held, peak_gib=peak, times_s=times,
                   median_s=statistics.median(times),
                   dx_err_vs_none=None if ref_grad is None else fro_err(grad, ref_grad))
        rows.append(row)
        if rank == 0:
            mem = "" if held is None else f"held {held:7.2f} GiB  peak {peak:7.2f} GiB  "
            err = "" if row["dx_err_vs_none"] is None else f"  dx vs none {row['dx_err_vs_none']:.1e}"
            print(f"{label:9s} {mem}{row['median_s'] * 1e3:9.1f} ms{err}", flush=True)
    if rank == 0:
        name = args.name or f"seqckpt_memory_{world}{'gpu' if cuda else 'cpu'}"
        path = write_record(name, dict(args=vars(args), world=world, local_tokens=n, rows=rows), args.out)
        print(f"record: {path}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    return table(["mode", "split", "held GiB", "peak GiB", "median ms", "dx error vs none"],
                 [[r["mode"], "—" if r["split"] is None else r["split"], fixed(r["held_gib"], 3),
                   fixed(r["peak_gib"], 3), ms(med(r["times_s"])), num(r["dx_err_vs_none"])] for r in rec["rows"]])


SECTIONS = (Section("Sequence-level checkpointing", r"^seqckpt", render,
                    "`burstengine bench seqckpt-memory`: memory and time of one block against the split."),)
