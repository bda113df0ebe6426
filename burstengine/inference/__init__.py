"""Inference: distributed prefill of long prompts (``burstengine prefill``).

:func:`prefill` runs one forward pass over a prompt sharded across a context-parallel group and
returns the next-token logits (and optionally each rank's KV shard); :func:`load_model` gives
the model it runs (burstengine's LLaMA from a preset or an HF checkpoint, or a transformers
model with ``attn_implementation="burst"``).
"""
from .engine import PrefillOutput, last_token_rank, prefill
from .models import PrefillModel, load_model

__all__ = ["prefill", "PrefillOutput", "last_token_rank", "load_model", "PrefillModel"]
