"""LLaMA-style models whose attention is BurstAttention, with pluggable loss and checkpointing."""
from .checkpointing import POLICIES as CHECKPOINT_POLICIES
from .llama import PRESETS, ContextParallel, ModelArgs, Transformer, rope_tables
from .losses import LOSSES
from .rope import RopeScaling

__all__ = ["ModelArgs", "Transformer", "ContextParallel", "PRESETS", "LOSSES", "CHECKPOINT_POLICIES", "rope_tables", "RopeScaling"]
