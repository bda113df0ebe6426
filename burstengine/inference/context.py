"""The one rule every command that prefills (prefill, generate, eval) applies to a sequence's length.

A model's positions past its context (:attr:`ModelArgs.context`: config.json's
``max_position_embeddings``, or the original context stretched by RoPE scaling's factor when
that is longer) were never trained: the run works, and answers with whatever the model makes of
positions it never saw.  So such a sequence is refused in one line, before any rank starts,
unless the command is told to run it anyway (its ``--allow-longer``).
"""
from __future__ import annotations

from ..model import ModelArgs
from ..model.hf_dir import read_config
from .models import spec_args


def context_error(args: ModelArgs, tokens: int, what: str = "the prompt") -> str | None:
    """A one-line refusal when ``tokens`` (of ``what``) are more than ``args.context``, else None
    (also when the context is unknown: 0)."""
    ctx = args.context
    if not ctx or tokens <= ctx:
        return None
    s = args.rope_scaling
    how = (f"max_position_embeddings {args.max_position_embeddings} with {s.type} RoPE scaling x{s.factor:g}"
           if s.type != "none" else "its max_position_embeddings")
    return f"{what} has {tokens} tokens, more than the model's context of {ctx} ({how}); --allow-longer runs it anyway"


def check_context(spec: str, tokens: int, what: str = "the prompt") -> str | None:
    """:func:`context_error` of model ``spec`` (a preset: context unknown, or an HF model directory)."""
    try:
        args = spec_args(spec)
    except ValueError:  # a family burstengine's model does not run (prefill --impl hf runs it): its own field
        args = ModelArgs(max_position_embeddings=int(read_config(spec).get("max_position_embeddings") or 0))
    return context_error(args, tokens, what)
