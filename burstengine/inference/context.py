"""How long a sequence a model was made for, and the one rule every command applies with it.

A model's positions past its context (config.json's ``max_position_embeddings``, or the
original context stretched by RoPE scaling's factor when that is longer) were never trained:
the run works, and answers with whatever the model makes of positions it never saw.  The
commands that prefill (prefill, generate, eval) refuse such a sequence in one line unless
told to run it anyway (their ``--allow-longer``).
"""
from __future__ import annotations

from ..model import PRESETS, ModelArgs
from ..model.hf_dir import args_from_hf_config, read_config


def model_context(args: ModelArgs) -> int:
    """The tokens ``args``' positions were trained for: max_position_embeddings, or the
    original context x RoPE scaling's factor when that is longer; 0 when unknown (a preset)."""
    n = args.max_position_embeddings
    s = args.rope_scaling
    if s.type != "none":
        n = max(n, int(s.original(args.max_position_embeddings) * s.factor))
    return n


def spec_context(spec: str) -> int:
    """:func:`model_context` of a preset name or an HF model directory (0: unknown)."""
    if spec in PRESETS:
        return model_context(PRESETS[spec])
    cfg = read_config(spec)
    try:
        return model_context(args_from_hf_config(cfg, f"{spec}/config.json"))
    except ValueError:  # a family burstengine's model does not run (transformers' does): its own field
        return int(cfg.get("max_position_embeddings") or 0)


def check_context(spec: str, tokens: int, what: str = "the prompt", allow: str = "--allow-longer") -> str | None:
    """A message when ``tokens`` (of ``what``) are more than model ``spec``'s context
    (:func:`spec_context`), else None; ``allow`` names the way to run it anyway."""
    limit = spec_context(spec)
    if not limit or tokens <= limit:
        return None
    return (f"{what}: {tokens} tokens are more than the {limit} positions {spec!r} was trained for "
            f"(max_position_embeddings after RoPE scaling); {allow} runs it anyway")
