"""JSON records for every figure we publish: command, commit, device, versions, raw numbers.

Below train/, inference/ and bench/, which all write records.  It reads the environment it
records (and BURST_COMMIT, BURST_RESULTS: the commit and the output folder of a run).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys

import torch


def git_commit() -> str:
    if os.environ.get("BURST_COMMIT"):
        return os.environ["BURST_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], stderr=subprocess.DEVNULL, text=True).strip()
    except Exception:
        return "unknown"


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
    try:
        import triton  # optional dependency: recorded when installed

        env["triton"] = triton.__version__
    except Exception:
        pass
    for k in ("NCCL_P2P_DISABLE", "NCCL_NVLS_ENABLE", "WORLD_SIZE", "BURST_KERNEL"):
        if k in os.environ:
            env[k] = os.environ[k]
    return env


def write_record(name: str, payload: dict, out_dir: str | None = None) -> str:
    """Write {command, commit, env, **payload} to <out_dir>/<name>.json and return the path."""
    out_dir = out_dir or os.environ.get("BURST_RESULTS", "benchmarks/results")
    os.makedirs(out_dir, exist_ok=True)
    rec = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "commit": git_commit(),
           "env": environment(), **payload}
    path = os.path.join(out_dir, f"{name}.json")
    with open(path, "w") as f:
        json.dump(rec, f, indent=1)
    return path
