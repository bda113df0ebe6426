"""The names model/hf.py imports from here, until the model families own their adapters: the
decoder now lives in :mod:`.args` (ModelArgs, PRESETS), :mod:`.layers` (RMSNorm, Attention,
FeedForward, Block), :mod:`.context_parallel` (ContextParallel) and :mod:`.decoder` (Transformer)."""
from .args import ModelArgs
from .decoder import Transformer

__all__ = ["ModelArgs", "Transformer"]
