"""The `burstengine` command: one subcommand per module of this package.

Each module in COMMANDS provides ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int`` (the exit code), and its docstring is the subcommand's description; adding a
subcommand is one more module and one more entry here.  The commands parse flags and print; what
they run is library code (train/, inference/, ...) or a bench (burstengine/bench/, where the
runtime the commands share lives too: launch, records, usage).  Nothing outside this package and
burstengine/bench/ imports them (tests/test_layering.py).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from .. import __version__
from ..bench.usage import HelpFormatter

COMMANDS = {
    "demo": "burstengine.cli.demo",
    "bench": "burstengine.cli.bench",
    "plan": "burstengine.cli.plan",
    "train": "burstengine.cli.train",
    "export": "burstengine.cli.export",
    "plot": "burstengine.cli.plot",
    "prefill": "burstengine.cli.prefill",
    "report": "burstengine.cli.report",
    "generate": "burstengine.cli.generate",
    "eval": "burstengine.cli.eval",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="burstengine",
                                description="BurstEngine: exact sequence-parallel attention (BurstAttention) and long-context training.")
    p.add_argument("--version", action="version", version=f"burstengine {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, modname in COMMANDS.items():
        mod = importlib.import_module(modname)
        sp = sub.add_parser(name, help=mod.HELP, description=mod.__doc__, formatter_class=HelpFormatter)
        mod.add_arguments(sp)
        sp.set_defaults(_run=mod.run)
    return p


# CUDA's caching allocator, unless the user configured it: expandable segments.  At long
# sequences the fixed-size segments fragment: 3B at 256K tokens on one H200 ran out of memory
# with them and trains in 124 GiB without (benchmarks/results/train_llama-3b_1xh200_256k*.json).
# Set before any CUDA allocation, which no command makes before its arguments are parsed.
ALLOC_CONF = "expandable_segments:True"


def main(argv=None) -> int:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)
    args = build_parser().parse_args(argv)
    try:
        return args._run(args)
    except KeyboardInterrupt:  # Ctrl-C in a command that has nothing more to say about it
        print(f"burstengine {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
