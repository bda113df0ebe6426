"""Starting the ranks of a job: under torchrun (or any launcher that sets RANK/WORLD_SIZE), or,
with no launcher, by spawning processes on this machine (gloo on CPU, NCCL with one GPU each
when there are GPUs) so a plain ``burstengine <command>`` works on a laptop.

``spawn`` gives every rank an initialised default process group, runs ``entry(*entry_args)``
(which returns the rank's exit code), stops every rank after ``timeout`` seconds, and returns
the worst exit code: 1 when a rank raised, died or timed out.  Ctrl-C stops the ranks without a
word from them and raises KeyboardInterrupt in the caller (the command says what it means:
``burstengine`` exits 130).

Every long-running command's ranks run under :func:`guarded`, the trainer's fault handling:
a watchdog that ends the job within the fault deadline (BURST_TIMEOUT, else
``fault.DEFAULT_TIMEOUT``) when a rank dies or freezes, each survivor naming the lost rank in
one line (exit 75); the same deadline for every ring wait, argument check and the process
group's own timeout; a ValueError (a user error found alike on every rank) said once by rank 0,
exit 2.  Under a launcher the group forms through :func:`init_from_env`, whose check-in names a
rank that never arrived instead of torch's DistStoreError.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from contextlib import contextmanager
from datetime import timedelta
from multiprocessing import util as mp_util

import torch
import torch.distributed as dist

from .. import processes
from ..attention.planning import call_timeout, configured_timeout
from ..comm import fault
from ..comm.dist import initialized
from ..model.hf_dir import UntiedHead


def under_launcher() -> bool:
    """True when torchrun (or an initialised process group) already provides the ranks."""
    return ("RANK" in os.environ and "WORLD_SIZE" in os.environ) or initialized()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_from_env(timeout: float, backend: str | None = None) -> bool:
    """Initialise the default group from torchrun's environment unless one exists; pins this
    rank's GPU.  Returns True when this call created the group (the caller destroys it).  The
    ranks check in through the c10d store first: one that never arrives within ``timeout``
    (killed before the group formed, another MASTER_PORT) is named in a :class:`fault.RankLost`,
    and a store that does not answer names rank 0 (its host under env:// rendezvous)."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if initialized():
        return False
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    what = "forming the process group"
    try:
        store = _env_store(rank, world, timeout)
    except (dist.DistError, RuntimeError, OSError) as e:  # rank 0's store cannot be reached
        raise fault.store_lost(rank, f"{what} ({_first_line(e)})") from None
    fault.check_in(store, "formed", rank, range(world), timeout, what)
    dist.init_process_group(backend or default_backend(), store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    fault.announce()
    return True


def _env_store(rank: int, world: int, timeout: float):
    """The c10d store of env:// rendezvous (MASTER_ADDR / MASTER_PORT) as torch makes it, except
    that rank 0 does not wait for the others to connect: :func:`fault.check_in` does, naming
    the ranks that never come."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    t = timedelta(seconds=timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):  # torchrun's agent hosts it
        return dist.TCPStore(addr, port, world, is_master=False, timeout=t)
    return dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=t, wait_for_workers=False,
                         multi_tenant=True)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


def command_timeout() -> float:
    """The fault deadline of a command's ranks: BURST_TIMEOUT, else fault.DEFAULT_TIMEOUT
    (ValueError for a value that is not a finite number of seconds > 0)."""
    return fault.job_timeout(0, configured_timeout())


def guarded(body, prog: str, timeout: float, activity=None, on_lost=None) -> int:
    """``body()`` (the rank's work; returns its exit code) under the trainer's fault handling:
    a :class:`fault.Watchdog` with ``timeout`` and the same deadline for the ring waits and
    argument checks.  A ValueError (an error found alike on every rank, before any collective)
    is said by rank 0 in one line: exit 2.  A rank that dies or freezes ends every rank within
    ``timeout``, each saying in one line which rank was lost: exit 75 (``fault.EXIT_LOST``),
    after ``on_lost(error)`` on one survivor (e.g. where to resume from).  ``activity()``: what
    the job was doing, for that message.  Warnings of :data:`NOTES` are one-line notes of rank 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        with fault.Watchdog(timeout) as dog, call_timeout(timeout), _notes(prog, rank):
            try:
                return body()
            except ValueError as e:
                if rank == 0:
                    print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
                return 2
            except Exception as e:
                lost = dog.explain(e, activity() if activity else prog.split()[-1])
                if lost is None:
                    raise  # this rank's own failure: leaving the watchdog posts it for the others
                raise lost from e
    except fault.RankLost as e:
        if fault.quiet():  # a peer stopped by Ctrl-C before this rank was: the launcher says it
            return fault.EXIT_LOST
        print(f"{prog} (rank {rank}): {e}", file=sys.stderr, flush=True)
        if on_lost is not None and rank == min(r for r in range(world) if r != e.lost):
            on_lost(e)
        return fault.EXIT_LOST


NOTES = (UntiedHead,)  # warnings a command shows as "<prog>: note: ..." (once, by rank 0)


@contextmanager
def _notes(prog: str, rank: int):
    with warnings.catch_warnings():
        show = warnings.showwarning

        def note(message, category, filename, lineno, file=None, line=None):
            if not issubclass(category, NOTES):
                show(message, category, filename, lineno, file, line)
            elif rank == 0:
                print(f"{prog}: note: {message}", file=sys.stderr, flush=True)

        warnings.showwarning = note
        yield


def _guarded_command(entry, args, prog: str, timeout: float) -> int:
    """One rank of :func:`run_command`: ``validate`` already passed; ``entry(args)`` guarded."""
    return guarded(lambda: entry(args), prog, timeout)


def _rank_main(rank, world, port, pg_timeout, threads, backend_name, entry, entry_args, results, inherited):
    processes.adopt(inherited)
    # Ctrl-C reaches every process of the terminal's group: the launcher alone answers it, by
    # stopping the ranks (no rank's traceback, no collective failing on a peer that left)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # ... by SIGTERM first: the rank unwinds as from sys.exit (a run gives its lock back), quietly
    signal.signal(signal.SIGTERM, _stopped)
    if threads:
        torch.set_num_threads(threads)
    code = 1
    try:
        if backend_name == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
        # the launcher hosts the store (as torchrun's agent does): it outlives any rank, so the
        # others can still read what a failing rank posted there and name the rank at fault
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=pg_timeout))
        # Ctrl-C: the launcher marks the job stopping before it stops the ranks, so a rank that sees
        # a peer stopped first fails quietly instead of reporting a lost rank
        fault.quiet_when(lambda: store.check([STOPPING]))
        dist.init_process_group(backend_name, store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout))
        if backend_name == "gloo":
            # gloo's mesh is connected in init, and a rank whose init has returned can still have a
            # peer mid-handshake: one that then left at once (an entry with nothing to do) broke the
            # peer's init ("Connection closed by peer"), seen once ranks were forked in milliseconds
            dist.barrier()
        fault.announce()
        try:
            code = entry(*entry_args)
        finally:
            dist.destroy_process_group()
    except SystemExit as e:  # sys.exit(n) inside the entry: its code
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    results.put((rank, code))
    # reported: leave without the interpreter's teardown, on an error as on success, where a C++
    # thread left in torch.distributed's objects can still abort the process (seen in CI as
    # "terminate called without an active exception", and as a config error (exit 2) that the
    # launcher reported as "killed by SIGABRT")
    sys.stdout.flush()
    sys.stderr.flush()
    # what multiprocessing runs in a child before its own os._exit: the finalizers that unlink a
    # lock or semaphore made in the rank (tqdm's write lock, say), else the resource tracker
    # warns of a "leaked semaphore" when the job ends
    mp_util._run_finalizers(0)
    os._exit(code)


# the store key the launcher sets when Ctrl-C stops the job (its ranks then fail quietly)
STOPPING = "burstengine/stopping"


def _stopped(signum, frame):
    raise SystemExit(128 + signum)


def _reported(results) -> dict[int, int]:
    codes = {}
    while not results.empty():
        r, c = results.get()
        codes[r] = c
    return codes


def spawn(entry, entry_args: tuple, world: int, timeout: float, threads: int | None = None,
          backend: str | None = None, prog: str = "burstengine", pg_timeout: float | None = None) -> int:
    """Run ``entry(*entry_args)`` on ``world`` fresh local ranks; the worst exit code.
    ``entry`` must be importable (module level).  ``threads``: torch threads per rank
    (default: this machine's cores shared out); ``backend``: default NCCL with GPUs, else gloo;
    ``pg_timeout``: the process group's timeout (default ``timeout``).  A rank that dies or
    raises ends the job at once: the others are stopped, and the message names it."""
    import torch.multiprocessing as mp  # only when spawning local ranks

    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world)
    results = processes.context().SimpleQueue()  # also sets the fork server's preload (torch)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=pg_timeout or timeout))
    args = (world, port, pg_timeout or timeout, threads, backend or default_backend(), entry, entry_args,
            results, processes.Inherited())
    # the ranks start with Ctrl-C ignored (the fork server, started here the first time, keeps an
    # ignored SIGINT and gives it to each rank it forks), so none is interrupted before
    # _rank_main says so itself
    main = threading.current_thread() is threading.main_thread()  # where signal handlers may be set
    before = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        ctx = mp.start_processes(_rank_main, args=args, nprocs=world, join=False, start_method="forkserver")
    finally:
        if before is not None:
            signal.signal(signal.SIGINT, before)
    try:
        return _watch(ctx.processes, results, timeout, prog)
    except KeyboardInterrupt:  # Ctrl-C: the ranks go quietly, the caller says what it means
        try:
            store.set(STOPPING, "1")  # before any rank is stopped (fault.quiet_when in _rank_main)
        except Exception:  # noqa: BLE001 (the store is this process's: it does not fail)
            pass
        _stop([p for p in ctx.processes if p.exitcode is None], gently=True)
        raise


# a rank that left on purpose (it reported its exit code) gives the others this long to leave too:
# errors found on every rank alike (exit 2) are printed by rank 0, which must not be stopped by
# another rank's earlier exit before it has said why
GRACE_S = 10.0


def _watch(procs, results, timeout: float, prog: str) -> int:
    """Wait for the ranks; the worst exit code.  A rank killed by a signal, or one that left
    without reporting, stops the others at once and is named; a rank that reported a non-zero
    code gives the rest ``GRACE_S`` to finish before they are stopped."""
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout
    grace_end = None
    codes: dict[int, int] = {}
    while True:
        codes.update(_reported(results))
        alive = [p for p in procs if p.exitcode is None]
        for i, p in enumerate(procs):
            if p.exitcode is None or p.exitcode == 0 and i in codes:
                continue
            if p.exitcode < 0 or i not in codes:
                codes.update(_reported(results))  # it may have reported just before leaving
            if p.exitcode < 0 or i not in codes:
                _stop(alive)
                how = (f"was killed by {_signal_name(-p.exitcode)}" if p.exitcode < 0
                       else f"exited with code {p.exitcode}")
                print(f"{prog}: rank {i} {how}; stopped the other ranks", file=sys.stderr)
                return 1
            if grace_end is None:  # it reported its error (printed by the ranks) and left
                grace_end = time.monotonic() + GRACE_S
        if not alive:
            break
        now = time.monotonic()
        if now > deadline:
            print(f"{prog}: no result after {timeout:.0f}s (--timeout); stopping the ranks", file=sys.stderr)
            _stop(alive)
            return 1
        if grace_end is not None and now > grace_end:
            _stop(alive)
            codes.update(_reported(results))
            return max(codes.values())
        wait([p.sentinel for p in alive], timeout=min(2.0, max(0.0, deadline - now)))
    codes.update(_reported(results))
    if len(codes) != len(procs):
        print(f"{prog}: only ranks {sorted(codes)} reported", file=sys.stderr)
        return 1
    return max(codes.values())


def _stop(alive, gently: bool = False) -> None:
    """Stop the ranks: at once (a rank already lost or out of time), or ``gently`` (Ctrl-C):
    SIGTERM, which each rank turns into a quiet exit that gives back what it holds (a run's lock),
    then SIGKILL for any still there after a few seconds (stuck in a collective)."""
    if gently:
        for p in alive:
            p.terminate()
        for p in alive:
            p.join(5)
        alive = [p for p in alive if p.exitcode is None]
    for p in alive:
        p.kill()
    for p in alive:
        p.join(5)


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def add_launch_arguments(p, timeout: float = 3600.0, world_help: str = "one per GPU, else 2") -> None:
    """--world and --timeout, what :func:`run_command` reads, for commands that spawn their ranks."""
    p.add_argument("--world", type=int, default=None, help=f"ranks to spawn without torchrun [{world_help}]")
    p.add_argument("--timeout", type=float, default=timeout,
                   help="seconds before the spawned ranks are stopped [%(default)s]")


def default_world() -> int:
    """Ranks a command spawns when not told: one per GPU, else 2 gloo ranks (a ring)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def run_command(entry, args, validate, prog: str, backend: str | None = None) -> int:
    """The ranks of a command: under torchrun (or in an initialised group) this process is one
    of them and ``args.world`` becomes the group's size; otherwise ``args.world`` local ranks are
    spawned.  ``validate(args)`` (an error message or None) runs first, on every rank, so bad
    arguments exit 2 everywhere before any work; ``entry(args)`` returns the rank's exit code and
    runs under :func:`guarded` (a lost or frozen rank ends the job within the fault deadline,
    which is the process group's timeout too).  ``args`` needs ``world`` and ``timeout`` (the
    wall-clock limit of spawned ranks); ``threads`` is used when present."""
    threads = getattr(args, "threads", None)
    try:
        timeout = command_timeout()
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    if under_launcher():
        if threads:
            torch.set_num_threads(threads)
        try:
            own = init_from_env(timeout, backend)
        except fault.RankLost as e:
            print(f"{prog} (rank {os.environ.get('RANK', '?')}): {e}", file=sys.stderr, flush=True)
            return fault.EXIT_LOST
        args.world = dist.get_world_size()
        msg = validate(args)
        if msg:
            if dist.get_rank() == 0:
                print(f"{prog}: error: {msg}", file=sys.stderr)
            code = 2
        else:
            code = _guarded_command(entry, args, prog, timeout)
        if own:
            dist.destroy_process_group()
        return code
    if getattr(args, "world", None) is None:
        args.world = default_world()
    msg = f"--world must be >= 1, got {args.world}" if args.world < 1 else validate(args)
    if msg:
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2
    return spawn(_guarded_command, (entry, args, prog, timeout), args.world, args.timeout, threads=threads,
                 backend=backend, prog=prog, pg_timeout=timeout)
