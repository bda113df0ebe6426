"""`burstengine bench <name>`: the benchmarks, one module each (run them under torchrun).

Each module in BENCHES provides ``main(argv)`` (most also ``build_parser(parser)``); this command
hands the rest of its command line to the module, so `burstengine bench attention --help`
shows that benchmark's own options.
"""
from __future__ import annotations

import argparse
import importlib

BENCHES = {
    "attention": "burstengine.bench.attention",
    "sparse": "burstengine.bench.sparse",
    "prefill": "burstengine.bench.prefill",
    "train": "burstengine.bench.train",
    "topo": "burstengine.bench.topo",
    "soak": "burstengine.bench.soak",
    "profile": "burstengine.bench.profile",
    "finetune": "burstengine.bench.finetune",
    "decode": "burstengine.bench.decode",
    "faults": "burstengine.bench.faults",
    # checks and one-off measurements (one JSON record each)
    "gpu-correctness": "burstengine.bench.gpu_correctness",
    "lao-bench": "burstengine.bench.lao_bench",
    "lao-check": "burstengine.bench.lao_check",
    "cpu-kernels": "burstengine.bench.cpu_kernels",
    "lce": "burstengine.bench.lce",
    "longest": "burstengine.bench.longest",
    "seqckpt-memory": "burstengine.bench.seqckpt_memory",
    "check-cost": "burstengine.bench.check_cost",
    "delta-error": "burstengine.bench.delta_error",
    "fault-times": "burstengine.bench.fault_times",
    "probe-speed": "burstengine.bench.probe_speed",
}
HELP = "run a benchmark (under torchrun on GPUs): " + ", ".join(BENCHES)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bench", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own arguments (see --help after its name)")


def run(args) -> int:
    mod = importlib.import_module(BENCHES[args.bench])
    return mod.main(args.rest) or 0
