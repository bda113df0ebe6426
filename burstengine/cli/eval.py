"""`burstengine eval needle`: needle-in-a-haystack retrieval through our prefill + decode.

    burstengine eval needle --model DIR --lengths 4K,8K,16K --depths 0,0.25,0.5,0.75,1 --world 2
    torchrun --nproc_per_node 8 -m burstengine eval needle --model DIR --lengths 32K,128K,512K,1M \\
        --depths 0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1 --out benchmarks/results/needle

For every context length and needle depth, --samples prompts (different passkeys) are built
(burstengine/inference/needle.py says how), prefilled across the ranks and decoded greedily
against the sharded KV cache; a cell's accuracy is the fraction answered exactly.  Writes
OUT/needle.json (a record: command, commit, environment, every answer) and OUT/needle.png (the
heatmap: length x depth, accuracy as colour).  The prompts of one length run as one batch
(--batch at most at a time).
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
from ..inference.generate import generate
from ..inference.models import check_model_files, check_spec
from ..inference.needle import correct, heatmap, parse_depths, parse_lengths, text_case, token_case
from ..layout import LAYOUTS
from .generate import has_tokenizer, hf_tokenizer, model_args, rank_model

HELP = "evaluate long-context retrieval: needle in a haystack over lengths x depths (JSON record + heatmap)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("task", choices=("needle",), help="the evaluation")
    p.add_argument("--model", required=True, help="a local HF Llama / Mistral / Qwen2 directory, or a preset")
    p.add_argument("--lengths", default="1K,2K,4K", help="context lengths, e.g. 4K,8K,1M [%(default)s]")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths in [0, 1] [%(default)s]")
    p.add_argument("--samples", type=int, default=1, help="prompts (passkeys) per cell [%(default)s]")
    p.add_argument("--batch", type=int, default=16, help="prompts per generate call [%(default)s]")
    p.add_argument("--seed", type=int, default=0, help="passkeys and filler (and a preset's weights) [%(default)s]")
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag", help="sequence layout of the prefill [%(default)s]")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto", help="[%(default)s]")
    p.add_argument("--chunk", type=int, default=None, help="prefill token-wise work in chunks of this many tokens")
    p.add_argument("--out", default="benchmarks/results/needle", help="directory for needle.json/.png [%(default)s]")
    p.add_argument("--world", type=int, default=2, help="ranks to spawn without torchrun [%(default)s]")
    p.add_argument("--threads", type=int, default=None, help="torch threads per spawned CPU rank")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are stopped [%(default)s]")


def validate(args) -> str | None:
    msg = check_spec(args.model, "ours") or check_model_files(args.model, "ours")
    if msg:
        return msg
    try:
        lengths, _ = parse_lengths(args.lengths), parse_depths(args.depths)
    except ValueError as e:
        return str(e)
    for name in ("samples", "batch", "world"):
        if getattr(args, name) < 1:
            return f"--{name} must be >= 1, got {getattr(args, name)}"
    if min(lengths) < 32:
        return f"--lengths: {min(lengths)} tokens leaves no room for a haystack (32 at least)"
    try:  # the shortest prompt must hold the needle and the question (their length is the tokenizer's)
        tok = hf_tokenizer(args.model) if has_tokenizer(args.model) else None
        if tok:
            text_case(tok, min(lengths), 0.0, 0, args.seed)
        else:
            token_case(model_args(args.model).vocab_size, min(lengths), 0.0, 0, args.seed)
    except ValueError as e:
        return f"--lengths: {e}"
    if not dist.is_initialized() and torch.cuda.is_available() and args.world > torch.cuda.device_count():
        return f"--world {args.world} is more than the {torch.cuda.device_count()} GPU(s) here (one rank per GPU)"
    return None


def run_rank(args) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    _, dtype, model, tok = rank_model(args)
    lengths, depths = parse_lengths(args.lengths), parse_depths(args.depths)
    log = RankLog("needle", rank, clock=None, file=sys.stderr)

    log(f"{model.describe}; {'tokenizer passkey' if tok else 'random-token needle (no tokenizer)'}; "
        f"{len(lengths)} lengths x {len(depths)} depths x {args.samples} sample(s) on {world} rank(s)")
    cells, answers = [], []
    for n in lengths:
        cases = [text_case(tok, n, d, s, args.seed) if tok else token_case(model.vocab_size, n, d, s, args.seed)
                 for d in depths for s in range(args.samples)]
        t0 = time.perf_counter()
        for a in range(0, len(cases), args.batch):
            part = cases[a:a + args.batch]
            out = generate(model, [c.ids for c in part], max(c.new_tokens for c in part), layout=args.layout,
                           chunk=args.chunk)
            for c, new in zip(part, out.tokens):
                ok, said = correct(c, new, tok)
                answers.append(dict(length=n, depth=c.depth, sample=c.sample, expected=c.answer, answer=said,
                                    correct=ok))
        secs = time.perf_counter() - t0
        for d in depths:
            mine = [x for x in answers if x["length"] == n and x["depth"] == d]
            cells.append(dict(length=n, depth=d, accuracy=sum(x["correct"] for x in mine) / len(mine)))
        log(f"length {n}: accuracy {sum(c['accuracy'] for c in cells[-len(depths):]) / len(depths):.2f} "
            f"({secs:.1f}s)")
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        path = write_record("needle", dict(kind="needle", model=args.model, describe=model.describe, world=world,
                                           layout=args.layout, dtype=str(dtype), lengths=lengths, depths=depths,
                                           samples=args.samples, tokenizer=tok is not None, cells=cells,
                                           answers=answers), out_dir=args.out)
        png = os.path.join(args.out, "needle.png")
        heatmap(cells, lengths, depths, png, f"needle in a haystack: {os.path.basename(str(args.model).rstrip('/'))}, "
                                              f"{world} rank(s)")
        mean = sum(c["accuracy"] for c in cells) / len(cells)
        print(f"needle: mean accuracy {mean:.3f} over {len(cells)} cells; wrote {path} and {png}")
    return 0


def run(args) -> int:
    return run_command(run_rank, args, validate, f"burstengine eval {args.task}")
