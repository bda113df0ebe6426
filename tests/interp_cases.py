"""Run a tests/ script of Triton-interpreter cases in a subprocess and return the JSON its last
line prints: TRITON_INTERPRET and tests/triton_interp.py's fixes must come before the first
triton import, which this pytest process may already have done."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script: str) -> dict:
    pytest.importorskip("triton")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests"),
                                                       os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", script)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
