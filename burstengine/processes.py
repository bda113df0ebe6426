"""Local ranks start from a fork server that has imported torch once.

A fresh interpreter spends about 3 s of CPU importing torch, and the ``spawn`` start method paid
that once per rank on every launch (a 4-rank command: ~13 s of CPU before any work; the CPU test
suite: most of its time).  ``forkserver`` starts one server per launching process, which imports
torch (nothing else, and never initialises CUDA: the ranks do that themselves, as under
``spawn``), then forks each rank from it.

A forked rank inherits the server's state, not the launcher's: the environment and the stdout /
stderr the launcher had when the server started.  So each rank is handed the launcher's as they
are at launch (:class:`Inherited`, applied by :func:`adopt`): a variable set, or an output
redirected, between two launches reaches the second one's ranks, as under ``spawn``.  The working
directory, ``sys.path`` and ``__main__`` travel per rank already (multiprocessing's own
preparation data).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
from multiprocessing import reduction

PRELOAD = ["torch"]  # what the server imports before it forks ranks
STD_FDS = (1, 2)  # stdout, stderr


def context():
    """The multiprocessing context local ranks start from."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


class Inherited:
    """The launcher's environment and stdout / stderr, taken when a rank is started: pass one in
    the rank's arguments and call :func:`adopt` on it first thing in the rank.  The descriptors
    are duplicated into the rank as it starts (multiprocessing's ``DupFd``, which works only
    while a process is being started)."""

    def __init__(self, env: dict[str, str] | None = None, fds=None):
        self.env = dict(os.environ) if env is None else env
        self.fds = fds  # in the rank: {target fd: the launcher's, duplicated}

    def __reduce__(self):
        fds = {fd: reduction.DupFd(fd) for fd in STD_FDS if _is_open(fd)}
        return (_rebuilt, (self.env, fds))


def _rebuilt(env, dup_fds) -> Inherited:
    return Inherited(env, {target: d.detach() for target, d in dup_fds.items()})


def adopt(inherited: Inherited) -> None:
    """In a rank: the launcher's environment and outputs in place of the fork server's."""
    if inherited.env != os.environ:
        os.environ.clear()
        os.environ.update(inherited.env)
    for target, fd in (inherited.fds or {}).items():
        (sys.stdout if target == 1 else sys.stderr).flush()
        os.dup2(fd, target)
        os.close(fd)
