"""`burstengine bench suite-time`: the README's test command, timed, as a record.

    burstengine bench suite-time --out-dir benchmarks/results        # from the checkout's root

Runs ``python -m pytest -q`` (the README's second command) in a child process from the current
directory and records its wall time, the CPU time of it and its children, the core count, and
pytest's summary line (passed / skipped / failed): the README quotes the suite's time from this
record, not from memory.  The machine's other load is recorded too (the 1-minute load average
before and after), since a busy machine stretches the wall time.
"""
from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
import time

from ..records import write_record
from ..tables import Section, fixed, table
from ..usage import command_parser

SUMMARY = re.compile(r"^=*\s*(?P<line>(\d+ (passed|failed|skipped|errors?|deselected|warnings?|xfailed|xpassed)"
                     r"[ ,]*)+.*?in [\d.]+s.*?)\s*=*$")


def build_parser():
    p = command_parser("burstengine bench suite-time", __doc__.split("\n\n")[0])
    p.add_argument("--pytest-args", default="-q", help="arguments to pytest (the README's: -q)")
    p.add_argument("--out-dir", default=None, help="record folder [$BURST_RESULTS or ./burst-results]")
    p.add_argument("--name", default="suite_cpu", help="record name")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not os.path.isdir("tests"):
        print("burstengine bench suite-time: error: run it from the checkout's root (no tests/ here)", file=sys.stderr)
        return 2
    cmd = [sys.executable, "-m", "pytest", *args.pytest_args.split()]
    load0 = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    summary = next((m.group("line") for m in map(SUMMARY.match, reversed(lines)) if m), lines[-1] if lines else "")
    path = write_record(args.name, {"kind": "suite-time", "pytest": " ".join(cmd[1:]), "returncode": proc.returncode,
                                    "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "summary": summary,
                                    "load_before": round(load0, 2), "load_after": round(os.getloadavg()[0], 2)},
                        args.out_dir)
    print(f"{' '.join(cmd[1:])}: {summary} -- wall {wall:.0f} s, CPU {cpu:.0f} s on {os.cpu_count()} cores; "
          f"record: {path}")
    return 0 if proc.returncode == 0 else 1


def render(rec):
    return table(["command", "summary", "wall s", "CPU s", "cores", "load before / after"],
                 [[f"`python {rec['pytest']}`", rec["summary"], fixed(rec["wall_s"], 0), fixed(rec["cpu_s"], 0),
                   str(rec["env"].get("cpu_count", "?")), f"{rec['load_before']} / {rec['load_after']}"]])


def block_suite(records):
    rec = dict(records).get("suite_cpu.json")
    if rec is None:
        return "in docs/results.md."
    counts = re.sub(r"\s+in [\d.]+s.*", "", rec["summary"])
    return (f"{rec['wall_s'] / 60:.0f} minutes on {rec['env'].get('cpu_count', '?')} cores, {counts} "
            f"(`suite_cpu.json`).")


SECTIONS = (Section("The test suite", r"^suite_", render,
                    "`burstengine bench suite-time`: the README's `python -m pytest -q`, timed."),)
BLOCKS = {"suite": block_suite}
