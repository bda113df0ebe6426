"""BurstEngine: exact sequence-parallel attention (BurstAttention) and long-context training."""
from .attention import burst_attn_func
from .attention.checks import arg_checks
from .comm import CommStats, comm_stats
from .layout import LAYOUTS, position_ids, shard, unshard

__version__ = "0.1.0"

__all__ = ["burst_attn_func", "arg_checks", "shard", "unshard", "position_ids", "LAYOUTS", "comm_stats", "CommStats"]
