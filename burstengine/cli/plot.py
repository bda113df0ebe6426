"""`burstengine plot`: loss, throughput and passkey accuracy of a run, from its metrics.jsonl, to PNG.

    burstengine plot runs/tiny/metrics.jsonl                 # writes runs/tiny/metrics.png

Needs matplotlib (pip install 'burstengine[plot]').
"""
from __future__ import annotations

import argparse
import os
import sys

from ..train.metrics import read_jsonl

HELP = "plot loss / throughput / passkey accuracy from a metrics.jsonl to PNG"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("metrics", help="a metrics.jsonl written by burstengine train")
    p.add_argument("-o", "--output", default=None, help="PNG path [next to the metrics file]")


def plot(records: list[dict], path: str, title: str = "") -> str:
    import matplotlib  # optional dependency: only for the plot

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional dependency: only for the plot

    steps = [r for r in records if r.get("kind") == "step"]
    evals = [r for r in records if r.get("kind") == "eval"]
    panels = 3 if evals else 2
    fig, ax = plt.subplots(1, panels, figsize=(5 * panels, 3.6))
    x = [r["step"] for r in steps]
    ax[0].plot(x, [r["loss"] for r in steps], lw=1)
    ax[0].set(xlabel="step", ylabel="loss", title="loss")
    ax[1].plot(x, [r["tokens_per_s_per_gpu"] for r in steps], lw=1)
    ax[1].set(xlabel="step", ylabel="tokens / s / GPU", title="throughput")
    if evals:
        ex = [r["step"] for r in evals]
        ax[2].plot(ex, [r["passkey_acc"] for r in evals], "o-", label="passkey (all tokens)")
        ax[2].plot(ex, [r["token_acc"] for r in evals], "s-", label="answer tokens")
        ax[2].axhline(evals[-1]["chance_token_acc"], ls=":", c="gray", label="token chance")
        ax[2].set(xlabel="step", ylabel="accuracy", title="held-out passkey", ylim=(0, 1.02))
        ax[2].legend(fontsize=8)
    for a in ax:
        a.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("burstengine plot: error: needs matplotlib (pip install 'burstengine[plot]')", file=sys.stderr)
        return 2
    if not os.path.exists(args.metrics):
        print(f"burstengine plot: error: {args.metrics!r} does not exist", file=sys.stderr)
        return 2
    try:
        recs = [r for r in read_jsonl(args.metrics) if isinstance(r, dict)]
    except (OSError, ValueError) as e:  # a folder, a binary file, a line that is not JSON
        print(f"burstengine plot: error: {args.metrics!r} is not a metrics.jsonl of burstengine train: "
              f"{str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    if not any(r.get("kind") == "step" for r in recs):
        print(f"burstengine plot: error: {args.metrics!r} holds no step records", file=sys.stderr)
        return 2
    out = args.output or os.path.splitext(args.metrics)[0] + ".png"
    print(plot(recs, out, title=os.path.dirname(os.path.abspath(args.metrics))))
    return 0
