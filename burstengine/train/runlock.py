"""The lock a training run holds on its out_dir: one run writes a run directory at a time.

Two runs in one out_dir would interleave ``metrics.jsonl``, delete each other's lines
(``--overwrite``) and mix checkpoints.  So a run's rank 0 creates ``<out_dir>/run.lock`` before
the job's first collective and removes it when the run ends (normally, on an error, on Ctrl-C);
a second run, from any host that sees the file, is refused naming the holder.

The file is a JSON object naming its holder: host, boot id, pid namespace, pid, the process's
start time in clock ticks since boot (``/proc/<pid>/stat``), a wall-clock start time and the
command.  That is enough to tell, on the holder's own host, that a lock is stale: the pid is
gone, a zombie, or now another process (its start time differs), or the machine was rebooted
(another boot id).  A stale lock is taken over with a one-line note; a lock from another host
or pid namespace cannot be judged from here and counts as held (the message says how to clear
it).  A SIGKILLed run therefore leaves a stale lock that the next run takes over.

The file appears complete or not at all: it is written under a temporary name and hard-linked
to ``run.lock`` (the link fails if the lock exists: atomic on local file systems and NFS).
Taking over a stale lock renames it aside first, so of two runs that judge it stale at once
only one removes it.  Within one process the lock is re-entrant (a count), so that trainers
built one after another in the same process (tests, benchmarks) do not refuse each other.
"""
from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import time
import uuid

LOCK_NAME = "run.lock"

_HELD: dict[str, list] = {}  # lock path -> [token, count, directories made for it]: this process's locks


class Held(ValueError):
    """Another live (or unjudgeable) run holds the lock; the message names it."""


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _stat_fields(pid) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (None when there is no such process)."""
    text = _read_text(f"/proc/{pid}/stat")
    return text.rsplit(")", 1)[1].split() if text else None


def identity() -> dict:
    """This process, as the lock records it."""
    fields = _stat_fields("self")
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = None
    boot = _read_text("/proc/sys/kernel/random/boot_id")
    argv = list(sys.argv)
    if argv and os.path.basename(argv[0]) == "__main__.py":  # python -m PACKAGE
        argv[:1] = ["python", "-m", os.path.basename(os.path.dirname(argv[0]))]
    return {"pid": os.getpid(), "host": socket.gethostname(), "boot_id": boot.strip() if boot else None,
            "pid_ns": ns, "start_ticks": int(fields[19]) if fields else None,
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "command": shlex.join(argv)[:300]}


def holder_state(holder: dict) -> str:
    """"alive", "gone" (the process has ended: the lock is stale) or "unknown" (another host or
    pid namespace: it cannot be told from here)."""
    me = identity()
    if holder.get("host") != me["host"]:
        return "unknown"
    if holder.get("boot_id") and me["boot_id"] and holder["boot_id"] != me["boot_id"]:
        return "gone"  # this host was rebooted since: every process of that boot has ended
    if holder.get("pid_ns") != me["pid_ns"]:
        return "unknown"
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return "gone"
    fields = _stat_fields(pid)
    if fields is None:
        if os.path.isdir("/proc/self"):
            return "gone"
        try:  # no /proc: ask the kernel whether the pid exists at all
            os.kill(pid, 0)
        except ProcessLookupError:
            return "gone"
        except OSError:
            pass
        return "alive"
    if fields[0] in ("Z", "X"):  # killed, not yet reaped by its parent
        return "gone"
    if holder.get("start_ticks") is not None and int(fields[19]) != holder["start_ticks"]:
        return "gone"  # the pid now belongs to another process
    return "alive"


def describe(holder: dict) -> str:
    return (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')}, "
            f"command {holder.get('command')!r}")


def _read_lock(path: str) -> dict | None:
    """The holder recorded in ``path``; None when the file is gone; {} when it is unreadable."""
    text = _read_text(path)
    if text is None:
        return None if not os.path.exists(path) else {}
    try:
        holder = json.loads(text)
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


class RunLock:
    """A lock held on a run directory (see the module doc); :meth:`release` is idempotent."""

    def __init__(self, path: str, token: str, note: str | None = None):
        self.path, self.token, self.note = path, token, note
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        held = _HELD.get(self.path)
        if held is None or held[0] != self.token:
            return
        held[1] -= 1
        if held[1] > 0:
            return
        created = _HELD.pop(self.path)[2]
        if (_read_lock(self.path) or {}).get("token") == self.token:  # never another run's
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        for d in created:  # the directories made only to hold the lock, if nothing else came
            try:
                os.rmdir(d)
            except OSError:
                break


def _make_dirs(path: str) -> list[str]:
    """os.makedirs(path), returning the directories it created, deepest first."""
    made = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        made.append(p)
        p = os.path.dirname(p)
    os.makedirs(path, exist_ok=True)
    return made


WRITING_S = 5.0  # an unreadable lock file younger than this may still be being written


def _age(path: str) -> float:
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:
        return 0.0


def _publish(tmp: str, path: str, me: dict) -> None:
    """Create ``path`` holding ``me`` (written to ``tmp``) unless it exists (FileExistsError)."""
    try:
        os.link(tmp, path)
        return
    except FileExistsError:
        raise
    except OSError:  # a file system without hard links: exclusive create, then write
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(me, f)


def acquire(run_dir: str) -> RunLock:
    """Lock ``run_dir`` for this process (creating it); :class:`Held` naming the holder when
    another live run has it.  A stale lock is taken over: the returned lock's ``note`` says so."""
    created = _make_dirs(run_dir)
    path = os.path.join(os.path.realpath(run_dir), LOCK_NAME)
    held = _HELD.get(path)
    if held is not None and (_read_lock(path) or {}).get("token") == held[0]:
        held[1] += 1
        return RunLock(path, held[0])
    token = uuid.uuid4().hex
    me = dict(identity(), token=token)
    tmp = f"{path}.{token}.tmp"
    with open(tmp, "w") as f:
        json.dump(me, f)
    note = None
    try:
        for _ in range(20):
            try:
                _publish(tmp, path, me)
                _HELD[path] = [token, 1, created]
                return RunLock(path, token, note)
            except FileExistsError:
                pass
            holder = _read_lock(path)
            if holder is None:
                continue  # released meanwhile: try again
            if not holder and _age(path) < WRITING_S:  # still being written (see _publish)
                time.sleep(0.25)
                continue
            state = holder_state(holder) if holder else "gone"
            if state != "gone":
                where = ("" if state == "alive" else
                         "; it runs on another host (or pid namespace), so whether it still runs cannot be told "
                         f"here: if it has ended, delete {path}")
                raise Held(f"out_dir {run_dir} is in use by another run: {describe(holder)} (lock {path}); wait for "
                           f"it to end or use another name / out_dir (--overwrite does not stop a live run){where}")
            # stale: move it aside, then make sure it was the one judged (not a lock just taken)
            aside = f"{path}.stale-{token}"
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                continue
            moved = _read_lock(aside) or {}
            if moved.get("token") != holder.get("token"):
                try:
                    _publish(aside, path, moved)  # put the live one back
                except FileExistsError:
                    pass
                os.unlink(aside)
                continue
            os.unlink(aside)
            note = (f"took over the lock on {run_dir} left by {describe(holder)}, which is no longer running"
                    if holder else f"took over the unreadable lock file {path}")
        raise Held(f"out_dir {run_dir}: could not take the lock {path} (other runs keep taking it)")
    finally:
        os.unlink(tmp)
