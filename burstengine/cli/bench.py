"""`burstengine bench <name>`: the benchmarks, one module each (run them under torchrun).

The registry is burstengine.bench.BENCHES; every module there provides ``main(argv)``.  This
command hands the rest of its command line to the module, so `burstengine bench attention
--help` shows that benchmark's own options.
"""
from __future__ import annotations

import argparse
import importlib

from ..bench import BENCHES

HELP = "run a benchmark (under torchrun on GPUs): " + ", ".join(BENCHES)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("bench", choices=sorted(BENCHES), help="which benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own arguments (see --help after its name)")


def run(args) -> int:
    mod = importlib.import_module(BENCHES[args.bench])
    return mod.main(args.rest) or 0
