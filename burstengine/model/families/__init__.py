"""Model families as adapters between Hugging Face checkpoints and our ModelArgs / parameters:
one file per family (config.json mapping both ways, weight-name table with fused tensors, rope
variant, quirks) on a shared base, in a registry."""
from .base import Family
from .registry import ARCHS, FAMILIES, family, from_config, writer

__all__ = ["Family", "FAMILIES", "ARCHS", "family", "from_config", "writer"]
