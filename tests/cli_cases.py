"""`burstengine ARGV` run in the test process, as `python -m burstengine ARGV` runs it in a fresh one.

A fresh interpreter importing torch costs 2-4 s of CPU on the 2-core CI machine, and the suite
runs commands by the hundred: where the child process itself is not what a test is about (exit
codes of the console script, signals, Ctrl-C, lost ranks keep their real subprocess tests), a
command runs here through ``burstengine.cli.main``.  It sees what a fresh process would: the
same argv (records and run locks quote it), an environment without launcher or BURST_* variables
(plus ``env``), the working directory ``cwd``, warnings printed to its stderr as an interpreter
prints them (not recorded for pytest's summary), and its output captured at the file
descriptors, so the ranks it spawns are captured too.  An exception that would end the process
becomes exit 1 with its traceback on stderr; everything it changed in this process (environment,
directory, argv, torch's threads and random state, signal handlers) is put back.
"""
from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import tempfile
import traceback
import warnings

import torch
import torch.distributed as dist

import burstengine

MAIN = os.path.join(burstengine.__path__[0], "__main__.py")  # sys.argv[0] under `python -m burstengine`
LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def run(argv, cwd=None, env=None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``burstengine ARGV`` run in this process."""
    from burstengine import cli

    assert not dist.is_initialized(), "a process group of an earlier test is still up: a command would join it"
    with _fresh_process_state(argv, cwd, env), _captured() as (out, err), _warnings_to_stderr():
        try:
            rc = cli.main(list(argv))
        except SystemExit as e:  # argparse (--help, usage errors), sys.exit in a command
            rc = _exit_code(e)
        except BaseException:  # noqa: BLE001 (the interpreter's last word: a traceback and exit 1)
            traceback.print_exc()
            rc = 1
    assert not dist.is_initialized(), f"burstengine {argv[0]} left a process group in the test process"
    return rc, out.getvalue(), err.getvalue()


def _exit_code(e: SystemExit) -> int:
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)  # sys.exit("message"): printed, exit 1
    return 1


@contextlib.contextmanager
def _fresh_process_state(argv, cwd, env):
    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    threads, rng, dtype = torch.get_num_threads(), torch.random.get_rng_state(), torch.get_default_dtype()
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for var in list(os.environ):
        if var in LAUNCHER or var.startswith("BURST_"):
            del os.environ[var]
    os.environ["OMP_NUM_THREADS"] = "1"  # as the suite's subprocesses run
    os.environ.update(env or {})
    sys.argv = [MAIN, *argv]
    if cwd is not None:
        os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_env)
        torch.set_num_threads(threads)
        torch.random.set_rng_state(rng)
        torch.set_default_dtype(dtype)
        for s, h in handlers.items():
            signal.signal(s, h)


@contextlib.contextmanager
def _captured():
    """stdout and stderr at file descriptors 1 and 2 (the spawned ranks write there) and through
    sys.stdout / sys.stderr; read into the two StringIO yielded when the block ends."""
    out, err = io.StringIO(), io.StringIO()
    sys.stdout.flush()
    sys.stderr.flush()
    saved_sys, saved_fds = (sys.stdout, sys.stderr), (os.dup(1), os.dup(2))
    files = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    try:
        for fd, f in zip((1, 2), files):
            os.dup2(f.fileno(), fd)
        sys.stdout, sys.stderr = (io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), line_buffering=True,
                                                   errors="backslashreplace") for fd in (1, 2))
        yield out, err
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        sys.stdout, sys.stderr = saved_sys
        for fd, saved in zip((1, 2), saved_fds):
            os.dup2(saved, fd)
            os.close(saved)
        for f, text in zip(files, (out, err)):
            f.seek(0)
            text.write(f.read().decode("utf-8", "replace"))
            f.close()


# what pytest adds to the process's filters for its own report (its summary shows them)
PYTEST_FILTERS = {("always", DeprecationWarning), ("always", PendingDeprecationWarning)}


@contextlib.contextmanager
def _warnings_to_stderr():
    """Warnings filtered as in a fresh interpreter (the filters that the imports installed, without
    pytest's) and printed on stderr as the interpreter prints them."""
    with warnings.catch_warnings():
        warnings.filters[:] = [f for f in warnings.filters if (f[0], f[2]) not in PYTEST_FILTERS or f[1] or f[3]]
        warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: sys.stderr.write(
            warnings.formatwarning(message, category, filename, lineno, line))
        yield
