"""Faults between ranks: name the rank that went missing, and never wait forever.

When a rank dies (killed, out of memory, a crash) or stops answering, only the ranks that
talk to it directly see an error; the others wait on ranks that are themselves waiting.  This
module turns that into a clear failure on every rank.  The pieces are independent:

* :func:`wait` / :func:`post`: the ring (``comm.ring``) posts and waits its point-to-point ops
  through them.  An op that fails (peer process gone) or outlives the deadline becomes
  :class:`RankLost`, naming the peer's global rank.  The deadline is the op's (``Op.deadline``:
  ``BURST_TIMEOUT`` seconds, which attention/planning.py reads and hands to the rings and the
  argument check), else the process group's own timeout; it is enforced on CPU
  backends (gloo), where waits block the host.  On NCCL the host does not wait for the
  transfer (``Op.blocking`` False): while a :class:`Watchdog` runs, such a wait is kept in a
  small registry, and the watchdog's thread bounds it instead (see below).
* Fault notices in the c10d store: the first rank that sees a peer fail posts "rank P lost"
  (first writer wins).  A rank that fails later because *its* peer gave up and exited names
  P from the notice, not its innocent neighbour.
* :class:`Watchdog`: a daemon thread per rank that heartbeats through the store and watches
  its predecessor.  When a rank stops beating for ``timeout`` seconds, or any rank posts a
  notice, it prints a message naming the lost rank and ends this process (``os._exit``) after
  a short grace period.  This covers ranks blocked where no Python code runs (an NCCL
  collective, an FSDP all-gather, a wait with no deadline), and is what a training loop uses.
  It also bounds the waits the host did not block in (NCCL): one whose works are still not
  complete ``timeout`` seconds after it was queued is a fault of the peer it waits on (a rank
  alive but elsewhere, e.g. one that skipped a backward, whose heartbeat goes on), named as
  a ring wait that timed out on gloo is (the census below).
  :meth:`Watchdog.explain` turns an error a collective raised (gloo's "Connection reset by
  peer", which names an address, not a rank) into a :class:`RankLost` naming the ranks whose
  heartbeats stopped.
* :func:`init_process_group`: ``torch.distributed.init_process_group`` with the group timeout
  given (pass BURST_TIMEOUT's value), so one variable sets every deadline of a job.

Exit codes: an uncaught :class:`RankLost` exits with Python's usual 1; the watchdog exits with
:data:`EXIT_LOST` (75, EX_TEMPFAIL: worth a restart from the last checkpoint).
"""
from __future__ import annotations

import faulthandler
import os
import socket
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from .dist import rank_of

EXIT_LOST = 75
DEFAULT_TIMEOUT = 600.0  # like NCCL's default group timeout: long enough for a slow checkpoint save
PREFIX = "burstengine/fault"
_NOTICE = f"{PREFIX}/notice"
_DONE, _EXIT = b"done", b"exit"  # heartbeat values of a rank that finished / left on an error it reported


def _beat_key(rank: int) -> str:
    """Where ``rank``'s watchdog posts its heartbeat (a count, or _DONE / _EXIT)."""
    return f"{PREFIX}/hb/{rank}"


class RankLost(RuntimeError):
    """A peer rank died or did not answer in time.  ``lost``: the global rank to blame (the
    root cause when another rank reported one), None when it cannot be told; ``peer``: the
    rank this one was talking to when it failed."""

    def __init__(self, msg: str, lost: int | None = None, peer: int | None = None):
        super().__init__(msg)
        self.lost, self.peer = lost, peer


def job_timeout(seconds: float = 0.0, configured: float | None = None) -> float:
    """The fault deadline of a job: ``seconds`` if positive, else ``configured`` (BURST_TIMEOUT,
    read by attention/planning.py's :func:`configured_timeout`), else :data:`DEFAULT_TIMEOUT`."""
    return float(seconds) if seconds and seconds > 0 else configured or DEFAULT_TIMEOUT


def init_process_group(backend: str | None = None, *, timeout_s: float | None = None, **kwargs) -> None:
    """``dist.init_process_group`` whose timeout is ``timeout_s`` (e.g. BURST_TIMEOUT's, from
    attention/planning.py's ``configured_timeout()``), else torch's default.  The group timeout bounds every gloo op and arms NCCL's watchdog (which
    aborts the process on a collective that outlives it: keep ``TORCH_NCCL_ASYNC_ERROR_HANDLING``
    at torch's default, 3)."""
    if timeout_s is not None:
        kwargs.setdefault("timeout", timedelta(seconds=timeout_s))
    dist.init_process_group(backend, **kwargs)
    announce()


# --- which rank's process is gone --------------------------------------------------------------

_ANNOUNCED: list = []  # the store this process has posted its process in


def _process_id() -> str:
    """Host, pid namespace and pid: another process can tell whether this one still exists
    only where the first two are its own."""
    try:
        ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        ns = "-"
    return f"{socket.gethostname()} {ns} {os.getpid()}"


def announce(store=None) -> None:
    """Post this rank's process (host, pid namespace, pid) in the c10d store, once per store.
    A rank whose collective fails then tells a peer process that no longer exists (killed, out
    of memory, crashed) on its own host from one that is merely slow or waiting elsewhere, and
    names it at once: the census alone cannot when the survivors have not all failed yet (a
    rank killed before the job's first collective).  Called by :func:`init_process_group`, the
    launcher, the :class:`Watchdog` and before the first op through :func:`post`."""
    st = store or _store()
    if st is None or (_ANNOUNCED and _ANNOUNCED[-1] is st) or not dist.is_initialized():
        return
    key = f"{PREFIX}/pid/{dist.get_rank()}"
    if _bounded(lambda: st.set(key, _process_id()) or True) is not None:
        _ANNOUNCED[:] = [st]


def gone(rank: int, store=None) -> bool:
    """True when ``rank``'s process is known to have ended: it announced itself on this host,
    in this pid namespace, and that process no longer runs (or is a zombie).  False when it
    cannot be told (another host, never announced, the store does not answer)."""
    st = store or _store()
    if st is None:
        return False
    key = f"{PREFIX}/pid/{rank}"
    v = _bounded(lambda: st.get(key).decode() if st.check([key]) else None, 1.0)
    if not v:
        return False
    host, ns, pid = v.rsplit(" ", 2)
    here_host, here_ns, _ = _process_id().rsplit(" ", 2)
    if host != here_host or ns != here_ns or ns == "-":
        return False
    if _bounded(lambda: st.check([f"{PREFIX}/left/{rank}"]), 1.0):
        return False  # it left on an error it reported (it named the rank at fault): not the cause
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    except (OSError, ValueError, IndexError):
        return False
    return state in ("Z", "X")  # killed, not yet reaped by its parent


# --- the fault notice in the store ------------------------------------------------------------

@dataclass(frozen=True)
class Notice:
    lost: int | None
    reporter: int
    text: str


_STORES: list = []


def _store():
    try:
        st = dist.distributed_c10d._get_default_store()
    except Exception:
        # the default group is gone (aborted after a fault): the store it had, kept here
        return _STORES[-1] if _STORES else None
    if not _STORES or _STORES[-1] is not st:
        _STORES[:] = [st]  # kept alive: rank 0 hosts it, and the others still read it after a fault
    return st


def store():
    """The default group's c10d store, or None."""
    return _store()


def _bounded(fn, seconds: float = 3.0):
    """fn() in a helper thread, None if it raises or takes longer than ``seconds``: store calls
    on the failure path must not become a hang of their own (the store's host may be the
    process that died)."""
    box = []

    def run():
        try:
            box.append(fn())
        except Exception:
            pass

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    return box[0] if box else None


# what tells this process that its job is being stopped on purpose (Ctrl-C at the launcher), when a
# peer that was stopped first makes it fail: callables a launcher registers (quiet_when)
_QUIET: list = []


def quiet_when(check) -> None:
    """Register ``check()``: true once this process's job is being stopped on purpose, after which
    the losses its peers' stopping causes are not reported here (the launcher says what happened,
    in one line)."""
    _QUIET.append(check)


def quiet() -> bool:
    """Whether this process's job is being stopped on purpose (:func:`quiet_when`)."""
    return any(_bounded(check, 1.0) for check in _QUIET)


def _encode(n: Notice) -> str:
    return f"{-1 if n.lost is None else n.lost}|{n.reporter}|{n.text}"


def _decode(raw: bytes) -> Notice:
    lost, reporter, text = raw.decode(errors="replace").split("|", 2)
    return Notice(None if lost == "-1" else int(lost), int(reporter), text)


def post_notice(lost: int | None, reporter: int, text: str, store=None) -> Notice | None:
    """Post "rank ``lost`` is lost" unless a notice is already there; returns the notice that
    stands (the earlier one, or this), None when the store cannot be reached."""
    store = store or _store()
    if store is None:
        return None
    raw = _bounded(lambda: store.compare_set(_NOTICE, "", _encode(Notice(lost, reporter, text))))
    return _decode(raw) if raw else None


def read_notice(store=None, bounded: bool = True) -> Notice | None:
    store = store or _store()
    if store is None:
        return None

    def get():
        return _decode(store.get(_NOTICE)) if store.check([_NOTICE]) else None

    return _bounded(get) if bounded else get()


def clear_notice(store=None) -> None:
    """Forget a posted notice (after the job has recovered on the same store)."""
    store = store or _store()
    if store is not None:
        _bounded(lambda: store.delete_key(_NOTICE))


def store_lost(me: int, what: str) -> RankLost:
    """The error when the c10d store does not answer: under env:// rendezvous rank 0 hosts it."""
    return RankLost(f"rank 0 lost: rank {me}: {what}: the c10d store does not answer; rank 0 (which hosts it under "
                    f"env:// rendezvous) or the launcher's agent is probably lost", lost=0)


def check_in(store, name: str, me: int, ranks, deadline: float | None, what: str) -> None:
    """Say "rank ``me`` is here" under key ``name`` and wait until every rank of ``ranks`` has
    said so, at most ``deadline`` seconds (None: wait as long as the store's own timeout).  A
    rank that never comes is named: RankLost, posted as the notice (or the notice's rank, when
    another rank found a loss first)."""
    key = f"{PREFIX}/{name}"
    if _bounded(lambda: store.set(f"{key}/{me}", "1") or True) is None:
        raise store_lost(me, what)
    pending = [r for r in ranks if r != me]
    dead = []
    end = time.monotonic() + (deadline if deadline is not None else store.timeout.total_seconds())
    while True:
        got = _bounded(lambda: [r for r in pending if not store.check([f"{key}/{r}"])])
        if got is None:
            raise store_lost(me, what)
        pending = got
        if not pending:
            return
        dead = [r for r in pending if gone(r, store)]
        if dead:  # its process has ended on this host: it will never arrive
            pending = dead
            break
        notice = read_notice(store)
        if notice is not None and notice.lost is not None and notice.lost != me:
            raise RankLost(f"rank {notice.lost} lost ({notice.text}); then rank {me}: {what} failed", lost=notice.lost)
        if time.monotonic() > end:
            break
        time.sleep(0.05)
    names = ", ".join(map(str, pending))
    if dead:
        text = f"rank {me}: {what}: the process of rank{'s' if len(pending) > 1 else ''} {names} has ended"
    else:
        text = (f"rank {me}: {what}: rank{'s' if len(pending) > 1 else ''} {names} did not arrive within "
                f"{deadline if deadline is not None else store.timeout.total_seconds():g} s")
    earlier = post_notice(pending[0], me, text, store=store)
    if earlier is not None and earlier.reporter != me and earlier.lost not in (None, me):
        raise RankLost(f"rank {earlier.lost} lost ({earlier.text}); then {text}", lost=earlier.lost)
    raise RankLost(f"rank{'s' if len(pending) > 1 else ''} {names} lost: {text}. It was killed, crashed, is stuck "
                   f"or skipped this call: see its log.", lost=pending[0])


# --- waiting on point-to-point ops and collectives ---------------------------------------------

@dataclass(frozen=True)
class Op:
    """What a group of works is, for the error message.  ``peers``: one (role, global rank) per
    work when each work talks to one peer ("send to", 3), empty for a collective."""

    what: str
    peers: tuple = ()
    blocking: bool = True  # the backend blocks the host in wait(): a deadline can be enforced
    group_ranks: tuple = ()
    deadline: float | None = None  # seconds a blocking wait may take (None: the group's own timeout)
    group: object = None  # the collective's group: aborted on a failure, so its other waiters fail too


def _me() -> int:
    return rank_of()


def _reason(e: BaseException) -> str:
    s = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if s.startswith("[") and "] " in s:  # gloo's "[/path/pair.cc:537] Read error ..."
        s = s.split("] ", 1)[1]
    return s.split(". This is typically")[0].rstrip(".")


def _window(deadline: float | None) -> float:
    """Seconds a census gives the other ranks to report."""
    return min(3.0, max(0.5, (deadline or 8.0) / 4))


def describe(op: Op, index: int, n: int, e: BaseException, deadline: float | None) -> RankLost:
    """:func:`_describe`, and on rank 0 (the host of the c10d store under env:// rendezvous) a
    pause before the error goes up: the process that raises it usually exits, taking the store
    with it, and the other ranks, failing a moment later, still need it to read the notice
    and run their census (else they blame whichever neighbour left first)."""
    lost = _describe(op, index, n, e, deadline)
    st = _store()
    if st is not None:  # this process is about to leave, having said why: not the rank to blame
        me = _me()
        _bounded(lambda: st.set(f"{PREFIX}/left/{me}", "1"), 1.0)
    if _me() == 0:
        # a rank waiting on a transfer from this one would otherwise wait out the pause, then
        # find the store gone with this process: end those transfers now, so it fails (and
        # takes its census) while the store is still up
        if op.group is not False:
            _bounded(lambda: (op.group or dist.group.WORLD).abort(), 2.0)
        time.sleep(_window(deadline) + 1.0)
    return lost


def _describe(op: Op, index: int, n: int, e: BaseException, deadline: float | None) -> RankLost:
    """The RankLost for work ``index`` of ``n`` in ``op`` failing with ``e``: names the peer,
    posts a notice when this rank is the first to see a loss, and names the root cause when
    another rank posted one first."""
    me = _me()
    if op.peers and len(op.peers) == n:
        roles = [op.peers[index]]
    else:
        roles = list(dict.fromkeys(op.peers))
    peers = sorted({p for _, p in roles})
    reason = _reason(e)
    if "timed out" in reason.lower() or "timeout" in reason.lower():
        reason = f"no answer within {deadline:g} s" if deadline else reason

    if roles:
        here = f"rank {me}: {op.what}: " + " and ".join(f"{role} rank {p}" for role, p in roles) + f" failed ({reason})"
    else:
        here = f"rank {me}: {op.what} failed ({reason})"
    blame = peers[0] if len(peers) == 1 else None
    # a failure names no one for sure: after a timeout the peer may itself be waiting on
    # another rank, a peer that closed the connection may have left on its own error, and a
    # failed collective names an address (gloo): naming the peer could blame an innocent
    # neighbour, so ask who is waiting on whom (a peer that died never answers: the chain
    # ends there)
    found = _census(op, me, blame, deadline)
    if found == STORE_DOWN:
        return store_lost(me, f"{op.what} failed ({reason})")
    if found == me:
        if blame is None:  # this rank waits in a collective, the others in the ring
            here += ("; this rank is the odd one: the other ranks wait in a ring transfer it did not join (it "
                     "skipped a backward, or a call they made)")
        else:
            here += ("; this rank is the odd one: the other ranks wait in a collective it did not join "
                     "(BURST_CHECKS=local on it alone, or a call they made and it did not)")
        blame = found
    elif found is not None and found != blame:
        here += f"; rank {found} is the one the waiting ranks wait on"
        blame = found
    earlier = read_notice()
    if earlier is not None and earlier.reporter != me and earlier.lost != me:
        if earlier.lost is None:
            if blame is not None:
                return RankLost(f"rank {blame} lost: {here}; earlier, {earlier.text}", lost=blame, peer=blame)
            return RankLost(f"{here}; earlier, {earlier.text}", lost=None, peer=blame)
        return RankLost(f"rank {earlier.lost} lost ({earlier.text}); then {here}", lost=earlier.lost, peer=blame)
    if blame is not None:
        post_notice(blame, me, here)
        return RankLost(f"rank {blame} lost: {here}. It was killed, crashed or is stuck: see its log.",
                        lost=blame, peer=blame)
    post_notice(None, me, here)
    return RankLost(f"{here}. A rank of the group died, is stuck, skipped this call or called it with "
                    f"another group.", lost=None, peer=None)


_WAITING = f"{PREFIX}/waiting"
STORE_DOWN = -2  # _census: the c10d store does not answer


def _census(op: Op, me: int, peer: int | None, deadline: float | None) -> int | None:
    """After a timeout: post whom this rank waits on (``peer``; -1 for a collective), give the
    other ranks a moment to post theirs, and name the rank at the end of the chain of waits,
    the one that is not itself waiting here (it died, froze, skipped the call or is in another
    one).  For a collective, the only rank of its group that posted nothing.  None when the
    store cannot tell (unreachable, several candidates, a cycle)."""
    st = _store()
    if st is None:
        return None
    # a set may not wait for the store's answer: a check does, so it tells whether the store is up
    mine = f"{_WAITING}/{me}"
    if _bounded(lambda: st.set(mine, str(-1 if peer is None else peer)) or st.check([mine])) is None:
        return STORE_DOWN
    if peer is None and op.group is not False:
        # a collective that failed here leaves its other ranks waiting on ranks that are alive
        # (gloo's ring algorithms): abort the group, so they fail now and report in this window
        _bounded(lambda: (op.group or dist.group.WORLD).abort(), 2.0)
    ranks = list(op.group_ranks) or (list(range(dist.get_world_size())) if dist.is_initialized() else [])
    # a peer whose process has ended (on this host) is the answer, whatever the others post
    if peer is not None and gone(peer, st):
        return peer
    dead = [r for r in ranks if r != me and gone(r, st)]
    if len(dead) == 1:
        return dead[0]
    window = _window(deadline)
    start = time.monotonic()
    end = start + window
    # a rank at the end of the chain that has posted nothing but still heartbeats is alive and waiting
    # somewhere: it will post when its own wait times out.  Over NCCL those timeouts come on each
    # rank's watchdog beat, seconds apart, so the census waits for it (up to the deadline, at most 15 s) rather
    # than blame a neighbour that is merely slower to notice; capped, as a rank stuck in a loop
    # beats on and never posts (its neighbours then name it late, not never)
    last = start + max(window, min(deadline or 8.0, 15.0))

    def read(r):
        return _bounded(lambda: st.get(f"{_WAITING}/{r}").decode() if st.check([f"{_WAITING}/{r}"]) else None)

    def beat(r):
        return _bounded(lambda: st.get(_beat_key(r)) if st.check([_beat_key(r)]) else None, 1.0)

    beats = {r: beat(r) for r in ranks if r != me}
    while True:
        posts = {r: read(r) for r in ranks if r != me}
        # who waits in a collective (-1) and who in the ring (a peer), this rank included
        in_coll = [r for r, v in posts.items() if v is not None and int(v) < 0] + ([me] if peer is None else [])
        in_ring = [r for r, v in posts.items() if v is not None and int(v) >= 0] + ([me] if peer is not None else [])
        if peer is not None:
            seen, r = {me}, peer
            while r not in seen:
                seen.add(r)
                v = posts.get(r)
                if v is None:
                    break  # r waits on no one here: the end of the chain
                if int(v) < 0:
                    # r waits in a collective while this rank waits in the ring: the odd one is
                    # the side with fewer ranks (a rank past an argument check the others wait
                    # in, BURST_CHECKS=local on it alone; or one that skipped a backward and
                    # waits in the next call's check); as many on each side: r
                    if len(in_ring) < len(in_coll):
                        r = me if in_ring == [me] else None
                    elif len(in_coll) > 1 and len(in_ring) > len(in_coll):
                        r = None
                    break
                r = int(v)
            else:
                r = None  # a cycle: every rank waits on the next
            silent = [q for q, v in posts.items() if v is None]
            if r is None and not silent and len(in_coll) == 1 and len(in_ring) > 1:
                # the ring's waits form a cycle (an exchange with every rank names one peer of
                # many): the one rank waiting in a collective instead is the one that left the ring
                r = in_coll[0]
            culprit = r
        else:
            silent = [r for r, v in posts.items() if v is None]
            culprit = silent[0] if len(silent) == 1 else None
            if not silent and len(in_ring) == 1 and len(in_coll) > 1:
                culprit = in_ring[0]  # the one rank in the ring while the others wait here
            elif not silent and in_coll == [me] and in_ring:
                # the others all wait in the ring, this rank alone here: it is the one that left
                # the ring (skipped a backward: its heartbeat goes on), as the ring side sees it
                culprit = me
        now = time.monotonic()
        if now >= end:
            waiting_for = (peer is not None and culprit is not None and culprit != me and posts.get(culprit) is None
                           and now < last and beat(culprit) not in (None, beats.get(culprit), _DONE, _EXIT))
            if not waiting_for:
                return culprit
        time.sleep(0.1)


# --- waits the host does not block in (NCCL), bounded by the watchdog --------------------------

# (when queued, op, works) of each wait on non-blocking works, oldest first; None while no
# watchdog runs, so that wait() then costs one global read.  Capped: past it the oldest goes (a
# transfer queued after a stuck one is stuck behind it, so the newest still tells the hang).
# A work stays here until it is complete (its buffers are in use until then anyway) and is
# dropped at the next wait or watchdog beat after: its buffers may outlive it by that much
_QUEUED: deque | None = None
_QUEUED_CAP = 1024
_QUEUED_LOCK = threading.Lock()
_WATCHDOGS = [0]  # watchdogs running in this process
# when a queued work was last seen complete: a wait is overdue only when nothing has completed
# for the timeout either, so a long but moving GPU queue (the host runs ahead of minutes-long
# steps at long context) is progress, not a hang
_LAST_DONE = [0.0]


def _watch_queued(on: bool) -> None:
    """A watchdog starts (``on``) or stops: keep the registry while at least one runs."""
    global _QUEUED
    with _QUEUED_LOCK:
        _WATCHDOGS[0] += 1 if on else -1
        if _WATCHDOGS[0] > 0 and _QUEUED is None:
            _QUEUED = deque(maxlen=_QUEUED_CAP)
            _LAST_DONE[0] = time.monotonic()
        elif _WATCHDOGS[0] <= 0:
            _WATCHDOGS[0], _QUEUED = 0, None


def _capturing() -> bool:
    # a work queued in a CUDA graph capture has no completion the host can query
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _queue(works, op: Op) -> None:
    """Keep a non-blocking wait for the watchdog, dropping the oldest ones already complete."""
    q = _QUEUED
    if q is None or not works or _capturing():
        return
    with _QUEUED_LOCK:
        _drop_done(q)
        q.append((time.monotonic(), op, tuple(works)))


def _drop_done(q) -> None:
    while q and all(w.is_completed() for w in q[0][2]):
        q.popleft()
        _LAST_DONE[0] = time.monotonic()


def _overdue(timeout: float):
    """The oldest queued wait still not complete ``timeout`` seconds after it was queued, with
    no queued wait completed in those seconds either, as (op, works), else None; complete ones
    at the front are dropped."""
    q = _QUEUED
    if q is None:
        return None
    with _QUEUED_LOCK:
        _drop_done(q)
        if q and time.monotonic() - max(q[0][0], _LAST_DONE[0]) > timeout:
            return q[0][1], q[0][2]
    return None


def _unanswered(op: Op, works, timeout: float) -> RankLost:
    """The :class:`RankLost` of a queued wait that outlived ``timeout``, as :func:`wait` raises
    for one that timed out on gloo: the census names the rank at the end of the chain of waits.
    The op's group is not aborted (this runs beside the main thread, whose kernels may still
    use it); the process is about to end anyway."""
    i = next((i for i, w in enumerate(works) if not w.is_completed()), 0)
    if op.peers and len(op.peers) != len(works):
        # one work for the whole batch (NCCL coalesces a batch's P2P ops): it waits on the rank
        # it receives from, if any (a send waits on its receiver, which then waits on its own)
        role = next((p for p in op.peers if p[0] == "receiving from"), op.peers[0])
        op, works, i = replace(op, peers=(role,)), (works[i],), 0
    return describe(replace(op, group=False), i, len(works), TimeoutError("timed out"), timeout)


def wait(works, op: Op) -> None:
    """Wait for every work; a failure or a missed deadline raises :class:`RankLost`.  A wait
    the host does not block in (``op.blocking`` False: NCCL) is queued for the watchdog."""
    if _QUEUED is not None and not op.blocking:
        _queue(works, op)
    deadline = op.deadline if op.blocking else None
    for i, w in enumerate(works):
        try:
            if deadline is None:
                w.wait()
            else:
                w.wait(timedelta(seconds=deadline))
        except Exception as e:
            raise describe(op, i, len(works), e, deadline) from e


def post(start, op: Op):
    """``start()`` (e.g. ``lambda: dist.batch_isend_irecv(ops)``); a peer already gone when
    the ops are posted raises :class:`RankLost` too."""
    if not _ANNOUNCED:
        announce()
    try:
        return start()
    except Exception as e:
        raise describe(op, 0, 0, e, None) from e


# --- the watchdog ------------------------------------------------------------------------------

_BACKSTOP: list = []  # the Watchdog whose fault armed faulthandler's backstop (one timer a process)


def _stderr_fd() -> int:
    """The file descriptor of stderr for faulthandler: sys.stderr's, else the interpreter's own,
    else 2.  sys.stderr may have none (a notebook's stream, redirect_stderr(StringIO())), and
    faulthandler refuses such a file with an exception that would end the watchdog's thread
    before it ends the process."""
    for f in (sys.stderr, sys.__stderr__):
        try:
            return f.fileno()
        except (AttributeError, ValueError, OSError):
            pass
    return 2


def _end_in(seconds: float, dog: "Watchdog") -> None:
    """End this process ``seconds`` from now, every thread's stack printed on ``dog``'s stderr,
    whatever its Python threads do (faulthandler's own C thread; one timer a process: this
    replaces the one set before)."""
    faulthandler.dump_traceback_later(seconds, exit=True, file=dog._fd if dog._fd is not None else _stderr_fd())


def _arm_backstop(dog: "Watchdog") -> None:
    """End this process ``dog.backstop`` seconds from now (:func:`_end_in`): a fault's backstop."""
    _end_in(dog.backstop, dog)
    _BACKSTOP[:] = [dog]


class Watchdog:
    """Heartbeats through the c10d store and ends this process, naming the lost rank, when a
    rank stops beating for ``timeout`` seconds or any rank posts a fault notice.

        with Watchdog(timeout=60):
            train()

    Every rank of the job runs one, with the same timeout, started right after
    ``init_process_group`` (a rank that has not started beating within ``timeout`` counts as
    lost).  Rank r watches rank r-1 (or, once that rank is done, the rank it watched), and
    whoever sees a loss posts the notice every other watchdog reads within ``interval``.  Cost:
    about four store round trips per ``interval`` per rank.  While it runs, :func:`wait` queues
    the waits the host does not block in (NCCL), and a queued wait still not complete after
    ``timeout`` is a fault too, named by the census of who waits on whom (:func:`_unanswered`).

    On a fault it prints the reason to stderr, waits ``grace`` seconds for the main thread to
    end the process itself (an exception it raised on its own, e.g. :class:`RankLost`), then
    calls ``on_fault(reason)`` if given, else ``os._exit(EXIT_LOST)``; without ``on_fault``, a
    process still alive ``backstop`` seconds after the fault (a thread stuck in a collective, the
    exit path hung) prints every thread's stack and exits with 1 (faulthandler, which needs no
    Python thread to run; a Watchdog started after that one was stopped, as a process that has
    recovered does, disarms it).  Leaving the ``with`` block normally marks this rank done, so
    its watcher does not take a finished rank for a lost one; leaving it on an exception posts a
    notice, so the others stop within ``interval`` instead of waiting for ``timeout``.
    """

    def __init__(self, timeout: float | None = None, interval: float | None = None, grace: float | None = None,
                 *, store=None, rank: int | None = None, world: int | None = None, on_fault=None):
        self.timeout = float(timeout or 300.0)
        self.interval = float(interval or min(1.0, self.timeout / 10))
        self.grace = float(grace if grace is not None else min(5.0, self.timeout / 2))
        self._store, self.rank, self.world, self.on_fault = store, rank, world, on_fault
        self._stop = threading.Event()
        self.handled = threading.Event()
        # rank 0's pause in explain(), which the grace of its own watchdog then covers too
        self.linger = 3 * self.interval + 2.0
        self.handled_at: float | None = None  # when rank 0's pause in explain() began
        # seconds after a fault past which the process is ended whatever its threads do (_fault)
        self.backstop = self.grace + self.linger + 10.0
        self._fd: int | None = None  # stderr's descriptor, found once at start (finding it runs Python)
        self._rearm_at: float | None = None  # when the dead man's switch is next pushed back (_keep_alive)
        self._thread = None
        self.fault: str | None = None
        self.notice: Notice | None = None  # the last notice this watchdog read (the store may go first)

    def start(self) -> "Watchdog":
        if self._store is None:
            self._store = _store()
        if self._store is None:
            raise RuntimeError("Watchdog needs torch.distributed initialised (or a store)")
        if self.rank is None:
            self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._store.set(_beat_key(self.rank), "0")
        if _BACKSTOP and _BACKSTOP[0]._stop.is_set():
            # the watchdog whose fault armed it was stopped (its fault taken over) and this process
            # watches a job again: it has recovered, and is no process to end
            faulthandler.cancel_dump_traceback_later()
            _BACKSTOP.clear()
        announce(self._store)
        self._fd = _stderr_fd()
        self._thread = threading.Thread(target=self._run, name="burstengine-watchdog", daemon=True)
        _watch_queued(True)
        self._thread.start()
        return self

    def stop(self, done: bool = True) -> None:
        """Stop beating.  ``done``: this rank finished; else it is leaving on an error it has
        reported (a notice, or :class:`RankLost` naming another rank): either way its watcher
        and :meth:`explain` take it for gone, not lost."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)
            self._thread = None
            _watch_queued(False)
        if self._rearm_at is not None and not _BACKSTOP:  # this watchdog's switch, not a fault's backstop
            faulthandler.cancel_dump_traceback_later()
        self._rearm_at = None
        if self._store is not None:
            _bounded(lambda: self._store.set(_beat_key(self.rank), _DONE if done else _EXIT))

    def __enter__(self) -> "Watchdog":
        return self.start()

    def __exit__(self, typ, exc, tb) -> None:
        if exc is not None and not isinstance(exc, RankLost):
            # this rank is the one going away: the root cause the others should name
            post_notice(self.rank, self.rank, f"rank {self.rank} failed: {type(exc).__name__}: {exc}",
                        store=self._store)
        self.stop(done=exc is None)

    # --- after an error in the main thread ------------------------------------------------

    def silent_ranks(self, window: float | None = None) -> list[int]:
        """The other ranks whose heartbeat does not move within ``window`` seconds (default
        three beats and a second), finished and reporting ranks excepted.  Returns as soon as
        every other rank has beaten once, so about one ``interval`` when all are alive.  Raises
        what the store raises when it cannot be reached."""
        store, me = self._store, self.rank
        window = 3 * self.interval + 1.0 if window is None else window
        others = [r for r in range(self.world) if r != me]

        def read(r):
            return store.get(_beat_key(r)) if store.check([_beat_key(r)]) else None

        dead = [r for r in others if gone(r, store)]
        if dead:  # their processes have ended: no need to wait for their heartbeats
            return dead
        first = {r: read(r) for r in others}
        pending = {r for r, v in first.items() if v not in (_DONE, _EXIT)}
        end = time.monotonic() + window
        while pending and time.monotonic() < end:
            time.sleep(min(0.1, self.interval / 2))
            notice = read_notice(store, bounded=False)
            if notice is not None and notice.lost is not None and notice.lost != me:
                return [notice.lost]  # another rank has already found it
            for r in sorted(pending):
                v = read(r)
                if v in (_DONE, _EXIT) or (v is not None and v != first[r]):
                    pending.discard(r)
        return sorted(pending)

    def _explain(self, exc: BaseException, what: str = "a collective") -> RankLost | None:
        """The :class:`RankLost` behind ``exc``, an error the main thread caught in ``what``:
        ``exc`` itself when it already names a rank (the ring's own errors); the rank of a fault
        notice; else the ranks whose heartbeats stopped (:meth:`silent_ranks`), posted as the
        notice every other rank will name.  None when every rank is alive: ``exc`` is no lost
        rank's doing, and the caller should re-raise it (leaving the ``with`` block posts it)."""
        me = self.rank
        self.handled_at = None  # its pause (explain) begins once the rank is found, which may take a census
        self.handled.set()  # the main thread reports this fault: the watchdog need not print it
        if isinstance(exc, RankLost) and exc.lost is not None:
            return exc
        here = f"rank {me}: {what} failed ({_reason(exc)})"
        earlier = read_notice(self._store) or self.notice
        if earlier is None or earlier.lost is None or earlier.lost == me:
            t0 = time.monotonic()
            try:
                silent = _bounded(self.silent_ranks, 3 * self.interval + 5.0)
            except Exception:
                silent = None
            if silent is None:  # the store cannot be reached: its host is the likeliest loss
                return RankLost(f"{here}, and the c10d store does not answer: rank 0 (which hosts it under "
                                f"env:// rendezvous) or the launcher's agent is probably lost", lost=None)
            if not silent:
                self.handled.clear()
                return None
            names = ", ".join(map(str, silent))
            text = (f"{here}; rank{'s' if len(silent) > 1 else ''} {names} sent no heartbeat in the "
                    f"{time.monotonic() - t0:.0f} s after")
            earlier = post_notice(silent[0], me, text, store=self._store)
            if earlier is None or earlier.reporter == me:
                return RankLost(f"rank{'s' if len(silent) > 1 else ''} {names} lost: {text}. It was killed, crashed "
                                f"or is stuck: see its log.", lost=silent[0])
        return RankLost(f"rank {earlier.lost} lost ({earlier.text}); then {here}", lost=earlier.lost)

    def explain(self, exc: BaseException, what: str = "a collective") -> RankLost | None:
        """:meth:`_explain`; on rank 0, the c10d store's host under env:// rendezvous, after a
        pause that lets the other ranks finish their census before this process (and the store
        with it) goes."""
        lost = self._explain(exc, what)
        if self.rank == 0 and lost is not None:
            self.handled_at = time.monotonic()  # the watchdog's _fault waits out what is left of this pause
            time.sleep(self.linger)  # the store's host: let the others finish their census first
        return lost

    def _keep_alive(self) -> None:
        """The dead man's switch: unless this thread runs again within 2 x (timeout + backstop)
        seconds, faulthandler's C thread prints every thread's stack and ends the process (exit 1).
        The backstop a fault arms covers a thread that stops running Python after it saw the
        fault; this covers one starved before it could see it (another thread holding the
        interpreter from a store call on: every call here lets go of it).  Never earlier than
        timeout + backstop: by then the other ranks have counted this one lost.  Pushed back
        every half span, not every beat (each push starts a new C thread)."""
        if self.on_fault is not None or _BACKSTOP or self._stop.is_set():  # a caller's own handling, a
            return  # fault's backstop, or stopping (stop() cancels the switch after this thread ends)
        now = time.monotonic()
        if self._rearm_at is None or now >= self._rearm_at:
            span = 2 * (self.timeout + self.backstop)
            _end_in(span, self)
            self._rearm_at = now + span / 2

    def _run(self) -> None:
        store, me = self._store, self.rank
        pred = (me - 1) % self.world
        beat, seen, since, store_down = 0, None, time.monotonic(), None
        self._keep_alive()
        while not self._stop.wait(self.interval):
            self._keep_alive()
            now = time.monotonic()
            try:
                beat += 1
                store.set(_beat_key(me), str(beat))
                notice = read_notice(store, bounded=False)
                if notice is not None:
                    self.notice = notice
                    if notice.lost is None:
                        return self._fault(f"fault reported: {notice.text}")
                    return self._fault(f"rank {notice.lost} lost ({notice.text})")
                late = _overdue(self.timeout)
                if late is not None:  # a transfer the host did not wait for (NCCL) never came
                    return self._fault(str(_unanswered(*late, self.timeout)))
                while pred != me and store.check([_beat_key(pred)]):
                    v = store.get(_beat_key(pred))
                    if v not in (_DONE, _EXIT):
                        if v != seen:
                            seen, since = v, now
                        break
                    # finished cleanly: watch the rank it watched instead, so none goes unwatched
                    pred, seen, since = (pred - 1) % self.world, None, now
                if pred == me:
                    since = None  # every other rank is done
                if since is not None and now - since > self.timeout:
                    text = f"rank {pred} sent no heartbeat for {now - since:.0f} s (watched by rank {me})"
                    post_notice(pred, me, text, store=store)
                    return self._fault(f"rank {pred} lost: {text}")
                store_down = None
            except Exception as e:
                store_down = store_down or now
                if now - store_down > self.timeout:
                    return self._fault(f"the c10d store has been unreachable for {now - store_down:.0f} s ({e}); "
                                       f"the process hosting it (rank 0, or the torchrun agent) is probably lost")

    def _fault(self, reason: str) -> None:
        self.fault = reason
        if self.on_fault is None:
            # a backstop no Python thread has to run: faulthandler's own C thread prints every
            # thread's stack and ends the process if nothing else has within `backstop` seconds.
            # Armed before anything that lets go of the GIL (the line below writes to stderr): on 4
            # GPUs a survivor of a rank killed mid-step printed that line and then never ran Python
            # again, this thread included (another thread held the GIL), so a backstop armed after
            # the print was never armed (H200s and H100s, hung past 45 s)
            _arm_backstop(self)
        hush = quiet()  # the job is being stopped on purpose: its launcher says so, these lines not
        if not self.handled.is_set() and not hush:
            print(f"burstengine watchdog (rank {self.rank}): {reason}", file=sys.stderr, flush=True)
        if self._stop.wait(self.grace):
            return  # the process is handling it
        if self.handled.is_set() and self.rank == 0:
            # the main thread reports it after rank 0's pause in explain(), which began at
            # handled_at, mostly inside the grace just waited: wait for what is left of it only,
            # not a whole linger after the grace.  Not begun yet (explain() still takes its
            # census): a whole one from now.  Counted from the start of explain() instead, a 4 s
            # census ended rank 0 3 s into its 5 s pause.  (On 4 H200s rank 0 still left ~3.5 s
            # after the others: torch's NCCL debug dump on the first rank to time out, not this.)
            # The slack after the pause: half a grace (1 s let a loaded 2-core box's rank 0 exit
            # here, naming the rank, before its main thread printed the resume hint)
            left = (self.handled_at or time.monotonic()) + self.linger + self.grace / 2 - time.monotonic()
            if left > 0 and self._stop.wait(left):
                return
        if self.handled.is_set() and not hush:  # the main thread meant to report it but did not get that far
            print(f"burstengine watchdog (rank {self.rank}): {reason}", file=sys.stderr, flush=True)
        if self.on_fault is not None:
            self.on_fault(reason)
            return
        if not hush:
            print(f"burstengine watchdog (rank {self.rank}): exiting with code {EXIT_LOST}", file=sys.stderr,
                  flush=True)
        os._exit(EXIT_LOST)
