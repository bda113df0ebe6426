"""One attention call's arguments, as the caller gave them: what checks, planning and the
compiled path read instead of a dozen loose parameters.

:func:`~burstengine.attention.api.burst_attn_func` builds one :class:`AttnCall` from its
arguments and hands it down: the checks (attention/checks.py, attention/agreement.py), the
plan (attention/planning.py) and, under torch.compile, the custom op's encoding
(attention/compiled.py).  Nothing here is checked: a bad value is carried as given, so that it
becomes this rank's verdict in the checks and every rank raises alike.  The tensors (q, k, v)
travel beside it, not in it.
"""
from __future__ import annotations

from dataclasses import dataclass, field


# eq=False: fields may hold tensors (whose == is elementwise) and lists; a call is one call
@dataclass(frozen=True, eq=False)
class MaskArgs:
    """The mask arguments: ``causal``, the sliding ``window``, the packed documents' boundaries
    ``cu_seqlens`` (a sequence of ints or a 1-D integer tensor) and the block-sparse
    ``block_mask`` with its ``block_size``.  checks.check_mask turns them into a masks.Pattern."""

    causal: bool = False
    window: int | None = None
    cu_seqlens: object = None
    block_mask: object = None
    block_size: int | None = None


@dataclass(frozen=True, eq=False)
class AttnCall:
    """burst_attn_func's arguments other than q, k, v and ``return_lse`` (which only api.py
    reads): the ring's ``group``, the shard ``layout``, ``softmax_scale`` (None: 1/sqrt(head_dim)),
    the ``backward`` scheme asked for, the ``kernel`` name, the ``topology`` and the ``mask``."""

    group: object = None
    layout: str = "contiguous"
    softmax_scale: object = None
    backward: str = "auto"
    kernel: str | None = None
    topology: object = "auto"
    mask: MaskArgs = field(default_factory=MaskArgs)
