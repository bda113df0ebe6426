"""How fast a lost rank is named, on CPU/gloo, as a record: the jobs of tests/test_fault.py (a
rank SIGKILLed mid ring step; a rank frozen by SIGSTOP under the watchdog; ranks on different
groups) and the killed training run of tests/test_train_fault.py, each run once with the
tests' settings.  Seconds from the fault to each survivor's error (ring) or exit (watchdog,
train).  The tests assert the bounds; this writes what one run measured.

    python benchmarks/fault_times.py        # -> $BURST_RESULTS or ./burst-results/fault_times_cpu.json
"""
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import test_fault as tf  # noqa: E402
import test_train_fault as ttf  # noqa: E402

from burstengine.records import write_record  # noqa: E402


def main():
    jobs = tf.run_jobs()
    died = tf._stamp(jobs["kill", tf.VICTIM]["out"], "FAULT_AT")
    froze = tf._stamp(jobs["stall", tf.VICTIM]["out"], "FAULT_AT")
    ring_kill = {r: tf._stamp(j["out"], "RAISED_AT") - died for r, j in tf._survivors(jobs, "kill").items()}
    watchdog = {r: j["end"] - froze for r, j in tf._survivors(jobs, "stall").items()}
    groups = {r: j["rc"] for r, j in tf._survivors(jobs, "groups").items()}
    with tempfile.TemporaryDirectory() as d:
        killed = ttf._train(os.path.join(d, "run"), env_extra={"BURST_FAULT_KILL_IN_STEP": f"{ttf.VICTIM}:{ttf.KILL_STEP}"})
    t_kill = killed[ttf.VICTIM][2]
    train = {r: dict(rc=rc, seconds=end - t_kill) for r, (rc, _, end) in killed.items() if r != ttf.VICTIM}
    payload = dict(
        ring_kill=dict(world=tf.JOBS["kill"][0], burst_timeout_s=tf.JOBS["kill"][2], victim=tf.VICTIM,
                       seconds_to_raise=ring_kill),
        watchdog_freeze=dict(world=tf.JOBS["stall"][0], watchdog_timeout_s=tf.JOBS["stall"][2], victim=tf.VICTIM,
                             seconds_to_exit=watchdog),
        different_groups=dict(world=tf.JOBS["groups"][0], burst_timeout_s=tf.JOBS["groups"][2], exit_codes=groups),
        train_kill=dict(world=ttf.WORLD, fault_timeout_s=ttf.TIMEOUT, victim=ttf.VICTIM, step=ttf.KILL_STEP,
                        survivors=train),
    )
    for k, v in payload.items():
        print(k, v)
    print("wrote", write_record("fault_times_cpu", payload))


if __name__ == "__main__":
    main()
