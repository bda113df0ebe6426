"""`burstengine eval`: long-context evaluations of a model, over the ranks.

    burstengine eval needle --model DIR --lengths 4K,8K,16K --depths 0,0.25,0.5,0.75,1 --world 2
    burstengine eval needle --model runs/tiny-hf --format passkey --lengths 256,512   # a model trained on passkey
    burstengine eval perplexity --model DIR --data book.txt --lengths 4K,8K,16K --world 2
    torchrun --nproc_per_node 8 -m burstengine eval perplexity --model DIR --data pg19.txt --lengths 32K,128K,512K

needle: for every context length and needle depth, --samples prompts (different passkeys) are
built (burstengine/inference/needle.py says how; --format passkey: the built-in training task's
format, for a model trained on it), prefilled across the ranks and decoded greedily against the
sharded KV cache; a cell's accuracy is the fraction answered exactly.  Writes needle.json (a
record: command, commit, environment, every answer) and needle.png (the heatmap: length x depth,
accuracy as colour); the prompts of one length run as one batch (--batch at most at a time).

perplexity: the --data stream (a text file, tokenized with the model directory's tokenizer, or
token ids in a .npy / .bin) cut into windows of each length, every window prefilled across the
ranks and its loss summed there (burstengine/inference/perplexity.py).  Non-overlapping windows
by default (--stride = the length): every token is scored once, at the cost of one prefill per
window, so the longest lengths stay affordable; --stride 256 gives the sliding windows of the
context-extension papers (every token scored with at least length - 256 tokens before it, at
length / 256 times the cost).  Writes perplexity.json and perplexity.png (perplexity vs length).

Both write into --out-dir (default ./burst-results/<task>, or $BURST_RESULTS/<task>), under a
numbered name when one exists (needle-2.json and needle-2.png, ...): a run never replaces
another's files.  The figure needs matplotlib (pip install 'burstengine[plot]'); without it the
record is still written.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from ..bench.harness import RankLog
from ..bench.launch import run_command
from ..bench.records import results_dir, write_record
from ..bench.usage import HelpFormatter, add_allow_longer
from ..inference.context import check_context
from ..inference.generate import generate
from ..inference.models import check_model_files, check_spec, spec_args
from ..inference.needle import FORMATS, correct, heatmap, parse_depths, parse_lengths, passkey_case, text_case, \
    token_case
from ..inference.perplexity import curve, perplexity, windows
from ..layout import LAYOUTS
from .generate import has_tokenizer, hf_tokenizer, rank_model

HELP = "evaluate long-context use: needle in a haystack (lengths x depths) or perplexity vs context length"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="task", metavar="TASK", required=True)
    needle = sub.add_parser("needle", formatter_class=HelpFormatter, help="retrieval of a passkey at lengths x depths")
    _common(needle)
    needle.add_argument("--depths", default="0,0.25,0.5,0.75,1",
                        help="needle depths, each from 0 (the start) to 1 (the end)")
    needle.add_argument("--samples", type=int, default=1, help="prompts (passkeys) per cell")
    needle.add_argument("--batch", type=int, default=16, help="prompts per generate call")
    needle.add_argument("--format", choices=FORMATS, default="auto",
                        help="text: a sentence haystack (needs the model's tokenizer); tokens: random ids; passkey: "
                             "the format of `burstengine train`'s passkey task (data = \"passkey\"); auto: text with a "
                             "tokenizer, else tokens [auto]")
    needle.add_argument("--passkey-len", type=int, default=4, help="--format passkey: the training config's passkey_len")
    needle.add_argument("--passkey-symbols", type=int, default=16,
                        help="--format passkey: the training config's passkey_symbols")
    needle.add_argument("--passkey-seed", type=int, default=0,
                        help="--format passkey: the training config's seed (it draws the filler sentence)")
    ppl = sub.add_parser("perplexity", formatter_class=HelpFormatter, help="perplexity vs context length of a text")
    _common(ppl)
    ppl.add_argument("--data", required=True,
                     help="a text file (tokenized with the model directory's tokenizer), or token ids: a 1-D .npy, "
                          "or a .bin as burstengine train reads (--token-dtype)")
    ppl.add_argument("--token-dtype", default="uint16", choices=("uint16", "uint32"), help="of a .bin file")
    ppl.add_argument("--stride", type=int, default=None,
                     help="tokens between window starts; later windows score only their last --stride predictions "
                          "[= each length: non-overlapping windows]")
    ppl.add_argument("--max-windows", type=int, default=None, help="windows per length at most [all that fit]")
    ppl.add_argument("--batch", type=int, default=1, help="windows per prefill")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="a local HF Llama / Mistral / Qwen2 directory, or a preset")
    p.add_argument("--lengths", default="1K,2K,4K", help="context lengths, e.g. 4K,8K,1M")
    add_allow_longer(p)
    p.add_argument("--seed", type=int, default=0, help="needle: its passkeys and filler; both: a preset's random weights")
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag", help="sequence layout of the prefill")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                   help="weights and activations (auto: bf16 on GPUs, fp32 on CPU) [auto]")
    p.add_argument("--chunk", type=int, default=None, help="prefill token-wise work in chunks of this many tokens")
    p.add_argument("--out-dir", "--out", dest="out_dir", default=None,
                   help="folder of the record and the figure [$BURST_RESULTS/<task> or ./burst-results/<task>]")
    p.add_argument("--world", type=int, default=2, help="ranks to spawn without torchrun")
    p.add_argument("--threads", type=int, default=None, help="torch threads per spawned CPU rank [cores / world]")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are stopped")


def out_dir(args) -> str:
    return args.out_dir or os.path.join(results_dir(), args.task)


def validate(args) -> str | None:
    msg = check_spec(args.model, "ours") or check_model_files(args.model, "ours")
    if msg:
        return msg
    try:
        lengths = parse_lengths(args.lengths)
        if args.task == "needle":
            parse_depths(args.depths)
    except ValueError as e:
        return str(e)
    for name in ("batch", "world") + (("samples", "passkey_len", "passkey_symbols") if args.task == "needle" else ()):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if args.chunk is not None and args.chunk < 1:
        return f"--chunk must be >= 1, got {args.chunk}"
    if not dist.is_initialized() and torch.cuda.is_available() and args.world > torch.cuda.device_count():
        return f"--world {args.world} is more than the {torch.cuda.device_count()} GPU(s) here (one rank per GPU)"
    if not args.allow_longer:
        msg = check_context(args.model, max(lengths), "the longest of --lengths")
        if msg:
            return msg
    return _validate_needle(args, lengths) if args.task == "needle" else _validate_perplexity(args, lengths)


def _validate_needle(args, lengths) -> str | None:
    if args.format == "text" and not has_tokenizer(args.model):
        return f"--format text needs a tokenizer, and {args.model!r} has none (use --format tokens or passkey)"
    if args.format == "passkey":
        vocab = spec_args(args.model).vocab_size
        need = 4 + args.passkey_symbols + 2  # what the training config asks of the vocabulary
        if vocab < need:
            return f"--format passkey with {args.passkey_symbols} symbols needs a vocabulary of {need} at least, " \
                   f"{args.model!r} has {vocab}"
        if min(lengths) < args.passkey_len + 5:
            return (f"--lengths: {min(lengths)} tokens cannot hold a passkey of {args.passkey_len} and its question "
                    f"({args.passkey_len + 5} at least)")
    elif min(lengths) < 32:
        return f"--lengths: {min(lengths)} tokens leaves no room for a haystack (32 at least)"
    else:
        try:  # the shortest prompt must hold the needle and the question (their length is the tokenizer's)
            if args.format == "text":
                text_case(hf_tokenizer(args.model), min(lengths), 0.0, 0, args.seed)
            else:
                token_case(spec_args(args.model).vocab_size, min(lengths), 0.0, 0, args.seed)
        except ValueError as e:
            return f"--lengths: {e}"
    return None


def _validate_perplexity(args, lengths) -> str | None:
    if not os.path.isfile(args.data):
        return f"--data {args.data!r} does not exist"
    if _data_kind(args.data) == "text" and not has_tokenizer(args.model):
        return f"--data {args.data!r} is text, and {args.model!r} has no tokenizer (give token ids: .npy or .bin)"
    if min(lengths) < 2:
        return f"--lengths: a window of {min(lengths)} token(s) predicts nothing (2 at least)"
    if args.stride is not None and not 1 <= args.stride <= min(lengths):
        return f"--stride must be in [1, {min(lengths)}] (the shortest of --lengths), got {args.stride}"
    if args.max_windows is not None and args.max_windows < 1:
        return f"--max-windows must be >= 1, got {args.max_windows}"
    try:
        tokens = read_tokens(args)
    except ValueError as e:
        return str(e)
    for n in lengths:
        try:
            windows(len(tokens), n, args.stride)
        except ValueError as e:
            return f"--data {args.data!r} at length {n}: {e}"
    vocab = spec_args(args.model).vocab_size
    if int(tokens.max()) >= vocab or int(tokens.min()) < 0:
        return f"--data {args.data!r} holds token ids outside the model's vocabulary of {vocab}"
    return None


def _data_kind(path: str) -> str:
    return {".npy": "npy", ".bin": "bin"}.get(os.path.splitext(path)[1].lower(), "text")


def read_tokens(args) -> torch.Tensor:
    """--data as a 1-D int64 tensor of token ids (the same on every rank)."""
    import numpy as np

    kind = _data_kind(args.data)
    if kind == "text":
        with open(args.data, encoding="utf-8", errors="replace") as f:
            ids = hf_tokenizer(args.model)(f.read()).input_ids
        return torch.tensor(ids, dtype=torch.int64)
    if kind == "bin":
        from ..train.data import load_bin  # the .bin reader of burstengine train

        return torch.from_numpy(np.asarray(load_bin(args.data, args.token_dtype), dtype=np.int64))
    try:
        a = np.load(args.data)
    except Exception as e:
        raise ValueError(f"--data {args.data!r} is not a .npy file: {e}") from None
    if a.ndim != 1 or not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"--data {args.data!r}: a 1-D array of integer ids is needed, got {a.dtype} of shape {a.shape}")
    return torch.from_numpy(a.astype(np.int64))


def _figure(draw, path: str) -> str:
    """Draw the figure at ``path`` when matplotlib is there; what to say about it."""
    if importlib.util.find_spec("matplotlib") is None:
        return "no figure: matplotlib is not installed (pip install 'burstengine[plot]')"
    draw(path)
    return f"wrote {path}"


def run_needle(args) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    _, dtype, model, tok = rank_model(args)
    fmt = args.format if args.format != "auto" else "text" if tok is not None else "tokens"
    tok = tok if fmt == "text" else None
    task = None
    if fmt == "passkey":
        from ..train.data import Passkey  # the training task whose format the prompts take

        task = Passkey(max(parse_lengths(args.lengths)), model.vocab_size, args.passkey_len, args.passkey_symbols,
                       args.passkey_seed)
    lengths, depths = parse_lengths(args.lengths), parse_depths(args.depths)
    log = RankLog("needle", rank, clock=None, file=sys.stderr)

    log(f"{model.describe}; {fmt} format; {len(lengths)} lengths x {len(depths)} depths x {args.samples} sample(s) "
        f"on {world} rank(s)")
    cells, answers = [], []
    for n in lengths:
        cases = [text_case(tok, n, d, s, args.seed) if fmt == "text" else
                 passkey_case(task, n, d, s, args.seed) if fmt == "passkey" else
                 token_case(model.vocab_size, n, d, s, args.seed)
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
        path = write_record("needle", dict(kind="needle", model=args.model, describe=model.describe, world=world,
                                           layout=args.layout, dtype=str(dtype), format=fmt, lengths=lengths,
                                           depths=depths, samples=args.samples, tokenizer=tok is not None,
                                           cells=cells, answers=answers), out_dir=out_dir(args), also=(".png",))
        title = f"needle in a haystack: {os.path.basename(str(args.model).rstrip('/'))}, {world} rank(s)"
        said = _figure(lambda png: heatmap(cells, lengths, depths, png, title), path[:-len(".json")] + ".png")
        mean = sum(c["accuracy"] for c in cells) / len(cells)
        print(f"needle: mean accuracy {mean:.3f} over {len(cells)} cells; wrote {path}; {said}")
    return 0


def run_perplexity(args) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    _, dtype, model, _ = rank_model(args, tokenizer=False)
    tokens = read_tokens(args)
    lengths = parse_lengths(args.lengths)
    log = RankLog("perplexity", rank, clock=None, file=sys.stderr)
    how = f"sliding windows, stride {args.stride}" if args.stride else "non-overlapping windows"
    log(f"{model.describe}; {args.data}: {len(tokens):,} tokens; {how}; {world} rank(s), {dtype}")
    results = []
    for n in lengths:
        t0 = time.perf_counter()
        r = perplexity(model, tokens, n, args.stride, args.batch, args.max_windows, layout=args.layout,
                       chunk=args.chunk)
        r["seconds"] = time.perf_counter() - t0
        results.append(r)
        log(f"length {n}: perplexity {r['ppl']:.4f} (loss {r['loss']:.4f} over {r['tokens']:,} tokens in "
            f"{r['windows']} window(s), {r['seconds']:.1f}s)")
    if rank == 0:
        path = write_record("perplexity", dict(kind="perplexity", model=args.model, describe=model.describe,
                                               data=args.data, data_tokens=len(tokens), windows=how,
                                               stride=args.stride, world=world, layout=args.layout, dtype=str(dtype),
                                               results=results), out_dir=out_dir(args), also=(".png",))
        title = f"perplexity: {os.path.basename(str(args.model).rstrip('/'))} on {os.path.basename(args.data)}, {how}"
        said = _figure(lambda png: curve(results, png, title), path[:-len(".json")] + ".png")
        best = min(results, key=lambda r: r["ppl"])
        points = ", ".join(f"{r['length']}: {r['ppl']:.3f}" for r in results)
        print(f"perplexity: {points} (lowest at {best['length']}); wrote {path}; {said}")
    return 0 if all(math.isfinite(r["ppl"]) for r in results) else 1


RUNS = {"needle": run_needle, "perplexity": run_perplexity}


def run_rank(args) -> int:
    return RUNS[args.task](args)


def run(args) -> int:
    return run_command(run_rank, args, validate, f"burstengine eval {args.task}")
