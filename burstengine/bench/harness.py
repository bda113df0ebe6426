"""What the benches that run on ranks share: their command skeleton, the FLOP count they report
TFLOP/s by, and the argument-check level timed training steps run under.

A ranked bench declares its arguments (``add_arguments(parser)``), what it refuses before any
rank starts (``validate(args)``: a one-line message, or None) and the body of one rank
(``run_rank(args)`` -> the rank's exit code; at module level, since spawned ranks import it);
:func:`ranked_bench` builds its ``build_parser()`` and ``main(argv)`` from them.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from .launch import run_command
from .usage import command_parser


def ranked_bench(name: str, doc: str, add_arguments, run_rank, validate=None, *, prepare=None, backend=None):
    """-> (build_parser, main) of `burstengine bench NAME`.

    ``main(argv)`` parses, runs ``prepare(args)`` (fills the device's defaults; an int it returns
    is an exit code that ends the command there, e.g. after a plot drawn from a record), then runs ``run_rank`` on
    torchrun's ranks or on spawned ones (:func:`.launch.run_command`: ``validate`` first, on every
    rank, so bad arguments exit 2 before any work).  ``backend(args)``: the process group's backend
    (default: NCCL with GPUs, else gloo)."""
    prog = f"burstengine bench {name}"

    def build_parser() -> argparse.ArgumentParser:
        p = command_parser(prog, doc)
        add_arguments(p)
        return p

    def main(argv=None) -> int:
        args = build_parser().parse_args(argv)
        code = prepare(args) if prepare else None
        if isinstance(code, int):
            return code
        return run_command(run_rank, args, validate or _accepted, prog, backend=backend(args) if backend else None)

    return build_parser, main


def _accepted(args) -> None:
    return None


def device_backend(args) -> str:
    """The backend of a bench with ``--device``: NCCL for cuda, gloo for cpu."""
    return "nccl" if args.device == "cuda" else "gloo"


class RankLog:
    """Progress lines said once, by rank ``rank`` 0: ``[tag   12.3s] msg``, the seconds since this
    log was made in the format ``clock`` (None: no clock), to ``file`` (default stdout)."""

    def __init__(self, tag: str, rank: int = 0, clock: str | None = "6.1f", file=None):
        self.tag, self.rank, self.clock, self.file = tag, rank, clock, file
        self.t0 = time.perf_counter()

    def __call__(self, msg: str) -> None:
        if self.rank != 0:
            return
        stamp = f" {time.perf_counter() - self.t0:{self.clock}}s" if self.clock else ""
        print(f"[{self.tag}{stamp}] {msg}", file=self.file or sys.stdout, flush=True)


# config keys a training bench sets itself for every case: one sequence per data-parallel rank
# group per step, timed step by step (a --set of them would be replaced without a word)
STEP_KEYS = ("batch_size", "grad_accum", "seq_len", "steps")


def step_overrides_refused(overrides, prog: str) -> str | None:
    """One line when ``overrides`` (--set KEY=VALUE) set a key the bench sets itself, else None."""
    keys = sorted({o.split("=", 1)[0].strip() for o in overrides} & set(STEP_KEYS))
    if keys:
        return (f"{prog} sets {', '.join(STEP_KEYS)} itself (one sequence per data-parallel group per timed "
                f"step; lengths from its own flags): --set {', '.join(keys)} is not taken; use burstengine train")
    return None


def attn_flops(B, S_q, S_k, H, D, visible_frac=1.0):
    """Forward FLOPs of attention over the visible (query, key) pairs: 4 * pairs * H * D; a causal
    square block counts half its pairs (docs/design.md, "FLOP conventions"), and fwd + bwd is 3.5x.
    costmodel.block_flops differs on purpose: it counts the causal diagonal exactly, S(S+1)/2
    pairs, for the model's per-block times."""
    return 4.0 * B * S_q * S_k * visible_frac * H * D


def step_check_level() -> str:
    """burst_attn_func's argument-check level for training: BURST_CHECKS when set, else "once".
    Every step repeats the first step's calls, so the agreement (a collective) and the NaN/inf scan
    (a host read, in every layer) run once per distinct call; a rank that diverges later is caught
    by the ring's deadline and the watchdog (docs/faults.md).  `burstengine train` runs under it,
    and so do the benchmarks that time training steps, so they time what it runs."""
    return os.environ.get("BURST_CHECKS") or "once"
