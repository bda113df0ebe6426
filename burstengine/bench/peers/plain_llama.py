"""The baseline a user would pick instead of BurstEngine on one GPU: the same Llama written the
plain-PyTorch way, as torchtitan runs it.

SDPA with the cuDNN backend (GQA through ``enable_gqa``), ``F.rms_norm``, RoPE and SwiGLU in
plain torch, each block compiled with ``torch.compile``, torch's own activation checkpointing
(``full``: every block recomputed; ``selective``: torch's selective activation checkpointing
that keeps the matmul and attention outputs and recomputes the elementwise work; ``none``),
FSDP2 with bf16 compute and fp32 reduce/master weights as our trainer uses, AdamW, and the LM
head + cross-entropy over chunks of tokens under checkpointing (a 128K-token sequence's full
logits would not fit).  ``best_case`` tries the AC options from the fastest down and keeps the
first that fits: the best this baseline does on the device.

Same shapes, same FLOPs-per-token definition (ModelArgs.flops_per_token) as our trainer, so
MFU and tokens/s compare directly; only the model code differs.
"""
from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ...train.metrics import peak_flops, peak_memory_gib

AC_OPTIONS = ("none", "selective", "full")  # fastest first
LOSS_CHUNK = 8192


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        hd = a.dim // a.n_heads
        self.h, self.hkv, self.hd, self.eps = a.n_heads, a.n_kv_heads, hd, a.norm_eps
        self.wqkv = nn.Linear(a.dim, (a.n_heads + 2 * a.n_kv_heads) * hd, bias=False)
        self.wo = nn.Linear(a.n_heads * hd, a.dim, bias=False)
        self.w13 = nn.Linear(a.dim, 2 * a.ffn_dim, bias=False)
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)
        self.n1 = nn.Parameter(torch.ones(a.dim))
        self.n2 = nn.Parameter(torch.ones(a.dim))

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q, k, v = self.wqkv(F.rms_norm(x, (x.shape[-1],), self.n1, self.eps)).split(
            [self.h * self.hd, self.hkv * self.hd, self.hkv * self.hd], dim=-1)
        q, k = (_rope(t.view(B, S, -1, self.hd), cos, sin).transpose(1, 2) for t in (q, k))
        v = v.view(B, S, self.hkv, self.hd).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.hkv != self.h)
        x = x + self.wo(o.transpose(1, 2).reshape(B, S, -1))
        g, u = self.w13(F.rms_norm(x, (x.shape[-1],), self.n2, self.eps)).chunk(2, dim=-1)
        return x + self.w2(F.silu(g) * u)


# RoPE here (and its tables in PlainLlama.forward) is written the plain way on purpose, not
# model/rope.py's rope_tables and model/llama.py's apply_rope: this is the model a user writes
# without BurstEngine, its tables computed in every step as such a model does
def _rope(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class PlainLlama(nn.Module):
    def __init__(self, a, ac: str = "full"):
        super().__init__()
        self.a, self.ac = a, ac
        self.emb = nn.Embedding(a.vocab_size, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = nn.Parameter(torch.ones(a.dim))
        self.head = None if a.tie_embeddings else nn.Linear(a.dim, a.vocab_size, bias=False)

    def compile_blocks(self):
        for b in self.layers:
            b.compile(fullgraph=True)

    def forward(self, tokens, labels):
        a = self.a
        S = tokens.shape[1]
        hd = a.dim // a.n_heads
        inv = 1.0 / (a.rope_theta ** (torch.arange(0, hd, 2, device=tokens.device, dtype=torch.float32) / hd))
        ang = torch.arange(S, device=tokens.device, dtype=torch.float32)[:, None] * inv[None]
        cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
        x = self.emb(tokens)
        for b in self.layers:
            if self.ac == "full":
                x = checkpoint(b, x, cos, sin, use_reentrant=False)
            elif self.ac == "selective":
                x = checkpoint(b, x, cos, sin, use_reentrant=False, context_fn=_sac_context)
            else:
                x = b(x, cos, sin)
        x = F.rms_norm(x, (x.shape[-1],), self.norm, a.norm_eps)
        w = self.emb.weight if self.head is None else self.head.weight
        total = x.new_zeros((), dtype=torch.float32)
        for i in range(0, S, LOSS_CHUNK):  # the logits of one chunk at a time, recomputed in backward
            total = total + checkpoint(_chunk_loss, x[:, i:i + LOSS_CHUNK], w, labels[:, i:i + LOSS_CHUNK],
                                       use_reentrant=False)
        return total


def _chunk_loss(x, w, labels):
    return F.cross_entropy((x @ w.t()).float().flatten(0, 1), labels.flatten(), reduction="sum",
                           ignore_index=-100)


def _sac_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    keep = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_cudnn_attention.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default}

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def run_case(model_args, seq: int, ac: str, warmup: int, steps: int, device, compile_blocks: bool = True) -> dict:
    """Train ``steps`` timed steps after ``warmup`` ones of the plain model on this rank alone;
    the row has the same fields as bench/peers/train.py's (OOM reported, not raised)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.attention import SDPBackend, sdpa_kernel

    row = {"method": f"plain-{ac}", "seq_len": seq}
    model = opt = None
    try:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = PlainLlama(model_args, ac)
        # the float32 RoPE tables enter each block as inputs: FSDP must not cast them (a cast in the
        # forward but not in checkpointing's recompute breaks the recompute's metadata check)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
        for b in model.layers:
            fully_shard(b, mp_policy=mp)
        fully_shard(model, mp_policy=mp, reshard_after_forward=False)
        model.to_empty(device=device)
        for name, p in model.named_parameters():
            with torch.no_grad():
                (p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02))
        if compile_blocks:
            model.compile_blocks()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, model_args.vocab_size, (1, seq + 1), generator=g).to(device)
        inp, lab = tokens[:, :-1], tokens[:, 1:]
        times, first = [], None
        backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION] if device.type == "cuda" else \
            [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
        with sdpa_kernel(backends):
            for step in range(warmup + steps):
                if step == warmup and device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                loss = model(inp, lab) / seq
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
                opt.step()
                opt.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                if step == 0:
                    first = loss.item()
                if step >= warmup:
                    times.append(time.perf_counter() - t0)
        med = sorted(times)[len(times) // 2]
        tgs = seq / med
        peak = peak_flops(device)
        fpt = model_args.flops_per_token(seq)
        row.update(ok=True, step_times_s=times, median_step_s=med, tokens_per_s_per_gpu=tgs,
                   mfu=tgs * fpt / peak if peak else None, flops_per_token=fpt, first_loss=first,
                   peak_mem_gib=peak_memory_gib(device))
    except torch.OutOfMemoryError:
        row.update(ok=False, error="out of memory")
    finally:
        del model, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def best_case(model_args, seq: int, warmup: int, steps: int, device, say=print) -> list[dict]:
    """Every AC option from the fastest down until one fits; the rows tried (the last ok one is
    the baseline's best)."""
    rows = []
    for ac in AC_OPTIONS:
        row = run_case(model_args, seq, ac, warmup, steps, device)
        rows.append(row)
        say(f"plain-{ac:<9} S={seq}: " + (f"{row['median_step_s']:.3f} s/step, {row['tokens_per_s_per_gpu']:,.0f} "
                                          f"tok/s/GPU, MFU {row['mfu']:.1%}, peak {row['peak_mem_gib']:.1f} GiB"
                                          if row["ok"] and row["mfu"] is not None else row.get("error", "ok (no MFU on CPU)")))
        if row["ok"]:
            break
    if dist.is_initialized():
        dist.barrier()
    return rows
