"""JSON records for every figure we publish: command, commit, device, versions, raw numbers.

Written by the commands (train --record, prefill --record, plan --json, ...), every bench and
the scripts in benchmarks/.  It reads the environment it records (and BURST_COMMIT,
BURST_RESULTS: the commit and the output folder of a run).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys

import torch

import burstengine

from .. import __version__


def git_commit() -> str:
    """$BURST_COMMIT, else the commit of the git checkout the package runs from (wherever the
    command runs), else the package's version ("v0.1.0": an installed release)."""
    if os.environ.get("BURST_COMMIT"):
        return os.environ["BURST_COMMIT"]
    package = os.path.abspath(burstengine.__path__[0])  # where git is asked, not a file read
    try:
        top, head = subprocess.check_output(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=package,
                                            stderr=subprocess.DEVNULL, text=True).split()
        if os.path.samefile(os.path.join(top, "burstengine"), package):  # not a repository around an install
            return head
    except Exception:
        pass
    return f"v{__version__}"


def environment() -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["device_count"] = torch.cuda.device_count()
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
        try:
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            pass
    else:
        env["device"] = "cpu"
    env["cpu_count"] = os.cpu_count()
    try:
        import triton  # optional dependency: recorded when installed

        env["triton"] = triton.__version__
    except Exception:
        pass
    # the settings that change what a run measures: every BURST_* and NCCL_* knob, the allocator's
    for k in sorted(os.environ):
        if k.startswith(("BURST_", "NCCL_")) or k in ("WORLD_SIZE", "PYTORCH_CUDA_ALLOC_CONF",
                                                       "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
            env[k] = os.environ[k]
    return env


# where records go unless told: a folder in the current directory, never the source tree (the
# committed records under benchmarks/results are evidence; regenerating one is an explicit
# --out-dir benchmarks/results or BURST_RESULTS=benchmarks/results)
DEFAULT_DIR = "burst-results"
OUT_DIR_HELP = f"record directory [$BURST_RESULTS or ./{DEFAULT_DIR}]"  # every --out-dir's help: where they go


def results_dir(out_dir: str | None = None) -> str:
    """The record folder: ``out_dir``, else $BURST_RESULTS, else ./burst-results."""
    return out_dir or os.environ.get("BURST_RESULTS") or DEFAULT_DIR


def free_path(out_dir: str, name: str, also: tuple[str, ...] = ()) -> str:
    """<out_dir>/<name>.json, or <name>-2.json, -3, ... if that exists (or the same name with
    one of the extensions ``also``, e.g. its figure's ".png"): a record never replaces another."""
    stem, i = os.path.join(out_dir, name), 2
    while any(os.path.exists(stem + ext) for ext in (".json", *also)):
        stem = os.path.join(out_dir, f"{name}-{i}")
        i += 1
    return stem + ".json"


def write_record(name: str, payload: dict, out_dir: str | None = None, path: str | None = None,
                 also: tuple[str, ...] = ()) -> str:
    """Write {command, commit, env, **payload} as JSON and return its path: a new file
    <out_dir>/<name>.json (a numbered name when that exists, or when a file of that name with
    an extension of ``also`` does, see :func:`free_path`: the caller writes its figure beside
    the record, under the record's name), or ``path`` itself when given (the same run rewriting
    the record it wrote before)."""
    rec = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "commit": git_commit(),
           "env": environment(), **payload}
    if path is not None:
        with open(path, "w") as f:
            json.dump(rec, f, indent=1)
        return path
    out_dir = results_dir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    while True:
        path = free_path(out_dir, name, also)
        try:
            # exclusive create: two runs racing for one name cannot both take it
            with open(path, "x") as f:
                json.dump(rec, f, indent=1)
            return path
        except FileExistsError:
            continue
