"""LLaMA-style models whose attention is BurstAttention, with pluggable loss and checkpointing."""
from .args import PRESETS, ModelArgs
from .recompute import POLICIES as CHECKPOINT_POLICIES
from .context_parallel import ContextParallel
from .decoder import Transformer
from .layers import Hooks
from ..loss.model_loss import LOSSES
from .rope import RopeScaling, rope_tables

__all__ = ["ModelArgs", "Transformer", "ContextParallel", "Hooks", "PRESETS", "LOSSES", "CHECKPOINT_POLICIES",
           "rope_tables", "RopeScaling"]
