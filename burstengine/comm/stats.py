"""Byte accounting: every tensor a rank sends is counted, per phase and per link.

    with burstengine.comm_stats() as stats:
        out = burst_attn_func(q, k, v, group=g)
        out.sum().backward()
    stats.forward_bytes, stats.backward_bytes   # what *this rank* sent
    stats.intra_bytes, stats.inter_bytes        # the same bytes, split by the link they crossed

A send is "inter" when it leaves this rank's node (see comm/topology.py for how ranks are
grouped into nodes) and "intra" otherwise.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field

_lock = threading.Lock()
_active: list["CommStats"] = []

LINKS = ("intra", "inter")


@dataclass
class CommStats:
    forward_bytes: int = 0
    backward_bytes: int = 0
    forward_messages: int = 0
    backward_messages: int = 0
    by_tensor: dict[str, int] = field(default_factory=dict)
    intra_bytes: int = 0
    inter_bytes: int = 0
    by_link: dict[str, int] = field(default_factory=dict)  # "forward.intra", "backward.inter", ...

    @property
    def total_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes


def record(phase: str, name: str, nbytes: int, link: str = "intra") -> None:
    if not _active:
        return
    if link not in LINKS:
        raise ValueError(f"unknown link {link!r}; expected one of {LINKS}")
    with _lock:
        for s in _active:
            setattr(s, f"{phase}_bytes", getattr(s, f"{phase}_bytes") + nbytes)
            setattr(s, f"{phase}_messages", getattr(s, f"{phase}_messages") + 1)
            setattr(s, f"{link}_bytes", getattr(s, f"{link}_bytes") + nbytes)
            key = f"{phase}.{name}"
            s.by_tensor[key] = s.by_tensor.get(key, 0) + nbytes
            key = f"{phase}.{link}"
            s.by_link[key] = s.by_link.get(key, 0) + nbytes


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
