"""`burstengine train`: train a LLaMA-style model with FSDP2 + BurstAttention context parallelism.

    burstengine train --config tiny                          # CPU: spawns 2 gloo ranks (CP=2)
    burstengine train --config tiny --set steps=50 --set model.n_layers=2
    burstengine train --config my.toml --resume              # continue from the latest checkpoint
    torchrun --nproc_per_node 8 -m burstengine train --config llama-7b --set seq_len=524288

--config takes a preset (tiny, llama-7b, llama-8b, llama-14b) or a TOML file (see
burstengine/train/config.py).  Under torchrun the ranks are torchrun's (NCCL on GPUs); without
it, --world local processes are spawned.  Metrics go to <out_dir>/metrics.jsonl (one line per
step, eval lines, a final summary; TensorBoard / W&B too when enabled), checkpoints to
<out_dir>/checkpoints.  Text data is tokenized once into a cache: here before the ranks are
spawned, under torchrun by rank 0 (``--prepare-data`` does it alone and exits).

A rank that dies or stops answering ends the job within ``fault_timeout`` seconds (default
$BURST_TIMEOUT, else 600; the ring's waits and the argument checks get the same deadline) on every rank, each naming the lost rank and exiting with 75; the
same command with --resume continues from the last complete checkpoint.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings

import torch.distributed as dist

from ..attention.checks import arg_checks
from ..attention.planning import configured_timeout
from ..bench.harness import step_check_level
from ..bench.launch import guarded, init_from_env, spawn, under_launcher
from ..bench.records import write_record
from ..bench.usage import kernel_error, missing_package
from ..comm import fault
from ..train import corpus
from ..train.checkpoint import latest
from ..train.config import help_epilog, load, to_toml
from ..train.loop import Trainer
from ..train.metrics import read_jsonl

# fault injection for the tests, read here (the CLI) and handed to the Trainer:
# "RANK:STEP" makes that rank SIGKILL itself in the middle of step STEP (1-based), after its
# forward, while the other ranks go on into the backward's ring and FSDP collectives
KILL_ENV = "BURST_FAULT_KILL_IN_STEP"
FAULT_ENV = "BURST_FAULT_KILL_IN_SAVE"  # STEP: SIGKILL rank 0 inside the save of this step


def _kill_in_step(rank: int) -> int | None:
    spec = os.environ.get(KILL_ENV, "")
    r, _, s = spec.partition(":")
    return int(s) if spec and int(r) == rank else None


def _kill_in_save() -> int | None:
    v = os.environ.get(FAULT_ENV)
    return int(v) if v else None


EXIT_INTERRUPTED = 130  # Ctrl-C, as a shell reports a process ended by SIGINT

HELP = "train a LLaMA-style model (FSDP2 + BurstAttention context parallelism)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = help_epilog()
    p.add_argument("--config", default="tiny", help="preset name or TOML file [%(default)s]")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config field (repeatable), e.g. --set steps=10 --set model.dim=256")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest saved checkpoint in <out_dir> (nothing to do when it is the last step)")
    p.add_argument("--overwrite", action="store_true", help="start again even if <out_dir> holds a run")
    p.add_argument("--world", type=int, default=None,
                   help="ranks to spawn without torchrun (default: the config's cp, or 1)")
    p.add_argument("--timeout", type=float, default=86400.0,
                   help="seconds before spawned ranks are stopped [%(default)s]; the deadline for a lost rank is "
                        "the config's fault_timeout")
    p.add_argument("--prepare-data", action="store_true",
                   help="tokenize the config's text data into its cache (one process) and exit: for corpora whose "
                        "tokenization would outlast fault_timeout while the other ranks of a torchrun job wait")
    p.add_argument("--memory-plan", action="store_true",
                   help="build the model on the ranks, say whether one step at the config's length fits the device "
                        "and what it needs (the line every run says before its first step), and exit")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config as TOML (what --config reads) and exit")
    p.add_argument("--record", metavar="NAME", default=None,
                   help="after a successful run, write its summary and config as a JSON record "
                        "NAME.json in $BURST_RESULTS or ./burst-results (command, commit, versions; a numbered name if that "
                        "exists)")


def _err(msg: str) -> int:
    print(f"burstengine train: error: {msg}", file=sys.stderr)
    return 2


def run_rank(cfg, resume: bool, overwrite: bool, timeout: float, memory_plan: bool = False) -> int:
    """The job on this rank of an initialised default group, under the commands' fault handling
    (bench/launch.py's guarded): a rank that dies or stops answering ends the job on every rank
    within ``timeout`` (``fault_timeout``) with a message naming it and exit code 75
    (``fault.EXIT_LOST``), and the run can go on with --resume; config/world mismatches, found
    on every rank alike before any collective, exit 2 said once.  ``memory_plan``: only say what
    a step would need (rank 0), without training."""
    rank = dist.get_rank()
    box = {}

    def body():
        # the argument checks at the training level: the first call of each kind agreed on
        with arg_checks(step_check_level()):
            box["trainer"] = Trainer(cfg, kill_in_step=_kill_in_step(rank), kill_in_save=_kill_in_save(),
                                     lock=not memory_plan)
            if memory_plan:
                line = box["trainer"].memory_line()
                if rank == 0:
                    print(line, flush=True)
                return 0
            box["trainer"].fit(resume=resume, overwrite=overwrite)
        return 0

    return guarded(body, "burstengine train", timeout,
                   activity=lambda: box["trainer"].activity if "trainer" in box else "start-up",
                   on_lost=lambda e: _resume_hint(cfg))


def _resume_hint(cfg, why: str = "") -> None:
    found = latest(os.path.join(cfg.run_dir, "checkpoints"))
    if found:
        print(f"burstengine train: {why}the last complete checkpoint is {found}; run the same command with --resume "
              f"to continue from it", file=sys.stderr, flush=True)
    else:
        hint = "" if cfg.save_every else " (set save_every to save some)"
        print(f"burstengine train: {why}no checkpoint was completed{hint}; a rerun starts from step 0",
              file=sys.stderr, flush=True)


def preflight(cfg, world: int | None = None) -> str | None:
    """What can be told before any rank starts: a one-line message, else None.  ``world``: the
    ranks to spawn (None under a launcher, where the group's size is checked by the ranks)."""
    import torch

    if world is not None:
        if world < 1:
            return f"--world must be >= 1, got {world}"
        try:
            cfg.check_world(world)
        except ValueError as e:
            return str(e)
    cuda = torch.cuda.is_available()
    if cfg.attention == "torch-cp" and not cuda:
        return ("attention='torch-cp' (torch's context_parallel) needs CUDA GPUs: torch has no CPU rule for it; "
                "on CPU use attention='burst'")
    # "auto" leaves the choice to BURST_KERNEL (train/parallel.py), which kernel_error reads for None
    msg = kernel_error(None if cfg.kernel == "auto" else cfg.kernel, "cuda" if cuda else "cpu", backward=True)
    if msg:
        return msg.replace("--kernel", "kernel")
    if cfg.data != "passkey" and not cfg.data.endswith(".bin"):  # text data: the tokenizer must load
        msg = missing_package("tokenizers", "text data")
        if msg:
            return msg
        try:
            corpus.load_tokenizer(corpus.tokenizer_path(cfg))
        except ValueError as e:
            return str(e)
    return None


def finished(cfg) -> tuple[str, int] | None:
    """(path, step) of the latest saved checkpoint when it is at or past ``cfg.steps`` (a
    --resume has nothing to do), else None."""
    import json
    import os


    found = latest(os.path.join(cfg.run_dir, "checkpoints"))
    if not found:
        return None
    try:
        with open(os.path.join(found, "meta.json")) as f:
            step = json.load(f)["step"]
    except (OSError, ValueError, KeyError):
        return None  # the ranks will say what is wrong with it
    return (found, step) if step >= cfg.steps else None


def run(args) -> int:
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", FutureWarning)
            cfg = load(args.config, args.overrides)
    except ValueError as e:
        return _err(str(e))
    if cfg.init:
        print(f"burstengine train: note: the model's shape comes from {cfg.init}/config.json (a preset's [model] "
              f"table is ignored)", file=sys.stderr)
    for w in caught:  # deprecated config names: one line each
        print(f"burstengine train: note: {w.message}", file=sys.stderr)
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    try:
        return _run(args, cfg)
    except KeyboardInterrupt:  # Ctrl-C: the spawned ranks were stopped quietly (bench/launch.py)
        if int(os.environ.get("RANK", "0")) == 0:
            _resume_hint(cfg, "interrupted; ")
        return EXIT_INTERRUPTED


def _run(args, cfg) -> int:
    if args.resume and not args.overwrite:
        done = finished(cfg)
        if done:
            print(f"burstengine train: nothing to do: the run is finished ({done[0]} is step {done[1]}, "
                  f"steps={cfg.steps}); raise steps (--set steps=N) to train on", file=sys.stderr)
            return 0
    if args.prepare_data or not under_launcher():
        # spawned ranks find the corpus tokenized: done here, once, before any rank waits on it
        code = _prepare_data(cfg, verbose=args.prepare_data)
        if code or args.prepare_data:
            return code
    try:
        timeout = fault.job_timeout(cfg.fault_timeout, configured_timeout())
    except ValueError as e:  # BURST_TIMEOUT
        return _err(str(e))
    if under_launcher():
        msg = preflight(cfg)
        if msg:
            if int(os.environ.get("RANK", "0")) == 0:
                _err(msg)
            return 2
        try:
            own = init_from_env(timeout)
        except fault.RankLost as e:
            print(f"burstengine train (rank {os.environ.get('RANK', '?')}): {e}", file=sys.stderr, flush=True)
            return fault.EXIT_LOST
        try:
            code = run_rank(cfg, args.resume, args.overwrite, timeout, args.memory_plan)
            rank = dist.get_rank()
        finally:
            if own:
                dist.destroy_process_group()
        return _record(cfg, args.record, code) if rank == 0 and not args.memory_plan else code
    world = args.world if args.world is not None else (cfg.cp or 1)
    msg = preflight(cfg, world)
    if msg:
        return _err(msg)
    code = spawn(run_rank, (cfg, args.resume, args.overwrite, timeout, args.memory_plan), world, args.timeout,
                 prog="burstengine train", pg_timeout=timeout)
    if code not in (0, 2):
        _resume_hint(cfg)
    return code if args.memory_plan else _record(cfg, args.record, code)


def _prepare_data(cfg, verbose: bool) -> int:
    if cfg.data == "passkey" or cfg.data.endswith(".bin"):
        if verbose:
            print(f"data {cfg.data!r} needs no tokenization")
        return 0
    import time


    t0 = time.perf_counter()
    try:
        sp = corpus.spec(cfg)
        fresh = not corpus.exists(sp)
        if fresh:
            print(f"tokenizing {len(sp.files)} file(s) of {cfg.data} into {sp.cache}", flush=True)
        c = corpus.open_cache(corpus.build(sp))
    except ValueError as e:
        return _err(str(e))
    if fresh or verbose:
        print(f"{cfg.data}: {c.meta['tokens']:,} tokens in {c.meta['documents']:,} documents "
              f"({'tokenized in %.1fs' % (time.perf_counter() - t0) if fresh else 'cached'}: {c.path})", flush=True)
    return 0


def _record(cfg, name, code: int) -> int:
    if not name or code:
        return code
    recs = read_jsonl(os.path.join(cfg.run_dir, "metrics.jsonl"))
    summary = [r for r in recs if r.get("kind") == "summary"][-1]
    evals = [r for r in recs if r.get("kind") == "eval"]
    print("record:", write_record(name, {"summary": summary, "evals": evals, "config": cfg.to_dict()}))
    return 0
