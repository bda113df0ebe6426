"""The attention runtime: the public calls (api.py: burst_attn_func; hybrid.py: hybrid_attn_func;
sequence_recompute.py: seq_checkpoint), the call object they build (call.py), its checks (checks.py: this
rank's own; agreement.py: every rank's; prepare.py runs both and the plan), the one planning
module (planning.py), the compiled path (compiled.py) and the ring loops (loops.py).  The
schedule they run is burstengine.schedule."""
from .api import burst_attn_func
from .checks import arg_checks
from .hybrid import hybrid_attn_func
from .sequence_recompute import seq_checkpoint

__all__ = ["burst_attn_func", "hybrid_attn_func", "seq_checkpoint", "arg_checks"]
