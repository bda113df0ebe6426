"""A full disk, told apart from other write errors, so that it is said in one line.

A write that runs out of space fails in several guises: an ``OSError`` with errno ENOSPC (or
EDQUOT, a quota) from Python's own writes, a ``SafetensorError`` whose text holds the OS error
(safetensors writes from Rust), and torch.distributed.checkpoint's ``CheckpointException``,
which carries each rank's failure.  :func:`full_disk` finds it in any of them (and in their
causes); :func:`no_space` is the one message every writer raises for it (checkpoint saves,
``burstengine export``, the token cache): "no space left on <path>".
"""
from __future__ import annotations

import errno
import os

_CODES = (errno.ENOSPC, errno.EDQUOT)
_TEXTS = ("No space left on device", "StorageFull", "Disk quota exceeded", "os error 28")


def full_disk(exc: BaseException | None) -> tuple[bool, str | None]:
    """(whether ``exc`` or anything it wraps is a full disk, the file it names if any)."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _CODES:
            return True, e.filename
        if any(t in str(e) for t in _TEXTS):
            return True, None
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict):
            todo += [v[0] for v in failures.values() if isinstance(v, tuple) and v]
    return False, None


def nearly_full(path: str, margin: int = 1 << 20) -> bool:
    """Whether the file system holding ``path`` has less than ``margin`` bytes left: how a write
    error that does not say why (torch.save's "unexpected pos") is told to be a full disk."""
    while path and not os.path.exists(path):
        path = os.path.dirname(path)
    try:
        st = os.statvfs(path or ".")
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < margin


def no_space(path: str) -> ValueError:
    """The error a writer raises when the disk holding ``path`` is full."""
    return ValueError(f"no space left on {path}: free some space (or write elsewhere) and run the command again")
