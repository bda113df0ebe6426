"""A rank that dies, freezes or talks on another group mid-job: every other rank exits non-zero,
naming it, within the configured deadline.  Real processes (tests/fault_job.py), started like
torchrun starts them; the three jobs run side by side to share the start-up time."""
import os
import re
import socket
import subprocess
import sys
import threading
import time
import types

import pytest

JOB = os.path.join(os.path.dirname(__file__), "fault_job.py")
# mode -> (world, extra environment, deadline under test in seconds)
JOBS = {
    "kill": (4, {"BURST_TIMEOUT": "10"}, 10.0),
    "stall": (3, {"WATCHDOG_TIMEOUT": "4"}, 4.0),
    "groups": (3, {"BURST_TIMEOUT": "4"}, 4.0),
    "diverge": (4, {"WATCHDOG_TIMEOUT": "5"}, 5.0),
}
VICTIM = 2
GRACE = 2.0  # the watchdog's grace: min(5, timeout / 2)
LIMIT = 240  # a job still running after this long has hung


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stamp(text, tag):
    m = re.search(rf"^{tag} ([0-9.]+)$", text, re.M)
    return float(m.group(1)) if m else None


def run_jobs():
    """Every JOBS mode side by side: {(mode, rank): rc, out, err, end (host clock), hung}.
    burstengine bench fault-times runs this too, for its record of the detection times."""
    procs = {}
    for mode, (world, extra, _) in JOBS.items():
        port = _port()
        for r in range(world):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), VICTIM=str(VICTIM), OMP_NUM_THREADS="1", **extra)
            env.pop("BURST_CHECKS", None)
            procs[mode, r] = subprocess.Popen([sys.executable, JOB, mode], env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.PIPE, text=True)
    ends, t0 = {}, time.time()
    while len(ends) < len(procs) and time.time() - t0 < LIMIT:
        for key, p in procs.items():
            if key not in ends and p.poll() is not None:
                ends[key] = time.time()
        # the frozen victim never exits on its own: end it once the others are gone
        stall = [k for k in procs if k[0] == "stall" and k[1] != VICTIM]
        if all(k in ends for k in stall) and ("stall", VICTIM) not in ends:
            procs["stall", VICTIM].kill()
        time.sleep(0.05)
    out = {}
    for key, p in procs.items():
        if p.poll() is None:
            p.kill()
        stdout, stderr = p.communicate()
        out[key] = dict(rc=p.returncode, out=stdout, err=stderr, end=ends.get(key), hung=key not in ends)
    return out


@pytest.fixture(scope="module")
def jobs():
    return run_jobs()


def _survivors(jobs, mode):
    world = JOBS[mode][0]
    return {r: jobs[mode, r] for r in range(world) if r != VICTIM or mode == "groups"}


def test_killed_rank_is_named_by_every_other_rank(jobs):
    """SIGKILL mid ring step, no watchdog: the ring's errors plus the store notice."""
    died = _stamp(jobs["kill", VICTIM]["out"], "FAULT_AT")
    assert died is not None and jobs["kill", VICTIM]["rc"] == -9
    for r, j in _survivors(jobs, "kill").items():
        assert not j["hung"] and j["rc"] not in (0, None), (r, j["rc"], j["err"][-2000:])
        assert "FINISHED" not in j["out"]
        assert f"RankLost: rank {VICTIM} lost" in j["err"], (r, j["err"][-2000:])
        raised = _stamp(j["out"], "RAISED_AT")
        assert raised is not None and raised - died <= JOBS["kill"][2], (r, raised - died)


def test_frozen_rank_is_named_by_the_watchdogs(jobs):
    """SIGSTOP mid ring step, no ring deadline: the watchdogs see the silence and end the job."""
    froze = _stamp(jobs["stall", VICTIM]["out"], "FAULT_AT")
    assert froze is not None
    timeout = JOBS["stall"][2]
    for r, j in _survivors(jobs, "stall").items():
        assert not j["hung"] and j["rc"] not in (0, None), (r, j["rc"], j["err"][-2000:])
        assert re.search(rf"rank {VICTIM} lost", j["err"]), (r, j["err"][-2000:])
        # detection after `timeout` of silence (+ one interval), then the grace period
        assert j["end"] - froze <= timeout + 1 + GRACE + 15, (r, j["end"] - froze)


def test_rank_that_skips_a_backward_is_named_when_waits_do_not_block(jobs):
    """Rank 2, alive and beating, skips a backward; the ring's waits do not block the host (as
    on NCCL, emulated on gloo with a long group timeout): the watchdogs bound the queued waits
    and every rank, the victim too, exits with 75 naming rank 2 after the timeout, the census
    (a quarter of it), rank 0's pause for the store and the grace."""
    skipped = _stamp(jobs["diverge", VICTIM]["out"], "FAULT_AT")
    assert skipped is not None
    timeout = JOBS["diverge"][2]
    for r, j in {**_survivors(jobs, "diverge"), VICTIM: jobs["diverge", VICTIM]}.items():
        assert not j["hung"] and j["rc"] == fault.EXIT_LOST, (r, j["rc"], j["err"][-2000:])
        assert "FINISHED" not in j["out"]
        assert re.search(rf"burstengine watchdog \(rank {r}\): rank {VICTIM} lost", j["err"]), (r, j["err"][-2000:])
        assert j["end"] - skipped <= timeout + 1 + timeout / 4 + 2 + GRACE + 15, (r, j["end"] - skipped)


def test_ranks_on_different_groups_time_out(jobs):
    """Rank 2 passes a 2-rank subgroup, the others the world: no all-gather can complete, and
    BURST_TIMEOUT turns the would-be hang into an error on every rank."""
    for r, j in _survivors(jobs, "groups").items():
        assert not j["hung"] and j["rc"] not in (0, None), (r, j["rc"], j["err"][-2000:])
        assert "argument check" in j["err"] and "another group" in j["err"] or "earlier" in j["err"], \
            (r, j["err"][-2000:])
        assert "no answer within 4 s" in j["err"], (r, j["err"][-2000:])


# --- in-process pieces: no job, a HashStore stands in for the c10d store --------------------------

import torch.distributed as dist  # noqa: E402

from burstengine.attention import planning  # noqa: E402
from burstengine.comm import fault  # noqa: E402


class _Work:
    def __init__(self, error=None):
        self.error = error

    def wait(self, timeout=None):
        if self.error:
            raise RuntimeError(self.error)


@pytest.fixture
def store(monkeypatch):
    s = dist.HashStore()
    monkeypatch.setattr(fault, "_store", lambda: s)
    monkeypatch.delenv("BURST_TIMEOUT", raising=False)
    return s


def test_failed_receive_names_the_peer_and_posts_a_notice(store):
    op = fault.Op("forward ring shift of k, v", (("sending to", 3), ("receiving from", 1)))
    gloo = "[/x/pair.cc:537] Read error [127.0.0.1]:5: Connection reset by peer. This is typically caused by ..."
    with pytest.raises(fault.RankLost, match=r"^rank 1 lost: rank 0: forward ring shift of k, v: receiving from "
                                             r"rank 1 failed \(Read error \[127.0.0.1\]:5: Connection reset by peer\)"):
        fault.wait([_Work(), _Work(gloo)], op)
    notice = fault.read_notice(store)
    assert (notice.lost, notice.reporter) == (1, 0)
    # a later failure with an innocent neighbour names the rank of the notice
    store.set(fault._NOTICE, fault._encode(fault.Notice(5, 4, "rank 4: receiving from rank 5 failed")))
    with pytest.raises(fault.RankLost, match=r"^rank 5 lost \(rank 4: receiving from rank 5 failed\); then rank 0"
                       ) as e:
        fault.wait([_Work("Connection closed by peer")], fault.Op("backward ring shift of dq", (("sending to", 2),)))
    assert (e.value.lost, e.value.peer) == (5, 2)
    fault.clear_notice(store)
    assert fault.read_notice(store) is None


class _Queued(_Work):
    """A work the host does not block in (NCCL's): complete once the test says so."""

    done = False

    def is_completed(self):
        return self.done


def test_watchdog_bounds_the_waits_the_host_does_not_block_in(store, monkeypatch):
    """NCCL's waits only make the stream wait: while a watchdog runs they are queued, complete
    ones dropped, at most _QUEUED_CAP kept; one not complete after the watchdog's timeout names
    the rank it receives from (one work for a whole batch, as NCCL coalesces it)."""
    op = fault.Op("forward ring shift of k, v", (("sending to", 3), ("receiving from", 1)), blocking=False)
    fault.wait([_Queued()], op)
    assert fault._QUEUED is None  # no watchdog: nothing is kept
    monkeypatch.setattr(fault, "_QUEUED_CAP", 4)
    faults = []
    dog = fault.Watchdog(timeout=0.5, interval=0.05, grace=0.0, store=store, rank=0, world=1,
                         on_fault=faults.append).start()
    for _ in range(3):
        w = _Queued()
        fault.wait([w], op)
        w.done = True
    stuck = [_Queued() for _ in range(10)]
    for w in stuck:
        fault.wait([w], op)
    assert [works for _, _, works in fault._QUEUED] == [(w,) for w in stuck[-4:]]
    time.sleep(0.3)
    assert faults == []  # not yet past the timeout
    deadline = time.time() + 10
    while not faults and time.time() < deadline:
        time.sleep(0.05)
    assert faults and faults[0].startswith("rank 1 lost: rank 0: forward ring shift of k, v: receiving from rank 1 "
                                           "failed (no answer within 0.5 s)"), faults
    dog.stop(done=False)
    assert fault._QUEUED is None


def test_watchdog_takes_a_moving_queue_for_progress():
    """Waits queued together behind a long GPU queue (the host runs ahead of a long step): the
    second is not overdue while the first completed less than the timeout ago, only once nothing
    has completed for the timeout."""
    op = fault.Op("forward ring shift of k, v", (("sending to", 3), ("receiving from", 1)), blocking=False)
    fault._watch_queued(True)  # as a running watchdog does
    try:
        first, second = _Queued(), _Queued()
        fault.wait([first], op)
        fault.wait([second], op)
        time.sleep(0.4)
        first.done = True
        assert fault._overdue(0.6) is None  # sees the first complete
        time.sleep(0.4)  # 0.8 s since both were queued, 0.4 s since the first completed
        assert fault._overdue(0.6) is None
        time.sleep(0.35)
        late = fault._overdue(0.6)
        assert late is not None and late[1] == (second,)
    finally:
        fault._watch_queued(False)
    assert fault._QUEUED is None


def test_timeout_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv("BURST_TIMEOUT", "2.5")
    assert planning.configured_timeout() == 2.5
    for bad in ("soon", "-1", "0"):
        monkeypatch.setenv("BURST_TIMEOUT", bad)
        with pytest.raises(ValueError, match="BURST_TIMEOUT"):
            planning.configured_timeout()


def test_watchdog_names_a_silent_rank_and_not_a_finished_one(store):
    faults = []
    dogs = [fault.Watchdog(timeout=0.6, interval=0.05, grace=0.0, store=store, rank=r, world=3,
                           on_fault=lambda msg, r=r: faults.append((r, msg))) for r in range(3)]
    for d in dogs:
        d.start()
    time.sleep(0.5)
    dogs[0].stop()  # finished cleanly: rank 1 (its watcher) must not take it for lost
    time.sleep(1.0)
    assert faults == []
    dogs[2]._stop.set()  # rank 2 goes silent without saying it is done (as if killed)
    deadline = time.time() + 10
    while len(faults) < 1 and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    dogs[1].stop(done=False)
    assert faults and all("rank 2 lost" in msg for _, msg in faults), faults
    # rank 0, rank 2's watcher, had finished: rank 1 took over watching rank 2
    assert {r for r, _ in faults} == {1}


def test_explain_names_the_rank_whose_heartbeat_stopped(store):
    """What `burstengine train` does with an error a collective raised (gloo names an address,
    not a rank): the census of heartbeats names the dead rank, not one that left knowingly."""
    dogs = [fault.Watchdog(timeout=30, interval=0.05, grace=0.0, store=store, rank=r, world=4,
                           on_fault=lambda msg: None) for r in range(4)]
    for d in dogs:
        d.start()
    time.sleep(0.3)
    dogs[2]._stop.set()       # killed: stops beating without a word
    dogs[3].stop(done=False)  # left on an error it reported: gone, not lost
    gloo = "[/x/pair.cc:553] Connection closed by peer [127.0.0.1]:5. This is typically caused by ..."
    lost = dogs[0].explain(RuntimeError(gloo), "step 5")
    assert lost.lost == 2, lost
    assert str(lost).startswith("rank 2 lost: rank 0: step 5 failed (Connection closed by peer [127.0.0.1]:5); "
                                "rank 2 sent no heartbeat"), lost
    # a later failure names the rank of the notice, without a census of its own
    later = dogs[1].explain(RuntimeError("Read error: Connection reset by peer"), "step 5")
    assert later.lost == 2 and str(later).startswith("rank 2 lost (rank 0: step 5 failed"), later
    # the ring's own RankLost already names its peer
    ring = fault.RankLost("rank 2 lost: ...", lost=2, peer=2)
    assert dogs[1].explain(ring) is ring
    for d in dogs:
        d.stop(done=False)


def test_explain_is_none_when_every_rank_is_alive(store):
    dogs = [fault.Watchdog(timeout=30, interval=0.05, grace=0.0, store=store, rank=r, world=3,
                           on_fault=lambda msg: None) for r in range(3)]
    for d in dogs:
        d.start()
    time.sleep(0.2)
    assert dogs[1].explain(ValueError("a bug on rank 1"), "step 1") is None
    assert not dogs[1].handled.is_set() and fault.read_notice(store) is None
    for d in dogs:
        d.stop()


def test_gone_tells_an_ended_process_on_this_host(store):
    """A rank's announced process that has ended (here: a child that exited) is gone; this
    process, one on another host or pid namespace, one that left having reported, or one that
    never announced, are not: gone() must never blame a rank it cannot see."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    host, ns, _ = fault._process_id().rsplit(" ", 2)
    store.set(f"{fault.PREFIX}/pid/1", f"{host} {ns} {child.pid}")
    store.set(f"{fault.PREFIX}/pid/2", f"{host} {ns} {os.getpid()}")
    store.set(f"{fault.PREFIX}/pid/3", f"elsewhere {ns} {child.pid}")
    store.set(f"{fault.PREFIX}/pid/4", f"{host} pid:[1] {child.pid}")
    store.set(f"{fault.PREFIX}/pid/5", f"{host} {ns} {child.pid}")
    store.set(f"{fault.PREFIX}/left/5", "1")
    assert [r for r in range(7) if fault.gone(r, store)] == ([1] if ns != "-" else [])
    # a collective's census names the one ended process at once, whatever the others post
    op = fault.Op("an all-gather", group_ranks=(0, 1, 2), group=False)
    assert fault._census(op, 0, None, 8.0) == (1 if ns != "-" else None)


def test_census_names_the_rank_that_left_an_exchange_with_every_rank(store):
    """Over NCCL a rank that skipped a backward waits in the next call's all-gather while the others
    wait in the backward ring's exchange with every rank, each naming one peer of many: their waits
    form a cycle, and the census names the one rank waiting in a collective (it blamed the first
    peer of rank 0's list on 4 H100s, faults_4gpu_nccl_skip_backward.json)."""
    op = fault.Op("the backward ring's shared key component", (("receiving from", 1),), group_ranks=(0, 1, 2, 3),
                  group=False)
    for r, v in ((1, 0), (2, 0), (3, -1)):
        store.set(f"{fault.PREFIX}/waiting/{r}", str(v))
    assert fault._census(op, 0, 1, 2.0) == 3


def test_census_waits_for_a_beating_rank_to_say_where_it_waits(store):
    """The chain ends at a rank that has posted nothing yet but still heartbeats: the census waits
    (up to the deadline) for its post instead of blaming it; a rank whose heartbeat stands still is
    named when the window ends."""
    op = fault.Op("forward ring shift of k, v", (("receiving from", 1),), group_ranks=(0, 1, 2), group=False)
    store.set(f"{fault.PREFIX}/waiting/2", "-1")
    stop = threading.Event()

    def rank1():  # beats every 0.1 s; its own wait times out 1.5 s in (after the census window of 0.5 s)
        t0, n = time.monotonic(), 0
        while not stop.is_set():
            n += 1
            store.set(fault._beat_key(1), str(n))
            if time.monotonic() - t0 > 1.5:
                store.set(f"{fault.PREFIX}/waiting/1", "2")
            time.sleep(0.1)

    store.set(fault._beat_key(1), "0")
    t = threading.Thread(target=rank1, daemon=True)
    t.start()
    try:
        assert fault._census(op, 0, 1, 2.0) == 2
    finally:
        stop.set()
        t.join()
    store.delete_key(f"{fault.PREFIX}/waiting/1")
    t0 = time.monotonic()
    assert fault._census(op, 0, 1, 2.0) == 1  # no beat: named when the window ends
    assert time.monotonic() - t0 < 1.5


def test_rank_0_waits_out_what_is_left_of_its_linger_after_the_grace(store):
    # rank 0's main thread pauses `linger` s in explain() (from handled_at) before it reports; its
    # watchdog, which found the fault at the same time, waits `grace` and then only what is left of
    # that pause (a whole linger after the grace made rank 0 leave 3.5 s after the others on GPUs)
    ended = []
    d = fault.Watchdog(timeout=30, interval=0.5, grace=2.0, store=store, rank=0, world=2, on_fault=ended.append)
    waits = []
    d._stop = types.SimpleNamespace(wait=lambda t: waits.append(t) or False)  # never told to stop
    d.handled_at = time.monotonic() - 1.0  # explain() began a second ago
    d.handled.set()
    d._fault("rank 1 lost")
    assert waits[0] == d.grace and len(waits) == 2 and d.linger - 0.1 < waits[1] <= d.linger, waits
    assert ended == ["rank 1 lost"]
    waits.clear()
    d.handled_at = time.monotonic() - 100.0  # its pause is long over: nothing more to wait for
    d._fault("rank 1 lost")
    assert waits == [d.grace] and ended == ["rank 1 lost"] * 2


def test_a_process_still_alive_after_a_fault_is_ended_by_the_backstop():
    # the main thread took the fault over (stop set: the watchdog thread returns) and then hangs:
    # faulthandler's thread prints the stacks and ends the process after `backstop` seconds
    code = (
        "import time\n"
        "from burstengine.comm import fault\n"
        "d = fault.Watchdog(timeout=2, interval=0.1, grace=0.1, store=object(), rank=1, world=2)\n"
        "d.backstop = 1.0\n"
        "d._stop.set()\n"
        "d._fault('rank 0 lost (a test)')\n"
        "print('HANGING', flush=True)\n"
        "time.sleep(60)\n"
    )
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert p.returncode == 1 and "HANGING" in p.stdout, (p.returncode, p.stdout, p.stderr[-2000:])
    assert "burstengine watchdog (rank 1): rank 0 lost (a test)" in p.stderr
    assert "most recent call first" in p.stderr and 'File "<string>", line 8' in p.stderr  # the sleep
    assert time.monotonic() - t0 < 40


def test_the_backstop_is_armed_before_the_watchdog_lets_go_of_the_gil():
    # on 4 GPUs a survivor printed the watchdog's line and never ran Python again (another thread
    # held the GIL): the backstop, armed after that print, was never armed and the rank hung.  Here
    # the write itself never gives the GIL back (a C sleep that keeps it): only a backstop armed
    # before it can end the process
    t0 = time.monotonic()
    p = _watchdog_script(
        "import ctypes\n"
        "class Stuck:\n"
        "    def write(self, s):\n"
        "        ctypes.PyDLL(None).sleep(40)\n"
        "    def flush(self):\n"
        "        pass\n"
        "    def fileno(self):\n"
        "        return 2\n"
        "d = fault.Watchdog(timeout=2, interval=0.1, grace=0.1, store=object(), rank=1, world=2)\n"
        "d.backstop = 1.0\n"
        "sys.stderr = Stuck()\n"
        "d._fault('rank 0 lost (a test)')\n", timeout=30)
    _ended_by_faulthandler(p, t0)


# a one-rank watchdog running (for half a second) in a _watchdog_script, its backstop 1 s
_RUNNING = ("import ctypes\n"
            "d = fault.Watchdog(timeout=1, interval=0.1, grace=0.1, store=st, rank=0, world=1)\n"
            "d.backstop = 1.0\n"
            "d.start()\n"
            "time.sleep(0.5)\n")


def test_a_watchdog_starved_before_any_fault_still_ends_its_process():
    # another thread takes the interpreter and never lets go (a C call that keeps the GIL) while
    # the watchdog runs, before any fault: the watchdog's thread never runs again, so nothing it
    # would do on a fault happens; its dead man's switch ends the process after 2 x (timeout +
    # backstop) seconds, stacks printed
    t0 = time.monotonic()
    p = _watchdog_script(
        _RUNNING +
        "ctypes.PyDLL(None).sleep(40)\n"
        "print('NOT ENDED', flush=True)\n", timeout=35)
    assert "NOT ENDED" not in p.stdout, p.stdout
    _ended_by_faulthandler(p, t0)


def _ended_by_faulthandler(p: subprocess.CompletedProcess, started: float, within: float = 25.0) -> None:
    """The script was ended by faulthandler's timer (exit 1, every thread's stack), soon enough."""
    assert p.returncode == 1 and "most recent call first" in p.stderr, (p.returncode, p.stdout, p.stderr[-2000:])
    assert time.monotonic() - started < within


def test_a_stopped_watchdog_leaves_no_dead_mans_switch_behind():
    # a watchdog that stopped normally must not end its process later, however long it then
    # keeps the interpreter (the switch is cancelled with the watchdog)
    p = _watchdog_script(
        _RUNNING +
        "d.stop()\n"
        "ctypes.PyDLL(None).sleep(6)\n"
        "print('ALIVE', flush=True)\n")
    assert p.returncode == 0 and "ALIVE" in p.stdout, (p.returncode, p.stdout, p.stderr[-2000:])


def _watchdog_script(body: str, timeout: float = 60) -> subprocess.CompletedProcess:
    code = ("import io, sys, time\nimport torch.distributed as dist\nfrom burstengine.comm import fault\n"
            "st = dist.HashStore()\n" + body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_the_watchdog_ends_its_process_where_stderr_has_no_file_descriptor():
    # a notebook's stream, redirect_stderr(StringIO()): arming the backstop on such a stderr raised
    # in the watchdog's thread, which then never ended the process (it lived on, exit 0)
    p = _watchdog_script(
        "d = fault.Watchdog(timeout=2, interval=0.05, grace=0.2, store=st, rank=1, world=2).start()\n"
        "sys.stderr = io.StringIO()\n"
        "fault.post_notice(0, 0, 'rank 0 died (a test)', store=st)\n"
        "time.sleep(8)\n"
        "print('STILL ALIVE', flush=True)\n")
    assert p.returncode == fault.EXIT_LOST and "STILL ALIVE" not in p.stdout, (p.returncode, p.stdout, p.stderr)


def test_a_process_that_recovered_from_a_fault_outlives_the_backstop():
    # the main thread took the fault over (its watchdog stopped), the job recovered on the same
    # store and watches again: the first fault's backstop must not end the process later
    p = _watchdog_script(
        "d = fault.Watchdog(timeout=2, interval=0.05, grace=2.0, store=st, rank=1, world=2).start()\n"
        "d.backstop = 1.0\n"
        "fault.post_notice(0, 0, 'rank 0 died (a test)', store=st)\n"
        "while d.fault is None:\n"
        "    time.sleep(0.01)\n"
        "d.stop(done=False)\n"
        "fault.clear_notice(st)\n"
        "with fault.Watchdog(timeout=2, interval=0.05, grace=2.0, store=st, rank=0, world=1):\n"
        "    time.sleep(3)\n"
        "print('RECOVERED', flush=True)\n")
    assert p.returncode == 0 and "RECOVERED" in p.stdout, (p.returncode, p.stdout, p.stderr[-2000:])


def test_rank_0_watchdog_counts_its_linger_from_the_start_of_the_pause(store):
    # explain() first finds the rank (here a census of 1.5 s), then pauses `linger` s: the watchdog,
    # which found the fault at the same moment, must not end rank 0 inside that pause (counted from
    # the start of explain(), it ended it 0.5 s before the pause was over)
    ended = []
    d = fault.Watchdog(timeout=30, interval=0.1, grace=2.0, store=store, rank=0, world=2,
                       on_fault=lambda reason: ended.append(time.monotonic()))
    d.silent_ranks = lambda window=None: (time.sleep(1.5), [1])[1]
    dog = threading.Thread(target=d._fault, args=("rank 1 lost",))
    dog.start()
    lost = d.explain(RuntimeError("Connection reset by peer"), "a collective")
    back = time.monotonic()
    d._stop.set()  # the main thread reports it now and leaves its with block
    dog.join()
    assert lost is not None and lost.lost == 1
    assert not ended or ended[0] >= back, (ended[0] - back)


def test_a_job_being_stopped_reports_no_lost_rank(monkeypatch, capsys):
    # Ctrl-C: the launcher marks the job stopping (fault.quiet_when's check) before it stops the
    # ranks; a rank whose peer was stopped first then fails without a line of its own (seen in a
    # fresh-clone CI run: a watchdog's and a train rank's lines beside the launcher's one)
    def fault_lines(stopping):
        monkeypatch.setattr(fault, "_QUIET", [lambda: stopping])
        ended = []
        d = fault.Watchdog(timeout=30, interval=0.5, grace=0.0, store=object(), rank=1, world=2, on_fault=ended.append)
        d._stop = types.SimpleNamespace(wait=lambda t: False)
        capsys.readouterr()
        d._fault("rank 0 lost (rank 0 failed: SystemExit: 143)")
        assert ended == ["rank 0 lost (rank 0 failed: SystemExit: 143)"]
        return capsys.readouterr().err

    assert "rank 0 lost" in fault_lines(False)
    assert fault_lines(True) == ""
    monkeypatch.setattr(fault, "_QUIET", [lambda: 1 / 0])  # a check that fails (the store gone) is no stop
    assert not fault.quiet()
