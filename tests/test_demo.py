"""`burstengine demo` end to end, small: spawned ranks, torchrun ranks, failure exit codes."""
import os
import subprocess
import sys

import pytest

from burstengine import cli

SMALL = ["--seq", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]


def _run(*argv, launcher=None, timeout=300):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("BURST_KERNEL", None)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    cmd = (launcher or [sys.executable]) + ["-m", "burstengine", *argv]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("extra", [
    ["--world", "2"],
    ["--world", "3", "--seq", "192", "--layout", "striped", "--no-causal"],
    ["--world", "4", "--layout", "contiguous"],
])
def test_demo_spawns_and_passes(extra):
    rc, out = _run("demo", *SMALL, *extra)
    assert rc == 0, out
    lines = out.splitlines()
    assert any(l.startswith("burst ") and "(match)" in l for l in lines), out
    assert any(l.startswith("ring ") and "(match)" in l for l in lines), out
    assert "OK: every error <= 0.001" in out


def test_demo_fails_loudly_above_tolerance():
    rc, out = _run("demo", *SMALL, "--world", "2", "--tol", "1e-12")
    assert rc == 1, out
    assert "FAILED" in out and "above --tol" in out


def test_demo_rejects_bad_arguments():
    rc, out = _run("demo", "--world", "4", "--seq", "12")
    assert rc == 2 and "not divisible by 8" in out, out
    rc, out = _run("demo", "--heads", "4", "--kv-heads", "3", "--seq", "64")
    assert rc == 2 and "multiple of --kv-heads" in out, out


def test_demo_under_torchrun():
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    rc, out = _run("demo", *SMALL, "--world", "5", launcher=launcher)  # --world is ignored under torchrun
    assert rc == 0, out
    assert "on 2 CPU ranks" in out and "OK: every error" in out


def test_cli_lists_demo(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    assert "demo" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2
