"""How fast a lost rank is named, on CPU/gloo, as a record: the jobs of tests/comm/test_fault.py (a
rank SIGKILLed mid ring step; a rank frozen by SIGSTOP under the watchdog; ranks on different
groups) and the killed training run of tests/train/test_train_fault.py, each run once with the
tests' settings.  Seconds from the fault to each survivor's error (ring) or exit (watchdog,
train).  The tests assert the bounds; this writes what one run measured.

    burstengine bench fault-times      # -> $BURST_RESULTS or ./burst-results/fault_times_cpu.json

It runs the test suite's own jobs, so it needs a source checkout: run it from the repository
root (or name the tests folder with --tests).
"""
import importlib
import importlib.util
import os
import tempfile

from ...testing import suite_on_path
from ..records import OUT_DIR_HELP, write_record
from ..tables import Section, fixed, num, table
from ..usage import command_parser


def _test_modules(tests_dir):
    """tests/comm/test_fault.py and tests/train/test_train_fault.py, imported from a checkout's
    tests folder (they are not part of the installed package)."""
    if os.path.isdir(tests_dir):
        suite_on_path(tests_dir)
    for name in ("test_fault", "test_train_fault"):
        if importlib.util.find_spec(name) is None:
            raise SystemExit(f"burstengine bench fault-times: no {name}.py in {os.path.abspath(tests_dir)} or its "
                             "folders; run it from a source checkout's root or pass --tests DIR")
    return importlib.import_module("test_fault"), importlib.import_module("test_train_fault")


def main(argv=None):
    ap = command_parser("burstengine bench fault-times", __doc__)
    ap.add_argument("--tests", default="tests", help="the checkout's tests folder [tests]")
    ap.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    args = ap.parse_args(argv)
    tf, ttf = _test_modules(args.tests)
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
    print("wrote", write_record("fault_times_cpu", payload, args.out_dir))


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    body = []
    if "ring_kill" in rec:
        r = rec["ring_kill"]
        body.append(["rank SIGKILLed mid ring step", r["world"], f"BURST_TIMEOUT {num(r['burst_timeout_s'])} s",
                      r["victim"], ", ".join(f"rank {k} raised RankLost after {fixed(v, 3)} s"
                                            for k, v in sorted(r["seconds_to_raise"].items()))])
    if "watchdog_freeze" in rec:
        r = rec["watchdog_freeze"]
        body.append(["rank frozen (SIGSTOP) mid step", r["world"], f"watchdog {num(r['watchdog_timeout_s'])} s",
                     r["victim"], ", ".join(f"rank {k} exited after {fixed(v, 2)} s"
                                           for k, v in sorted(r["seconds_to_exit"].items()))])
    if "different_groups" in rec:
        r = rec["different_groups"]
        body.append(["ranks pass different groups", r["world"], f"BURST_TIMEOUT {num(r['burst_timeout_s'])} s",
                     "—", ", ".join(f"rank {k} exit code {v}" for k, v in sorted(r["exit_codes"].items()))])
    if "train_kill" in rec:
        r = rec["train_kill"]
        body.append([f"rank SIGKILLed in training step {r['step']}", r["world"],
                     f"fault_timeout {num(r['fault_timeout_s'])} s", r["victim"],
                     ", ".join(f"rank {k} exit {v['rc']} after {fixed(v['seconds'], 2)} s"
                               for k, v in sorted(r["survivors"].items()))])
    return table(["fault", "world", "deadline", "victim", "what the others did (seconds after the fault)"], body)


SECTIONS = (Section("Fault times", r"^fault_times", render,
                    "`burstengine bench fault-times`: the fault jobs of the tests, timed once."),)
