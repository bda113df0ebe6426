"""What a run reports: one JSON line per logged step, evaluation lines, a final summary, and a
progress bar when (and only when) rank 0 writes to an interactive terminal.

Per step: loss (global mean over every rank's labelled tokens), lr, grad norm, step time,
tokens/s per GPU (TGS), MFU and peak memory.  MFU = TGS x FLOPs per token / peak FLOP/s of one
device, FLOPs per token as DESIGN.md defines them (6 x (non-embedding + LM head params) +
6 x layers x dim x seq for causal attention); the peak is 989 TFLOP/s (dense bf16) on
H100/H200, 312 on A100/A800, else the config's ``peak_tflops`` (no MFU without one).
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0}


def peak_flops(device: torch.device, configured_tflops: float = 0.0) -> float | None:
    if configured_tflops:
        return configured_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tf in PEAK_TFLOPS.items():
            if key in name:
                return tf * 1e12
    return None


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated device memory (CUDA), else this process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30


class Progress:
    """A one-line bar on stderr, drawn only on a TTY."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.on = total, enabled and sys.stderr.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, text: str) -> None:
        if not self.on:
            return
        frac = step / max(1, self.total)
        bar = "#" * int(30 * frac)
        eta = (time.perf_counter() - self.t0) / max(frac, 1e-9) * (1 - frac)
        sys.stderr.write(f"\r[{bar:<30}] {step}/{self.total} {text} eta {eta:4.0f}s ")
        sys.stderr.flush()

    def close(self) -> None:
        if self.on:
            sys.stderr.write("\n")


class MetricsLog:
    """Rank 0 appends JSON lines to ``<run_dir>/metrics.jsonl``; other ranks write nothing."""

    def __init__(self, path: str, rank: int, echo: bool = True):
        self.path, self.rank, self.echo = path, rank, echo

    def write(self, record: dict) -> None:
        if self.rank != 0:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def say(self, msg: str) -> None:
        if self.rank == 0 and self.echo:
            print(msg, flush=True)


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarize(records: list[dict], skip: int = 2) -> dict:
    """Means over the logged steps after the first ``skip`` (warm-up), last loss and eval."""
    steps = [r for r in records if r.get("kind") == "step"]
    timed = steps[skip:] or steps
    out = {"steps": len(steps)}
    if steps:
        out["first_loss"] = steps[0]["loss"]
        out["final_loss"] = steps[-1]["loss"]
    for key in ("tokens_per_s_per_gpu", "mfu", "step_time_s"):
        vals = [r[key] for r in timed if r.get(key) is not None]
        if vals:
            out[f"mean_{key}"] = sum(vals) / len(vals)
    mem = [r["peak_mem_gib"] for r in steps if r.get("peak_mem_gib") is not None]
    if mem:
        out["peak_mem_gib"] = max(mem)
    evals = [r for r in records if r.get("kind") == "eval"]
    if evals:
        out["eval"] = {k: v for k, v in evals[-1].items() if k != "kind"}
    return out
