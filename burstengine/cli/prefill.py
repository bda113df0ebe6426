"""`burstengine prefill`: distributed prefill of one long prompt; first-token latency and memory.

    torchrun --nproc_per_node 4 -m burstengine prefill --model llama-7b --seq 262144
    torchrun --nproc_per_node 4 -m burstengine prefill --model /path/to/hf-llama --prompt-file book.txt
    burstengine prefill --model tiny --seq 4096 --world 2          # CPU: spawns 2 gloo ranks

Every rank loads the model (a preset with random weights, or a local HF LLaMA directory:
config.json + safetensors), takes its shard of the prompt under --layout and runs one forward
pass with BurstAttention over the ranks.  Only the next-token logits are computed (the LM head
runs on the one row of the global last token).  Rank 0 prints the first-token latency (prompt on
the devices -> logits on every rank; the slowest rank's, median over --iters after --warmup),
the peak memory per rank and the top next tokens.  --save-kv keeps every layer's K/V and
writes each rank's shard; --record writes a JSON record.  Without torchrun it spawns --world
local ranks (gloo on CPU, NCCL with one GPU each when there are GPUs).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from ..bench.harness import RankLog
from ..bench.launch import run_command
from ..bench.records import write_record
from ..bench.usage import add_allow_longer, kernel_error, missing_package
from ..comm.dist import initialized
from ..inference.context import check_context
from ..inference.engine import check_prefill, peak_bytes, prefill, reset_peak
from ..inference.models import IMPLS, check_model_files, check_spec, load_model, resolve_dtype
from ..layout import LAYOUTS
from ..model import PRESETS
from ..timing import median, timed

HELP = "prefill a long prompt across ranks (BurstAttention): next-token logits, first-token latency, peak memory"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny",
                   help=f"a preset ({', '.join(PRESETS)}; random weights) or a local HF LLaMA directory [%(default)s]")
    p.add_argument("--impl", choices=IMPLS, default="ours",
                   help="ours: burstengine's LLaMA; hf: transformers with attn_implementation='burst' [%(default)s]")
    p.add_argument("--seq", type=int, default=4096, help="prompt length in tokens (random ids) [%(default)s]")
    p.add_argument("--prompt-file", default=None,
                   help="a text file to tokenize with the model directory's tokenizer instead of random ids")
    add_allow_longer(p)
    p.add_argument("--batch", type=int, default=1, help="prompts per batch [%(default)s]")
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag", help="sequence layout [%(default)s]")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                   help="weights and activations (auto: bf16 on GPUs, fp32 on CPU) [%(default)s]")
    p.add_argument("--kernel", default=None, help="local attention kernel (default: BURST_KERNEL or auto)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights and prompt [%(default)s]")
    p.add_argument("--warmup", type=int, default=1, help="untimed prefills first [%(default)s]")
    p.add_argument("--iters", type=int, default=1, help="timed prefills [%(default)s]")
    p.add_argument("--top", type=int, default=5, help="next-token candidates to print [%(default)s]")
    p.add_argument("--save-logits", default=None,
                   help="rank 0 writes the (batch, vocab) float32 logits here (torch.save)")
    p.add_argument("--save-kv", default=None,
                   help="keep every layer's K/V and write each rank's shard to DIR/kv_rank<r>.safetensors "
                        "(memory: 2 x layers x tokens/rank x kv_heads x head_dim values per rank)")
    p.add_argument("--record", default=None, help="write a JSON record of the run as NAME.json in $BURST_RESULTS or "
                                                   "./burst-results (a numbered name if that exists)")
    p.add_argument("--world", type=int, default=2, help="ranks to spawn without torchrun [%(default)s]")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per spawned CPU rank (default: cores / world)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are stopped [%(default)s]")


def validate(args) -> str | None:
    """A message for arguments that cannot work on ``args.world`` ranks, else None."""
    world = args.world

    # a missing package first: what the model directory holds cannot be read without it
    needs = [("safetensors", "--model DIR (HF safetensors weights)") if os.path.isdir(args.model) else None,
             ("transformers", "--impl hf") if args.impl == "hf" else None,
             ("transformers", "--prompt-file (the model's tokenizer)") if args.prompt_file else None,
             ("safetensors", "--save-kv") if args.save_kv else None]
    for need in filter(None, needs):
        msg = missing_package(*need)
        if msg:
            return msg
    msg = check_spec(args.model, args.impl)
    if msg:
        return msg
    for name in ("batch", "iters", "top"):
        if getattr(args, name) < 1:
            return f"--{name} must be >= 1, got {getattr(args, name)}"
    if args.warmup < 0:
        return f"--warmup must be >= 0, got {args.warmup}"
    if world < 1:
        return f"--world must be >= 1, got {world}"
    if not initialized() and torch.cuda.is_available() and world > torch.cuda.device_count():
        return f"--world {world} is more than the {torch.cuda.device_count()} GPU(s) here (one rank per GPU)"

    msg = kernel_error(args.kernel, "cuda" if torch.cuda.is_available() else "cpu") or check_model_files(args.model,
                                                                                                     args.impl)
    if msg:
        return msg
    if args.prompt_file:
        if not os.path.isfile(args.prompt_file):
            return f"--prompt-file {args.prompt_file!r} does not exist"
        if not os.path.isdir(args.model):
            return "--prompt-file needs --model to be a model directory (with its tokenizer)"
        return None  # its length is checked once tokenized (run_rank)
    return check_prefill(args.seq, args.layout, world, args.batch) or _longer(args, args.seq)


def _longer(args, tokens: int) -> str | None:
    what = f"the prompt of {args.prompt_file!r}" if args.prompt_file else "the prompt (--seq)"
    return None if args.allow_longer else check_context(args.model, tokens, what)


def _prompt(args, vocab: int) -> torch.Tensor:
    if args.prompt_file:
        from transformers import AutoTokenizer  # optional dependency (transformers): only for a text prompt

        tok = AutoTokenizer.from_pretrained(args.model)
        with open(args.prompt_file) as f:
            ids = tok(f.read(), return_tensors="pt").input_ids
        return ids.expand(args.batch, -1)
    g = torch.Generator().manual_seed(args.seed + 1)
    return torch.randint(0, vocab, (args.batch, args.seq), generator=g)


def _save_kv(path, out, rank, world, layout, seq):
    from safetensors.torch import save_file  # only when --save-kv asks for it

    os.makedirs(path, exist_ok=True)
    tensors = {"positions": out.positions.cpu().contiguous()}
    for i, (k, v) in enumerate(out.kv):
        tensors[f"layers.{i}.k"] = k.contiguous()
        tensors[f"layers.{i}.v"] = v.contiguous()
    meta = dict(rank=str(rank), world=str(world), layout=layout, seq=str(seq),
                shape="(batch, tokens, kv_heads, head_dim)")
    save_file(tensors, os.path.join(path, f"kv_rank{rank}.safetensors"), metadata=meta)


def run_rank(args) -> int:
    """The prefill on this rank of an initialised default group; returns the exit code."""
    rank, world = dist.get_rank(), dist.get_world_size()
    log = RankLog("prefill", rank, "7.1f")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = resolve_dtype(args.dtype, device)
    t0 = time.perf_counter()
    log(f"loading {args.model} ({args.impl}) on {world} rank(s), {device.type}, {dtype} ...")
    model = load_model(args.model, args.impl, device, dtype, args.seed)
    log(f"{model.describe} (loaded in {time.perf_counter() - t0:.1f}s)")
    ids = _prompt(args, model.vocab_size)
    B, S = ids.shape
    msg = check_prefill(S, args.layout, world, B) or _longer(args, S)
    if msg:  # a tokenized prompt's length is known only now; the same on every rank
        if rank == 0:
            print(f"burstengine prefill: error: {msg}", file=sys.stderr)
        return 2
    log(f"prompt {B} x {S} tokens, layout {args.layout}, {S // world} tokens per rank; "
        f"{args.warmup} warm-up + {args.iters} timed prefill(s)")
    box = {}

    def step():
        box["out"] = prefill(model, ids, layout=args.layout, keep_kv=bool(args.save_kv), kernel=args.kernel)

    reset_peak(device)
    secs = timed(step, device, warmup=args.warmup, iters=args.iters,
                 on_iter=lambda i, s: log(f"timed prefill {i + 1}/{args.iters}: {s:.3f}s (rank 0)"), events=False)
    peak, what = peak_bytes(device)
    out = box["out"]
    lat = median(secs)
    if args.save_kv:
        _save_kv(args.save_kv, out, rank, world, args.layout, S)
    if rank == 0:
        top = torch.topk(out.logits, min(args.top, out.logits.shape[-1]), dim=-1)
        print(f"first-token latency: {lat:.3f} s (median of {len(secs)}: {', '.join(f'{s:.3f}' for s in secs)}), "
              f"{B * S / lat:,.0f} prompt tokens/s, peak memory per rank {peak / 2**30:.2f} GiB ({what})")
        for b in range(B):
            print(f"next token (prompt {b}): top-{top.indices.shape[-1]} ids {top.indices[b].tolist()} "
                  f"logits {[round(x, 3) for x in top.values[b].tolist()]}")
        if args.save_logits:
            torch.save(out.logits.cpu(), args.save_logits)
            print(f"wrote {args.save_logits}")
        if args.save_kv:
            print(f"wrote {world} KV shard(s) to {args.save_kv}/kv_rank<r>.safetensors")
        if args.record:
            path = write_record(args.record, dict(kind="prefill", model=args.model, impl=args.impl, world=world,
                                                  layout=args.layout, batch=B, seq=S, dtype=str(dtype),
                                                  device=device.type, seconds=secs, latency_s=lat,
                                                  peak_bytes=peak, peak_kind=what))
            print(f"wrote {path}")
    return 0


def run(args) -> int:
    return run_command(run_rank, args, validate, "burstengine prefill")
