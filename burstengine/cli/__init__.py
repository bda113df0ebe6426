"""The `burstengine` command: one subcommand per module.

Each module in COMMANDS provides ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int`` (the exit code); adding a subcommand is one more entry here.
"""
from __future__ import annotations

import argparse
import importlib
import os

from . import __version__

COMMANDS = {
    "demo": "burstengine.demo",
    "bench": "burstengine.bench.command",
    "plan": "burstengine.plan",
    "train": "burstengine.train.cli",
    "export": "burstengine.train.export",
    "plot": "burstengine.train.plot",
    "prefill": "burstengine.inference.cli",
    "report": "burstengine.report",
    "generate": "burstengine.inference.generate_cli",
    "eval": "burstengine.inference.eval_cli",
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="burstengine",
                                description="BurstEngine: exact sequence-parallel attention (BurstAttention) and long-context training.")
    p.add_argument("--version", action="version", version=f"burstengine {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, modname in COMMANDS.items():
        mod = importlib.import_module(modname)
        sp = sub.add_parser(name, help=mod.HELP, description=mod.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
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
    return args._run(args)


if __name__ == "__main__":
    raise SystemExit(main())
