"""Losses that are not attention: the fused LM head + cross-entropy (fused_ce.py; its Triton
kernel in fused_ce_triton.py)."""
from .fused_ce import fused_linear_cross_entropy

__all__ = ["fused_linear_cross_entropy"]
