"""Soak: many tiny training steps, watching every rank's resident memory for growth.

    burstengine bench soak                          # CPU: 4 gloo ranks (dp 2 x cp 2), 1000 steps
    burstengine bench soak --steps 300 --world 2 --name ""   # shorter, no record

Runs the real loop (``Trainer.fit``: the step with FSDP2 and the BurstAttention ring, a metrics
line every step, an evaluation and a checkpoint every --every steps) on a tiny model and
reads each rank's resident set size (RSS, /proc/self/statm) after every step.  It reports, per
rank, the growth from step --from to the last step and the least-squares slope over that span,
and passes when every rank grew by at most --bound-mib.  The first --from steps are left out:
they fill the allocator's arenas, the optimizer state and the caches of FSDP, gloo and the
checkpoint planner, and include the first evaluation and save.  Writes a JSON record
(<name>.json in $BURST_RESULTS or ./burst-results, a numbered name if that exists) with every sample.

A leak of one small tensor per step (a kilobyte or two: the tiny model's activations, an
autograd graph kept alive, a list of per-step records) shows as 1-2 MiB over 900 steps, so
the default bound of 4 MiB per rank catches a leak of about 4.5 KiB per step and anything
bigger, while leaving room for the allocator's own drift (glibc keeps freed pages of its
arenas, and a new peak of fragmentation costs a page or two).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch.distributed as dist

from ...train import Trainer, load
from ..harness import ranked_bench
from ..records import write_record
from ..tables import Section, fixed, ms, num, table

SOAK_MODEL = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=64",
              "model.ffn_dim=48", "seq_len=32", "batch_size=2", "passkey_symbols=8", "passkey_len=3",
              "progress=false", "eval_every=0", "eval_samples=8", "log_every=1"]
MIB = 2**20


def rss_bytes() -> int:
    """This process's resident set size now (Linux)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        raise RuntimeError("the soak reads /proc/self/statm: Linux only") from None


def _slope(ys: list[int]) -> float:
    """Least-squares slope of ``ys`` against their index."""
    n = len(ys)
    xm, ym = (n - 1) / 2, sum(ys) / n
    sxx = sum((x - xm) ** 2 for x in range(n)) or 1.0
    return sum((x - xm) * (y - ym) for x, y in enumerate(ys)) / sxx


def growth(samples: list[int], start: int) -> dict:
    """Growth of one rank's RSS samples (one per step, bytes) from step ``start`` (1-based) to
    the last: the difference of the ends, the highest point, and the least-squares slope over
    the whole span and over its second half (a leak keeps its slope; warm-up flattens out)."""
    ys = samples[start - 1:]
    return {"from_step": start, "to_step": len(samples), "rss_from_mib": ys[0] / MIB, "rss_to_mib": ys[-1] / MIB,
            "growth_mib": (ys[-1] - ys[0]) / MIB, "max_above_from_mib": (max(ys) - ys[0]) / MIB,
            "slope_kib_per_step": _slope(ys) / 1024, "late_slope_kib_per_step": _slope(ys[len(ys) // 2:]) / 1024}


def soak_rank(group, steps: int, out_dir: str, extra=(), every: int = 0) -> list[int]:
    """Train ``steps`` tiny steps on the ranks of ``group`` in ``out_dir``, evaluating and saving
    a checkpoint every ``every`` steps (0: only the evaluation at the end); this rank's RSS after
    each step (and its evaluation and save), in bytes."""
    cfg = load("tiny", SOAK_MODEL + [f"steps={steps}", f"out_dir={out_dir}", f"save_every={every}",
                                     f"eval_every={every}", "save_keep=1", *extra])
    samples: list[int] = []
    trainer = Trainer(cfg, group=group, echo=False)
    trainer.fit(overwrite=True, on_step=lambda t: samples.append(rss_bytes()))
    return samples


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, default=1000, help="training steps [%(default)s]")
    p.add_argument("--from", dest="start", type=int, default=100,
                   help="measure growth from this step on (the ones before warm up) [%(default)s]")
    p.add_argument("--bound-mib", type=float, default=4.0, help="allowed growth per rank [%(default)s MiB]")
    p.add_argument("--every", type=int, default=100,
                   help="evaluate and save a checkpoint every K steps, 0 = evaluate at the end only [%(default)s]")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config overrides (default: a 2-layer, dim-32 model, 32 tokens, cp=2)")
    p.add_argument("--world", type=int, default=4, help="ranks to spawn without torchrun [%(default)s]")
    p.add_argument("--out-dir", default=None, help="run directory [a temporary one]")
    p.add_argument("--name", default="soak_cpu", help="record name; empty: no record [%(default)s]")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank [%(default)s]")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before spawned ranks are stopped")


def run_rank(args) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        print(f"soak: {args.steps} steps on {world} ranks, RSS growth from step {args.start} bounded by "
              f"{args.bound_mib:g} MiB per rank", flush=True)
    with tempfile.TemporaryDirectory(prefix="burst_soak_") as tmp:
        # every rank must write to the same run directory: rank 0 picks it
        box = [args.out_dir or tmp]
        dist.broadcast_object_list(box, src=0)
        t0 = time.perf_counter()
        mine = soak_rank(None, args.steps, box[0], ["cp=2" if world % 2 == 0 else "cp=0", *args.overrides],
                         args.every)
        wall = time.perf_counter() - t0
        every = [None] * world
        dist.all_gather_object(every, mine)
        dist.barrier()  # rank 0's temporary directory outlives every rank's use of it
    if rank != 0:
        return 0
    per_rank = [growth(s, args.start) for s in every]
    ok = all(g["growth_mib"] <= args.bound_mib for g in per_rank)
    print(f"{'rank':>4} {'RSS@' + str(args.start):>11} {'RSS@' + str(args.steps):>11} {'growth':>10} "
          f"{'max above':>10} {'slope':>14} {'late slope':>14}")
    for r, g in enumerate(per_rank):
        print(f"{r:>4} {g['rss_from_mib']:>7.1f} MiB {g['rss_to_mib']:>7.1f} MiB {g['growth_mib']:>+6.2f} MiB "
              f"{g['max_above_from_mib']:>+6.2f} MiB {g['slope_kib_per_step']:>+6.2f} KiB/step "
              f"{g['late_slope_kib_per_step']:>+6.2f} KiB/step")
    worst = max(g["growth_mib"] for g in per_rank)
    print(f"soak: {'PASS' if ok else 'FAIL'}: worst growth {worst:+.2f} MiB from step {args.start} to "
          f"{args.steps} (bound {args.bound_mib:g} MiB), {wall:.0f} s, {wall / args.steps * 1e3:.0f} ms/step", flush=True)
    if args.name:
        path = write_record(args.name, {
            "world": world, "steps": args.steps, "from_step": args.start, "bound_mib": args.bound_mib,
            "eval_and_ckpt_every": args.every, "overrides": SOAK_MODEL + args.overrides, "wall_s": wall, "pass": ok,
            "worst_growth_mib": worst, "per_rank": per_rank,
            "rss_bytes_per_step": every})
        print(f"record: {path}")
    return 0 if ok else 1


def validate(args) -> str | None:
    if not 1 <= args.start < args.steps:
        return f"--from must be in [1, --steps), got {args.start}"
    return None


build_parser, main = ranked_bench("soak", __doc__, add_arguments, run_rank, validate)

# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    head = [f"{rec['steps']} training steps on {rec['world']} ranks, evaluation and checkpoint every "
            f"{rec['eval_and_ckpt_every']} steps, {ms(rec['wall_s'] / rec['steps'])} ms per step; growth of resident "
            f"memory from step {rec['from_step']} against a bound of {num(rec['bound_mib'])} MiB per rank: "
            f"{'pass' if rec['pass'] else 'FAIL'}.", ""]
    body = [[i, p["from_step"], p["to_step"], fixed(p["rss_from_mib"], 1), fixed(p["rss_to_mib"], 1),
             fixed(p["growth_mib"], 2), fixed(p["slope_kib_per_step"], 2), fixed(p["late_slope_kib_per_step"], 3)]
            for i, p in enumerate(rec["per_rank"])]
    return head + table(["rank", "from step", "to step", "RSS from MiB", "RSS to MiB", "growth MiB",
                         "KiB/step", "KiB/step, last steps"], body)


SECTIONS = (Section("Soak", r"^soak", render,
                    "`burstengine bench soak`: resident memory over many tiny training steps."),)
