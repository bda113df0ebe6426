"""What a run reports: one JSON line per logged step, evaluation lines, a final summary, and a
progress bar when (and only when) rank 0 writes to an interactive terminal; optionally the same
numbers in TensorBoard and Weights & Biases (written by rank 0, closed at the end of the run).

Per step: loss (global mean over every rank's labelled tokens), lr, grad norm, step time,
tokens/s per GPU (TGS), MFU and peak memory.  MFU = TGS x FLOPs per token / peak FLOP/s of one
device, FLOPs per token as docs/design.md ("FLOP conventions") defines them (6 x (non-embedding + LM head params) +
6 x layers x dim x seq for causal attention); the peak is 989 TFLOP/s (dense bf16) on
H100/H200, 312 on A100/A800, else the config's ``peak_tflops`` (no MFU without one).
"""
from __future__ import annotations

import json
import os
import resource
import sys

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
    """A tqdm bar on stderr, drawn only on a TTY; log lines go above it through :meth:`write`
    (tqdm.write), so neither overwrites the other.  Without tqdm, or off a TTY: no bar, and
    lines are plain prints."""

    def __init__(self, total: int, enabled: bool, initial: int = 0, file=None):
        file = sys.stderr if file is None else file
        # log lines go where they always go (stdout) when the bar is on stderr
        self.out = sys.stdout if file is sys.stderr else file
        self.bar = None
        if enabled and file.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, initial=initial, file=file, unit="step", dynamic_ncols=True,
                                leave=True)

    @property
    def on(self) -> bool:
        return self.bar is not None

    def update(self, step: int, text: str) -> None:
        if self.bar is None:
            return
        self.bar.update(step - self.bar.n)
        self.bar.set_postfix_str(text, refresh=True)

    def write(self, msg: str) -> None:
        if self.bar is None:
            print(msg, flush=True)
        else:
            self.bar.write(msg, file=self.out)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


# --- sinks beside the JSONL: TensorBoard, Weights & Biases -------------------------------------

def scalars(record: dict) -> tuple[str, int, dict[str, float]] | None:
    """(section, step, {name: value}) of a step or eval record's numbers; None for others."""
    kind = record.get("kind")
    if kind not in ("step", "eval") or not isinstance(record.get("step"), int):
        return None
    section = "train" if kind == "step" else "eval"
    vals = {}
    for k, v in record.items():
        if k in ("kind", "step") or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            vals[k] = float(v)
        elif isinstance(v, list):  # e.g. accuracy by depth quartile
            vals.update({f"{k}/{i}": float(x) for i, x in enumerate(v) if isinstance(x, (int, float))})
    return section, record["step"], vals


class TensorBoardSink:
    """Scalars to ``log_dir`` with torch.utils.tensorboard; ``purge_step``: a resumed run's first
    step, so that the events a killed run wrote past its checkpoint are discarded."""

    def __init__(self, log_dir: str, purge_step: int | None = None, writer=None):
        if writer is None:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(log_dir=log_dir, purge_step=purge_step)
        self.writer = writer

    def log(self, record: dict) -> None:
        got = scalars(record)
        if got is None:
            return
        section, step, vals = got
        for k, v in vals.items():
            self.writer.add_scalar(f"{section}/{k}", v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run (``mode="offline"`` needs no network; ``wandb sync`` uploads it)."""

    def __init__(self, project: str, name: str, run_dir: str, mode: str = "", config: dict | None = None,
                 module=None):
        if module is None:
            import wandb as module
        os.makedirs(run_dir, exist_ok=True)
        self.run = module.init(project=project, name=name, dir=run_dir, mode=mode or None, config=config or {})

    def log(self, record: dict) -> None:
        got = scalars(record)
        if got is None:
            return
        section, step, vals = got
        self.run.log({f"{section}/{k}": v for k, v in vals.items()}, step=step)

    def close(self) -> None:
        self.run.finish()


def open_sinks(cfg, run_dir: str, start_step: int) -> list:
    """The sinks the config enables (call on rank 0 only)."""
    sinks = []
    try:
        if cfg.tensorboard:
            sinks.append(TensorBoardSink(os.path.join(run_dir, "tensorboard"),
                                         purge_step=start_step + 1 if start_step else None))
        if cfg.wandb:
            name = cfg.wandb_name or cfg.name
            sinks.append(WandbSink(cfg.wandb_project, name + (f" (resumed at step {start_step})" if start_step else ""),
                                   run_dir, cfg.wandb_mode, cfg.to_dict()))
    except BaseException:
        for s in sinks:
            s.close()
        raise
    return sinks


class MetricsLog:
    """Rank 0 appends JSON lines to ``<run_dir>/metrics.jsonl`` and passes step and eval records
    on to its sinks; other ranks write nothing.  ``say`` prints a line (above the progress bar,
    when one is attached)."""

    def __init__(self, path: str, rank: int, echo: bool = True):
        self.path, self.rank, self.echo = path, rank, echo
        self.sinks: list = []
        self.progress: Progress | None = None
        self._tail_checked = False

    def write(self, record: dict) -> None:
        if self.rank != 0:
            return
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        line = json.dumps(record) + "\n"
        if not self._tail_checked:
            # a fragment left by a kill mid-write must not swallow this record's start
            self._tail_checked = True
            if os.path.exists(self.path) and os.path.getsize(self.path):
                with open(self.path, "rb") as f:
                    f.seek(-1, os.SEEK_END)
                    if f.read(1) != b"\n":
                        line = "\n" + line
        with open(self.path, "a") as f:
            f.write(line)
        for s in self.sinks:
            s.log(record)

    def say(self, msg: str) -> None:
        if self.rank != 0 or not self.echo:
            return
        if self.progress is not None:
            self.progress.write(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for s in sinks:
            s.close()


def repair_jsonl(path: str, upto_step: int) -> int:
    """Make ``path`` the log of a run resumed after step ``upto_step``: drop a partial line (a
    kill mid-write), unreadable lines, summaries, and the records of later steps (the resumed
    run writes them again), so every step is logged once.  Returns the lines dropped."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    keep, dropped = [], 0
    for i, raw in enumerate(lines):
        if not raw.strip():
            continue
        rec = None
        if i < len(lines) - 1:  # the last piece has no newline: a partial line
            try:
                rec = json.loads(raw)
            except ValueError:
                pass
        step = rec.get("step") if isinstance(rec, dict) else None
        if (not isinstance(rec, dict) or rec.get("kind") == "summary"
                or (isinstance(step, int) and step > upto_step)):
            dropped += 1
            continue
        keep.append(raw + b"\n")
    if dropped:
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.writelines(keep)
        os.replace(tmp, path)
    return dropped


def read_jsonl(path: str) -> list[dict]:
    """The records of a metrics file; a partial last line (a kill mid-write) is skipped."""
    with open(path) as f:
        lines = f.read().split("\n")
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError as e:
            if n == len(lines):  # no newline after it: cut off mid-write
                continue
            raise ValueError(f"{path}:{n}: not a JSON line ({e})") from None
    return out


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
