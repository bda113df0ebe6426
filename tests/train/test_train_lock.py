"""One run per out_dir: a training run locks its run directory (rank 0, before the job's first
collective but the settings' agreement, which carries the outcome to every rank); a second run,
with any number of ranks and with or without --overwrite, is refused on every rank (exit 2 from
`burstengine train`) naming the holder and touching none of its files; a lock left by a dead
process is taken over with a note; the lock goes when the run ends, on an error, on Ctrl-C."""
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

import hostile_cases
import train_cases as tc
from burstengine.train import runlock
from test_train import _cli
from test_train_fault import WORLD, _train

LIMIT = 180  # a run still going after this long has hung


def _lock_file(run):
    return os.path.join(os.path.realpath(run), runlock.LOCK_NAME)


def _files(run):
    """{path: (size, mtime_ns)} of every file under ``run``."""
    out = {}
    for root, _, names in os.walk(run):
        for n in names:
            st = os.stat(os.path.join(root, n))
            out[os.path.relpath(os.path.join(root, n), run)] = (st.st_size, st.st_mtime_ns)
    return out


def _forge(run, **changes):
    """Write a lock file naming this process, with ``changes``; returns the holder it records."""
    holder = {**runlock.identity(), "token": "forged", **changes}
    os.makedirs(run, exist_ok=True)
    with open(_lock_file(run), "w") as f:
        json.dump(holder, f)
    return holder


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# --- the lock itself ----------------------------------------------------------------------------

def test_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path):
    run = str(tmp_path / "a" / "run")
    # held by a live process of this host (the parent of this one): refused, naming it
    parent = runlock._stat_fields(os.getppid())
    _forge(run, pid=os.getppid(), start_ticks=int(parent[19]), command="burstengine train --config x")
    with pytest.raises(runlock.Held, match=rf"out_dir {run} is in use by another run: pid {os.getppid()} on host "
                                           rf"{socket.gethostname()}, started .*, command 'burstengine train "
                                           rf"--config x' \(lock .*run\.lock\); wait for it to end") as e:
        runlock.acquire(run)
    assert "\n" not in str(e.value) and "cannot be told" not in str(e.value)
    # the same pid, another start time: the pid was reused, the holder is gone
    _forge(run, pid=os.getppid(), start_ticks=int(parent[19]) + 1)
    lock = runlock.acquire(run)
    assert lock.note.startswith(f"took over the lock on {run} left by pid {os.getppid()}")
    assert json.load(open(_lock_file(run)))["token"] == lock.token
    lock.release()
    assert not os.path.exists(_lock_file(run))
    # a process that has ended, and a lock from before a reboot
    for changes in ({"pid": _dead_pid()}, {"boot_id": "another-boot"}):
        _forge(run, **changes)
        lock = runlock.acquire(run)
        assert "which is no longer running" in lock.note, changes
        lock.release()
    # an unreadable lock file left long ago
    with open(_lock_file(run), "w") as f:
        f.write('{"pid": 12')
    os.utime(_lock_file(run), (0, 0))
    lock = runlock.acquire(run)
    assert lock.note == f"took over the unreadable lock file {_lock_file(run)}"
    lock.release()


def test_lock_of_another_host_counts_as_held(tmp_path):
    run = str(tmp_path / "run")
    _forge(run, host="node-7", pid=_dead_pid())
    with pytest.raises(runlock.Held, match=r"pid \d+ on host node-7.*it runs on another host \(or pid namespace\), "
                                           r"so whether it still runs cannot be told here: if it has ended, delete "
                                           r".*run\.lock$"):
        runlock.acquire(run)
    _forge(run, pid_ns="pid:[1]", pid=_dead_pid())
    with pytest.raises(runlock.Held, match="cannot be told here"):
        runlock.acquire(run)


def test_lock_is_reentrant_in_one_process_and_cleans_up(tmp_path):
    run = str(tmp_path / "new" / "run")
    a = runlock.acquire(run)
    b = runlock.acquire(run)  # trainers built one after another in one process
    a.release()
    a.release()  # idempotent
    assert os.path.exists(_lock_file(run))
    b.release()
    assert not os.path.exists(tmp_path / "new")  # made only to hold the lock: removed with it
    # a lock taken over by another process meanwhile is never removed by the old holder
    c = runlock.acquire(run)
    _forge(run, token="theirs")
    c.release()
    assert json.load(open(_lock_file(run)))["token"] == "theirs"


# --- trainers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 4])
def test_trainer_refused_on_every_rank_while_another_run_holds_the_lock(pool, tmp_path, world):
    run = str(tmp_path / "run")
    held = runlock.acquire(run)  # this process is the other run
    try:
        os.makedirs(os.path.join(run, "checkpoints", "step_00000003"))
        with open(os.path.join(run, "metrics.jsonl"), "w") as f:
            f.write('{"kind": "step", "step": 1}\n')
        before = _files(run)
        got = pool.run(tc.fit_error, run, ["cp=0"], world=world)  # fit(overwrite=True)
        assert len(set(got)) == 1 and got[0] is not None, got
        assert f"is in use by another run: pid {os.getpid()} on host {socket.gethostname()}" in got[0], got[0]
        assert "\n" not in got[0]
        assert _files(run) == before  # nothing of the holder's touched
    finally:
        held.release()
    assert pool.run(tc.fit_error, run, ["cp=0"], world=world) == [None] * world
    assert not os.path.exists(_lock_file(run))  # released when fit ended


def test_stale_lock_taken_over_then_released_when_the_settings_do_not_agree(pool, tmp_path):
    """Rank 0 takes the lock (here a dead run's) before the agreement; the agreement's error
    releases it."""
    run = str(tmp_path / "run")
    _forge(run, pid=_dead_pid())
    msgs = pool.run(hostile_cases.settings_disagree, "lr", run, world=4)
    assert "the ranks disagree on lr" in msgs[0], msgs
    assert not os.path.exists(_lock_file(run))


# --- `burstengine train` -------------------------------------------------------------------------

def _args(run, *sets):
    return ["train", "--config", "tiny"] + [a for s in tc.SMALL + ["passkey_symbols=8", "passkey_len=3", "eval_every=0",
                                                                  f"out_dir={run}", *sets] for a in ("--set", s)]


def _start(run, *sets):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return subprocess.Popen([sys.executable, "-m", "burstengine", *_args(run, *sets), "--world", "2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait_for_steps(p, run, steps, ckpt=None):
    t0 = time.monotonic()
    path = os.path.join(run, "metrics.jsonl")
    while time.monotonic() - t0 < LIMIT:
        assert p.poll() is None, p.communicate()[0][-3000:]
        if os.path.exists(path) and sum('"kind": "step"' in line for line in open(path)) >= steps and \
                (ckpt is None or os.path.exists(os.path.join(run, "checkpoints", ckpt))):
            return
        time.sleep(0.2)
    os.killpg(p.pid, signal.SIGKILL)
    raise AssertionError(f"no step {steps} within {LIMIT} s:\n{p.communicate()[0][-3000:]}")


def _parent(pid: int) -> int:
    return int(runlock._stat_fields(pid)[1])  # the field after the state: the parent's pid


def test_cli_second_run_in_one_out_dir_is_refused_then_a_stale_lock_taken_over(tmp_path):
    run = str(tmp_path / "run")
    first = _start(run, "steps=100000", "save_every=3", "log_every=1")
    try:
        _wait_for_steps(first, run, 4, ckpt="step_00000003")
        holder = json.load(open(_lock_file(run)))
        # its rank 0, forked by the first command's fork server (burstengine/processes.py)
        assert _parent(_parent(holder["pid"])) == first.pid
        os.killpg(first.pid, signal.SIGSTOP)  # hold its files still while the others try
        before = _files(run)
        want = (f"burstengine train: error: out_dir {run} is in use by another run: pid {holder['pid']} on host "
                f"{socket.gethostname()}, started {holder['started']}, command 'python -m burstengine train")
        for extra in (["--world", "2"], ["--world", "1", "--overwrite"]):  # any rank count, --overwrite or not
            rc, out = _cli(*_args(run, "steps=2"), *extra)
            assert rc == 2, (extra, out[-3000:])
            assert out.count(want) == 1 and "Traceback" not in out, (extra, out[-3000:])
        assert _files(run) == before
    finally:
        os.killpg(first.pid, signal.SIGKILL)  # a killed run: its lock stays behind
        os.killpg(first.pid, signal.SIGCONT)
        first.communicate()
    assert json.load(open(_lock_file(run)))["pid"] == holder["pid"]
    rc, out = _cli(*_args(run, "steps=2"), "--world", "2", "--overwrite")
    assert rc == 0, out[-3000:]
    assert f"note: took over the lock on {run} left by pid {holder['pid']}" in out, out[-3000:]
    assert "which is no longer running" in out
    with open(os.path.join(run, "metrics.jsonl")) as f:
        assert [r["step"] for r in map(json.loads, f) if r["kind"] == "step"] == [1, 2]
    assert not os.path.exists(_lock_file(run))  # released at the end


def test_cli_ctrl_c_releases_the_lock(tmp_path):
    run = str(tmp_path / "run")
    p = _start(run, "steps=100000")
    try:
        _wait_for_steps(p, run, 2)
        assert os.path.exists(_lock_file(run))
        os.killpg(p.pid, signal.SIGINT)  # what Ctrl-C in its terminal sends
        out = p.communicate(timeout=LIMIT)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert not os.path.exists(_lock_file(run)), out[-3000:]


def test_refused_torchrun_ranks_all_exit_2(tmp_path):
    """Under a launcher, every rank of a refused run (--overwrite too) exits 2: none waits in a
    collective for rank 0, the only one that tried the lock (a rank left waiting would end at
    the run's fault_timeout as "rank 0 lost", exit 75)."""
    run = str(tmp_path / "run")
    held = runlock.acquire(run)
    try:
        got = _train(run, "--overwrite")
        assert len(got) == WORLD
        for r, (rc, out, end) in got.items():
            assert end is not None, f"rank {r} hung:\n{out[-3000:]}"
            assert rc == 2, (r, rc, out[-3000:])
            assert "Traceback" not in out and "lost" not in out, (r, out[-3000:])
        assert f"is in use by another run: pid {os.getpid()}" in got[0][1], got[0][1][-3000:]
        assert os.listdir(run) == [runlock.LOCK_NAME]
    finally:
        held.release()
