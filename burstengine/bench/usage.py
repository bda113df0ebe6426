"""Checks the commands run on their arguments before any rank starts: each returns a one-line
message (or None), so a user error ends the command at once with exit code 2, on one process,
instead of a traceback from every rank."""
from __future__ import annotations

import importlib.util

import torch

from ..kernels import get_kernel

# optional packages -> the extra of pyproject.toml that brings them
EXTRAS = {
    "safetensors": "hf",
    "transformers": "hf",
    "tokenizers": "train",
    "matplotlib": "plot",
    "triton": "triton",
}


def missing_package(name: str, what: str) -> str | None:
    """A message naming the extra to install when ``name`` cannot be imported, else None."""
    if importlib.util.find_spec(name) is not None:
        return None
    extra = EXTRAS.get(name)
    how = f"pip install 'burstengine[{extra}]'" if extra else f"pip install {name}"
    return f"{what} needs the {name} package, which is not installed: {how}"


def kernel_error(name: str | None, device) -> str | None:
    """A message when kernel ``name`` (None: $BURST_KERNEL or auto) is unknown or cannot run on
    ``device``, else None."""

    try:
        get_kernel(name, device)
    except ValueError as e:
        return f"--kernel: {e}" if name else f"BURST_KERNEL: {e}"
    return None


def fill_device_defaults(args, cpu_defaults: dict, gpu_defaults: dict):
    """``args.device`` (default: cuda when there is one) and, for every option left at None, the
    device's default size: a benchmark's defaults finish in under a minute on CPU."""
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    for key, value in (cpu_defaults if args.device == "cpu" else gpu_defaults).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args
