"""Inference: distributed prefill of long prompts (``burstengine prefill``) and generation
against a KV cache that stays sharded over the ranks (``burstengine generate``).

:func:`prefill` runs one forward pass over a prompt sharded across a context-parallel group and
returns the next-token logits (and optionally each rank's KV shard); :func:`generate` goes on
from there, token by token, with the cache still sharded; :func:`load_model` gives the model
they run (burstengine's LLaMA from a preset or an HF Llama / Mistral / Qwen2 checkpoint, or a
transformers model with ``attn_implementation="burst"`` for prefill).
"""
from .engine import PrefillOutput, last_token_rank, prefill
from .generate import GenerateOutput, generate
from .models import PrefillModel, load_model
from .sampling import Sampling

__all__ = ["prefill", "PrefillOutput", "last_token_rank", "load_model", "PrefillModel", "generate", "GenerateOutput",
           "Sampling"]
