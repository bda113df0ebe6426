"""The attention runtime: the public calls (api.py: burst_attn_func; hybrid.py: hybrid_attn_func;
seqckpt.py: seq_checkpoint), their checks (checks.py), the one planning module (planning.py)
and the ring loops (loops.py).  The schedule they run is burstengine.schedule."""
from .api import burst_attn_func
from .checks import arg_checks
from .hybrid import hybrid_attn_func
from .seqckpt import seq_checkpoint

__all__ = ["burst_attn_func", "hybrid_attn_func", "seq_checkpoint", "arg_checks"]
