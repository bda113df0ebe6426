"""BurstEngine: exact sequence-parallel attention (BurstAttention) and long-context training."""
from .attention import arg_checks, burst_attn_func, hybrid_attn_func, seq_checkpoint
from .comm import CommStats, Topology, comm_stats
from .layout import LAYOUTS, position_ids, shard, unshard
from .loss import fused_linear_cross_entropy

__version__ = "0.1.0"

__all__ = ["burst_attn_func", "hybrid_attn_func", "arg_checks", "shard", "unshard", "position_ids", "LAYOUTS",
           "comm_stats", "CommStats", "Topology", "fused_linear_cross_entropy", "seq_checkpoint"]
