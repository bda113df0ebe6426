"""The commands' arguments: checks run on them before any rank starts (each returns a one-line
message, or None, so a user error ends the command at once with exit code 2, on one process,
instead of a traceback from every rank), and the help every command's parser prints
(:class:`HelpFormatter`, :func:`command_parser`)."""
from __future__ import annotations

import argparse
import copy
import importlib.util

import torch

from ..attention.planning import kernel_from_env
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


def kernel_error(name: str | None, device, backward: bool = False) -> str | None:
    """A message when kernel ``name`` (None: $BURST_KERNEL or auto) is unknown or cannot run on
    ``device``, or (``backward``: training) has no backward, else None."""
    where = "--kernel" if name else "BURST_KERNEL"
    try:
        kernel = get_kernel(name or kernel_from_env(), device)
    except ValueError as e:
        return f"{where}: {e}"
    if backward and kernel.forward_only:
        return f"{where}: {kernel.forward_only}"
    return None


def add_allow_longer(p: argparse.ArgumentParser) -> None:
    """--allow-longer: what lets a sequence past the model's context through
    (burstengine.inference.context.check_context refuses it otherwise)."""
    p.add_argument("--allow-longer", action="store_true",
                   help="run sequences longer than the model's context (max_position_embeddings after RoPE "
                        "scaling), which are refused otherwise")


def fill_device_defaults(args, cpu_defaults: dict, gpu_defaults: dict):
    """``args.device`` (default: cuda when there is one) and, for every option left at None, the
    device's default size: a benchmark's defaults finish in under a minute on CPU."""
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    for key, value in (cpu_defaults if args.device == "cpu" else gpu_defaults).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (their examples keep their lines), and every option's default
    shown as "[VALUE]" after its help, unless the help already says it ("[...]" at its end,
    %(default)s, "default:") or there is none to show (None, "", an off switch)."""

    def _format_action(self, action):
        if _shows_default(action):
            action = copy.copy(action)
            action.help = f"{action.help or ''} [%(default)s]".lstrip()
        return super()._format_action(action)


def _shows_default(action) -> bool:
    d, h = action.default, action.help
    if not action.option_strings or h == argparse.SUPPRESS or d in (None, "", argparse.SUPPRESS, [], ()):
        return False
    if action.nargs == 0:  # a switch (store_true, store_const): its default is "off"
        return False
    return not (h and ("%(default)" in h or h.rstrip().endswith("]") or "default:" in h))


def command_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """A command's parser: ``prog`` and its module docstring ``doc`` as the description."""
    return argparse.ArgumentParser(prog=prog, description=doc, formatter_class=HelpFormatter)
