"""`burstengine generate`: prefill prompts across ranks, then decode against the sharded KV cache.

    burstengine generate --model DIR --prompt-file question.txt --max-new-tokens 64 --world 2   # CPU: 2 gloo ranks
    torchrun --nproc_per_node 8 -m burstengine generate --model DIR --prompt-file book.txt --max-new-tokens 256
    burstengine generate --model DIR --prompt-tokens prompts.npy --max-new-tokens 32 --output out.json \\
        --temperature 0.7 --top-p 0.9 --seed 1

    burstengine generate --model DIR --prompt "Once upon a time" --max-new-tokens 32 --world 1

--prompt: text given on the command line, --prompt-file: text in files, both tokenized with
the model directory's tokenizer (one prompt each).  --prompt-tokens: a .npy of token ids, 1-D
(one prompt) or 2-D (one prompt per row), or an object array of 1-D arrays (prompts of
different lengths).  A prompt longer than the model's context (max_position_embeddings,
stretched by its RoPE scaling) is refused unless --allow-longer.  Greedy by default;
--temperature > 0 samples (with --top-k / --top-p), the same tokens for a --seed whatever the
number of ranks.  Decoding stops at --max-new-tokens or the tokenizer's EOS (--eos to name
others, --eos none to never stop early).  Rank 0 streams the text (the ids without a tokenizer)
and --output writes {"tokens": [[...], ...], "timings": {...}}.

With more than one rank the decode step is tensor-parallel (--tp auto, where the model's heads,
kv heads, ffn width and vocabulary divide over the ranks): each rank loads only its slice of the
projections and reads 1/W of the weights per token; the prefill gathers each layer's weights as
it runs.  --tp off keeps the whole model on every rank.  On GPUs the decode step is replayed
from a CUDA graph (--graphs auto), its collectives included.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from ..bench.launch import run_command
from ..bench.usage import add_allow_longer
from ..inference.generate import check_generate, generate
from ..inference.kvcache import KV_CACHES
from ..inference.context import context_error
from ..inference.models import check_model_files, check_spec, load_model, resolve_dtype, spec_args
from ..inference.sampling import Sampling
from ..inference.step import MODES as GRAPH_MODES
from ..layout import LAYOUTS
from ..model import PRESETS
from ..model.hf_dir import read_config
from ..model.layers import CHUNK
from ..model.tensor_parallel import refuses

TP_MODES = {"auto": "auto", "on": True, "off": False}  # --tp -> generate(tensor_parallel=...)
HELP = "generate text: prefill across ranks, then decode against a KV cache that stays sharded over them"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help=f"a local HF Llama / Mistral / Qwen2 directory, or a preset ({', '.join(PRESETS)}; random "
                        f"weights, token ids only)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", nargs="+", default=None, help="prompt text(s), one prompt each")
    src.add_argument("--prompt-file", nargs="+", default=None, help="text file(s), one prompt each")
    src.add_argument("--prompt-tokens", default=None, help="a .npy of token ids (see above)")
    p.add_argument("--max-new-tokens", type=int, required=True, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy [%(default)s]")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely (0: off) [%(default)s]")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1: off) [%(default)s]")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (and a preset's random weights) [%(default)s]")
    p.add_argument("--eos", default="auto",
                   help="stop token ids, comma-separated; auto: the tokenizer's / config's; none [%(default)s]")
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag", help="sequence layout of the prefill [%(default)s]")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                   help="weights and activations (auto: bf16 on GPUs, fp32 on CPU) [%(default)s]")
    p.add_argument("--kernel", default=None, help="local attention kernel of the prefill (default: auto)")
    p.add_argument("--chunk", type=int, default=None,
                   help=f"prefill the token-wise parts this many tokens (per sequence) at a time (0: the whole shard "
                        f"at once) [{CHUNK} tokens over the batch when a rank's shard holds more, else whole]")
    p.add_argument("--graphs", choices=GRAPH_MODES, default="auto",
                   help="replay the decode step from a CUDA graph (auto: on CUDA, any number of ranks; on: an error "
                        "elsewhere; off: launch its kernels each step) [%(default)s]")
    p.add_argument("--tp", choices=tuple(TP_MODES), default="auto",
                   help="tensor-parallel decoding over the ranks, each loading only its slice of the weights (auto: "
                        "where the model's shapes divide; on: an error where they do not; off: the whole model on "
                        "every rank) [%(default)s]")
    p.add_argument("--kv-cache", choices=tuple(KV_CACHES), default="model",
                   help="the KV cache's dtype: the model's, or fp8 (e4m3 with a scale per slot and kv head: about half "
                        "the bytes a long-context decode step reads, for FP8's rounding) [%(default)s]")
    add_allow_longer(p)
    p.add_argument("--output", default=None, help="rank 0 writes the tokens and timings here (JSON)")
    p.add_argument("--quiet", action="store_true", help="do not stream the text")
    p.add_argument("--world", type=int, default=2, help="ranks to spawn without torchrun [%(default)s]")
    p.add_argument("--threads", type=int, default=None, help="torch threads per spawned CPU rank")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before the ranks are stopped [%(default)s]")


def has_tokenizer(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f))
                                       for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))


def validate(args) -> str | None:
    msg = check_spec(args.model, "ours") or check_model_files(args.model, "ours")
    if msg:
        return msg
    if args.world < 1:
        return f"--world must be >= 1, got {args.world}"
    if not dist.is_initialized() and torch.cuda.is_available() and args.world > torch.cuda.device_count():
        return f"--world {args.world} is more than the {torch.cuda.device_count()} GPU(s) here (one rank per GPU)"
    if args.max_new_tokens < 1:
        return f"--max-new-tokens must be >= 1, got {args.max_new_tokens}"
    if args.chunk is not None and args.chunk < 0:
        return f"--chunk must be >= 0, got {args.chunk}"
    if args.graphs == "on" and not torch.cuda.is_available():
        return "--graphs on needs a CUDA device (use --graphs auto or off)"
    text = "--prompt" if args.prompt else "--prompt-file" if args.prompt_file else None
    for f in args.prompt_file or ():
        if not os.path.isfile(f):
            return f"--prompt-file {f!r} does not exist"
    if text and not has_tokenizer(args.model):
        return f"{text} needs a tokenizer, and {args.model!r} has none (give --prompt-tokens FILE.npy)"
    if args.prompt_tokens and not os.path.isfile(args.prompt_tokens):
        return f"--prompt-tokens {args.prompt_tokens!r} does not exist"
    try:
        eos = _eos_arg(args.eos)
        tok = hf_tokenizer(args.model) if has_tokenizer(args.model) and (text or eos == "auto") else None
        prompts = read_prompts(args, tok)
        margs = spec_args(args.model)
    except ValueError as e:
        return str(e)
    # what the ranks need of the tokenizer, resolved once here: spawned ranks get it with ``args``
    # (loading a tokenizer costs each rank seconds; only rank 0 loads one again, to print text)
    args.prompt_ids, args.stop_ids = prompts, _stop_ids(args, tok)
    bad = [t for t in (eos if isinstance(eos, tuple) else ()) if not 0 <= t < margs.vocab_size]
    if bad:
        return f"--eos {bad[0]} is not a token id of the model's vocabulary (0 to {margs.vocab_size - 1})"
    if not args.allow_longer:
        msg = next(filter(None, (context_error(margs, len(p), f"prompt {i}") for i, p in enumerate(prompts))), None)
        if msg:
            return msg
    s = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    msg = check_generate(prompts, margs.vocab_size, args.max_new_tokens, s)
    return msg.replace("max_new_tokens", "--max-new-tokens").replace("temperature", "--temperature") if msg else None


def _eos_arg(text: str):
    if text in ("auto", "none"):
        return text
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--eos must be auto, none or comma-separated token ids, got {text!r}") from None


def read_prompts(args, tok) -> list[list[int]]:
    """The prompts as token id lists (text through the tokenizer ``tok``)."""
    if args.prompt or args.prompt_file:
        texts = args.prompt or [open(f).read() for f in args.prompt_file]
        return [tok(t).input_ids for t in texts]
    import numpy as np

    try:
        a = np.load(args.prompt_tokens, allow_pickle=True)
    except Exception as e:
        raise ValueError(f"--prompt-tokens {args.prompt_tokens!r} is not a .npy file: {e}") from None
    rows = list(a) if a.dtype == object or a.ndim == 2 else [a]
    out = []
    for i, r in enumerate(rows):
        r = np.asarray(r)
        if r.ndim != 1 or not np.issubdtype(r.dtype, np.integer):
            raise ValueError(f"--prompt-tokens {args.prompt_tokens!r}: prompt {i} is not a 1-D array of integer ids "
                             f"({r.dtype}, shape {r.shape})")
        out.append([int(t) for t in r])
    return out


def hf_tokenizer(path: str):
    from transformers import AutoTokenizer  # optional dependency (the hf extra): only with a tokenizer

    return AutoTokenizer.from_pretrained(path)


def _stop_ids(args, tok) -> tuple[int, ...]:
    e = _eos_arg(args.eos)
    if e == "none":
        return ()
    if e != "auto":
        return e
    ids = set()
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    if os.path.isdir(args.model):

        cfg_eos = read_config(args.model).get("eos_token_id")
        ids.update([cfg_eos] if isinstance(cfg_eos, int) else (cfg_eos or []))
    return tuple(sorted(ids))


def rank_model(args, tp_group=None, tokenizer: bool = True):
    """This rank's device, dtype (--dtype), model (--model, --seed; only this rank's
    tensor-parallel slices over ``tp_group`` when given) and the model directory's tokenizer
    (None without one, or when not asked for: loading it costs seconds)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    dtype = resolve_dtype(args.dtype, device)
    model = load_model(args.model, "ours", device, dtype, args.seed, tp_group=tp_group)
    return device, dtype, model, hf_tokenizer(args.model) if tokenizer and has_tokenizer(args.model) else None


def run_rank(args) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    # tensor-parallel decoding: each rank loads only its slices (--tp on where they do not divide:
    # the whole model, and generate says why it cannot split it)
    split = args.tp != "off" and world > 1 and refuses(spec_args(args.model), world) is None
    # the text is printed by rank 0 only: the other ranks load no tokenizer
    device, dtype, model, tok = rank_model(args, dist.group.WORLD if split else None,
                                           tokenizer=rank == 0 and not args.quiet)
    prompts = args.prompt_ids
    s = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                 eos=args.stop_ids)
    if rank == 0:
        print(f"[generate] {model.describe}; {len(prompts)} prompt(s) of {[len(p) for p in prompts]} tokens on "
              f"{world} rank(s), {device.type}, {dtype}", file=sys.stderr, flush=True)
    streamed, finished = [[] for _ in prompts], [False] * len(prompts)
    stream = rank == 0 and not args.quiet and len(prompts) == 1 and tok is not None

    def on_tokens(step, toks, done):
        # one prompt with a tokenizer: its text as it comes (decoded whole, printed as a diff,
        # since a token's text can depend on its neighbours)
        if not stream or finished[0]:
            return
        prev = tok.decode(streamed[0], skip_special_tokens=True)
        streamed[0].append(toks[0])
        finished[0] = done[0]
        now = tok.decode(streamed[0], skip_special_tokens=True)
        sys.stdout.write(now[len(prev):] if now.startswith(prev) else "\n" + now)
        sys.stdout.flush()

    out = generate(model, prompts, args.max_new_tokens, s, layout=args.layout, kernel=args.kernel,
                   chunk=args.chunk, graphs=args.graphs, tensor_parallel=TP_MODES[args.tp], on_tokens=on_tokens,
                   kv_dtype=KV_CACHES[args.kv_cache])
    if rank == 0:
        if stream:
            print()
        elif not args.quiet:
            for b, t in enumerate(out.tokens):
                text = tok.decode(t, skip_special_tokens=True) if tok is not None else " ".join(map(str, t))
                print(f"[{b}] {text}")
        steps = out.timings["decode_step_s"]
        per = sum(steps) / len(steps) if steps else float("nan")
        how = "replayed from a CUDA graph" if out.timings["graphs"] else "op by op"
        if out.timings["tensor_parallel"]:
            how += f", tensor-parallel over {world} ranks"
        if out.timings["kv_dtype"] == "fp8":
            how += ", an FP8 KV cache"
        print(f"[generate] first-token latency {out.timings['prefill_s']:.3f}s; {len(steps)} decode step(s), "
              f"{per * 1e3:.1f} ms/token ({how}); cache slots per rank {out.shard_lengths[-1]}", file=sys.stderr)
        if args.output:
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
            with open(args.output, "w") as f:
                json.dump({"tokens": out.tokens, "timings": out.timings, "shard_lengths": out.shard_lengths[-1],
                           "model": args.model, "world": world, "kv_cache": args.kv_cache,
                           "sampling": vars(s) | {"eos": list(s.eos)},
                           "date": time.strftime("%Y-%m-%dT%H:%M:%S")}, f, indent=1)
            print(f"[generate] wrote {args.output}", file=sys.stderr)
    return 0


def run(args) -> int:
    return run_command(run_rank, args, validate, "burstengine generate")
