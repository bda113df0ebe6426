"""Byte accounting: every tensor a rank sends is counted, per phase.

    with burstengine.comm_stats() as stats:
        out = burst_attn_func(q, k, v, group=g)
        out.sum().backward()
    stats.forward_bytes, stats.backward_bytes   # what *this rank* sent
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

_lock = threading.Lock()
_active: list["CommStats"] = []


@dataclass
class CommStats:
    forward_bytes: int = 0
    backward_bytes: int = 0
    forward_messages: int = 0
    backward_messages: int = 0
    by_tensor: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes


def record(phase: str, name: str, nbytes: int) -> None:
    if not _active:
        return
    with _lock:
        for s in _active:
            setattr(s, f"{phase}_bytes", getattr(s, f"{phase}_bytes") + nbytes)
            setattr(s, f"{phase}_messages", getattr(s, f"{phase}_messages") + 1)
            key = f"{phase}.{name}"
            s.by_tensor[key] = s.by_tensor.get(key, 0) + nbytes


@contextmanager
def comm_stats():
    """Count the bytes this rank sends inside the block (forward and backward separately)."""
    s = CommStats()
    with _lock:
        _active.append(s)
    try:
        yield s
    finally:
        with _lock:
            _active.remove(s)
