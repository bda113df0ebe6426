"""`burstengine train`: train a LLaMA-style model with FSDP2 + BurstAttention context parallelism.

    burstengine train --config tiny                          # CPU: spawns 2 gloo ranks (CP=2)
    burstengine train --config tiny --set steps=50 --set model.n_layers=2
    burstengine train --config my.toml --resume              # continue from the latest checkpoint
    torchrun --nproc_per_node 8 -m burstengine train --config llama-7b --set seq_len=524288

--config takes a preset (tiny, llama-7b, llama-8b, llama-14b) or a TOML file (see
burstengine/train/config.py).  Under torchrun the ranks are torchrun's (NCCL on GPUs); without
it, --world local processes are spawned.  Metrics go to <out_dir>/metrics.jsonl (one line per
step, eval lines, a final summary), checkpoints to <out_dir>/checkpoints.

A rank that dies or stops answering ends the job within ``fault_timeout`` seconds (default
$BURST_TIMEOUT, else 600; the ring's waits and the argument checks get the same deadline) on every rank, each naming the lost rank and exiting with 75; the
same command with --resume continues from the last complete checkpoint.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist

from ..attention.checks import arg_checks
from ..attention.planning import call_timeout, configured_timeout
from ..comm import fault
from ..launch import init_from_env, spawn, under_launcher
from ..records import write_record
from .checkpoint import latest
from .config import load
from .loop import Trainer
from .metrics import read_jsonl

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


HELP = "train a LLaMA-style model (FSDP2 + BurstAttention context parallelism)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="tiny", help="preset name or TOML file [%(default)s]")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config field (repeatable), e.g. --set steps=10 --set model.dim=256")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in <out_dir>")
    p.add_argument("--overwrite", action="store_true", help="start again even if <out_dir> holds a run")
    p.add_argument("--world", type=int, default=None,
                   help="ranks to spawn without torchrun (default: the config's cp, or 1)")
    p.add_argument("--timeout", type=float, default=86400.0,
                   help="seconds before spawned ranks are stopped [%(default)s]; the deadline for a lost rank is "
                        "the config's fault_timeout")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML-like lines and exit")
    p.add_argument("--record", metavar="NAME", default=None,
                   help="after a successful run, write its summary and config as a JSON record "
                        "benchmarks/results/NAME.json (command, commit, versions)")


def _err(msg: str) -> int:
    print(f"burstengine train: error: {msg}", file=sys.stderr)
    return 2


def run_rank(cfg, resume: bool, overwrite: bool) -> int:
    """The job on this rank of an initialised default group, under a watchdog: a rank that
    dies or stops answering ends the job on every rank within ``fault_timeout`` with a message
    naming it and exit code 75 (``fault.EXIT_LOST``), and the run can go on with --resume."""
    timeout = fault.job_timeout(cfg.fault_timeout, configured_timeout())
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = None
    try:
        # the ring's waits and the argument checks: the same deadline as the watchdog's.  Checks at
        # level "once" unless BURST_CHECKS says otherwise: every step repeats the first step's
        # calls, so the agreement (a collective and a host read per layer) runs once per
        # distinct call; a rank that diverges later is caught by the ring's deadline and the
        # watchdog (docs/faults.md)
        level = os.environ.get("BURST_CHECKS") or "once"
        with fault.Watchdog(timeout) as dog, call_timeout(timeout), arg_checks(level):
            try:
                trainer = Trainer(cfg, kill_in_step=_kill_in_step(rank), kill_in_save=_kill_in_save())
                trainer.fit(resume=resume, overwrite=overwrite)
            except ValueError as e:
                # config/world mismatches are found on every rank alike, before any collective
                if rank == 0:
                    print(f"burstengine train: error: {e}", file=sys.stderr)
                return 2
            except Exception as e:
                lost = dog.explain(e, trainer.activity if trainer is not None else "start-up")
                if lost is None:
                    raise  # this rank's own failure: leaving the watchdog posts it for the others
                raise lost from e
    except fault.RankLost as e:
        print(f"burstengine train (rank {rank}): {e}", file=sys.stderr, flush=True)
        # one survivor says how to go on
        if rank == min(r for r in range(world) if r != e.lost):
            _resume_hint(cfg)
        return fault.EXIT_LOST
    return 0


def _resume_hint(cfg) -> None:
    found = latest(os.path.join(cfg.run_dir, "checkpoints"))
    if found:
        print(f"burstengine train: the last complete checkpoint is {found}; run the same command with --resume "
              f"to continue from it", file=sys.stderr, flush=True)
    else:
        print("burstengine train: no checkpoint was completed (set ckpt_every to save some); a rerun starts "
              "from step 0", file=sys.stderr, flush=True)


def run(args) -> int:
    try:
        cfg = load(args.config, args.overrides)
    except ValueError as e:
        return _err(str(e))
    if args.print_config:
        for k, v in cfg.to_dict().items():
            if isinstance(v, dict):
                print(f"[{k}]")
                for k2, v2 in v.items():
                    print(f"  {k2} = {v2!r}")
            else:
                print(f"{k} = {v!r}")
        return 0
    timeout = fault.job_timeout(cfg.fault_timeout, configured_timeout())
    if under_launcher():
        own = init_from_env(timeout)
        try:
            code = run_rank(cfg, args.resume, args.overwrite)
            rank = dist.get_rank()
        finally:
            if own:
                dist.destroy_process_group()
        return _record(cfg, args.record, code) if rank == 0 else code
    world = args.world or cfg.cp or 1
    if world < 1:
        return _err(f"--world must be >= 1, got {world}")
    try:
        cfg.check_world(world)
    except ValueError as e:
        return _err(str(e))
    code = spawn(run_rank, (cfg, args.resume, args.overwrite), world, args.timeout, prog="burstengine train",
                 pg_timeout=timeout)
    if code not in (0, 2):
        _resume_hint(cfg)
    return _record(cfg, args.record, code)


def _record(cfg, name, code: int) -> int:
    if not name or code:
        return code
    recs = read_jsonl(os.path.join(cfg.run_dir, "metrics.jsonl"))
    summary = [r for r in recs if r.get("kind") == "summary"][-1]
    evals = [r for r in recs if r.get("kind") == "eval"]
    print("record:", write_record(name, {"summary": summary, "evals": evals, "config": cfg.to_dict()}))
    return 0
