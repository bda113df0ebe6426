"""A rank SIGKILLed in the middle of a training step: every other rank of `burstengine train`
exits 75 naming it within the fault timeout, and `--resume` from the last complete checkpoint
gives the very losses of an uninterrupted run.  Real processes, started as torchrun starts them
(RANK, WORLD_SIZE, MASTER_ADDR/PORT; the c10d store on rank 0), 4 gloo ranks as dp 2 x cp 2."""
import json
import os
import socket
import subprocess
import sys
import time

import train_cases as tc
from burstengine.comm.fault import EXIT_LOST

WORLD, VICTIM, KILL_STEP, STEPS, CKPT_EVERY = 4, 2, 5, 6, 3
TIMEOUT = 10.0        # fault_timeout under test
INTERVAL, GRACE = 1.0, 5.0  # the watchdog's at this timeout: min(1, T/10), min(5, T/2)
LIMIT = 180           # a job still running after this long has hung
EXTRA = ["cp=2", f"save_every={CKPT_EVERY}", "eval_every=0", "eval_samples=4", "log_every=1"]


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(run_dir, *flags, env_extra=None):
    """`burstengine train` on WORLD ranks; {rank: (exit code, output, seconds until it ended)}."""
    port = _port()
    args = [a for s in tc.SMALL + ["passkey_symbols=8", "passkey_len=3", f"steps={STEPS}", f"out_dir={run_dir}",
                                   f"fault_timeout={TIMEOUT}"] + EXTRA for a in ("--set", s)]
    procs = []
    for r in range(WORLD):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(WORLD),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", **(env_extra or {}))
        for var in ("BURST_TIMEOUT", "BURST_CHECKS"):
            env.pop(var, None)
        procs.append(subprocess.Popen([sys.executable, "-m", "burstengine", "train", "--config", "tiny", *flags, *args],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    t0, ends = time.monotonic(), {}
    while len(ends) < WORLD and time.monotonic() - t0 < LIMIT:
        for r, p in enumerate(procs):
            if r not in ends and p.poll() is not None:
                ends[r] = time.monotonic() - t0
        time.sleep(0.05)
    out = {}
    for r, p in enumerate(procs):
        if p.poll() is None:
            p.kill()
        out[r] = (p.wait(), p.communicate()[0], ends.get(r))
    return out


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if r["kind"] == "step"]


def test_rank_killed_mid_step_is_named_then_resume_matches_uninterrupted(pool, tmp_path):
    run = str(tmp_path / "run")
    # the victim dies after its forward of step 5, the others go on into the backward's
    # collectives (FSDP's all-gather over all 4 ranks, the cp ring with rank 3)
    killed = _train(run, env_extra={"BURST_FAULT_KILL_IN_STEP": f"{VICTIM}:{KILL_STEP}"})
    rc, out, died = killed[VICTIM]
    assert rc == -9, (rc, out[-3000:])
    for r, (rc, out, end) in killed.items():
        if r == VICTIM:
            continue
        assert end is not None, f"rank {r} hung:\n{out[-3000:]}"
        assert rc == EXIT_LOST, (r, rc, out[-3000:])
        assert f"burstengine train (rank {r}): rank {VICTIM} lost" in out, (r, out[-3000:])
        # the bound: the deadline, a heartbeat, the watchdog's grace, and slack for a loaded machine
        assert end - died <= TIMEOUT + INTERVAL + GRACE + 15, (r, end - died)
        print(f"rank {r}: exit {rc} {end - died:.1f} s after rank {VICTIM} was killed")
    assert "the last complete checkpoint is" in killed[0][1] and "--resume" in killed[0][1]
    ckpts = sorted(os.listdir(os.path.join(run, "checkpoints")))
    assert ckpts == [f"step_{CKPT_EVERY:08d}"], ckpts
    before = _losses(run)

    resumed = _train(run, "--resume")
    for r, (rc, out, _) in resumed.items():
        assert rc == 0, (r, rc, out[-3000:])
    assert f"resumed from {run}/checkpoints/step_{CKPT_EVERY:08d}" in resumed[0][1]

    ref = pool.run(tc.run_steps, str(tmp_path / "ref"), STEPS, EXTRA, world=WORLD)[0]
    ref = [(r["step"], r["loss"]) for r in ref]
    logged = _losses(run)
    assert [s for s, _ in before] == list(range(1, KILL_STEP))
    # the resume dropped the killed run's lines past its checkpoint: every step once
    assert [s for s, _ in logged] == list(range(1, STEPS + 1))
    # bit for bit: the killed run up to its death, and the resumed run from the checkpoint on
    assert before == ref[:KILL_STEP - 1]
    assert logged == ref
    assert len({loss for _, loss in ref}) == STEPS  # the losses move: equality means something
