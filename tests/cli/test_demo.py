"""`burstengine demo` end to end, small: spawned ranks, torchrun ranks, failure exit codes."""
import os
import shlex
import subprocess
import sys

import pytest

import cli_cases
from burstengine import cli
from burstengine.cli import finetune_demo

SMALL = ["--seq", "256", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]


def _run(*argv, env=None):
    """``burstengine ARGV`` (in this process: tests/cli_cases.py); exit code, stdout + stderr."""
    rc, out, err = cli_cases.run(argv, env=env)
    return rc, out + err


def _spawned(*argv, launcher=None, timeout=300):
    """``python -m burstengine ARGV`` in a fresh process (``launcher``: torchrun's command before it)."""
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
    # at 2 ranks the README's first command itself, a fresh `python -m burstengine demo`
    rc, out = (_spawned if extra[1] == "2" else _run)("demo", *SMALL, *extra)
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
    rc, out = _spawned("demo", *SMALL, "--world", "5", launcher=launcher)  # --world is ignored under torchrun
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


# --- burstengine demo finetune ------------------------------------------------------------------

TINY_FT = ["--short", "32", "--long", "64", "--short-steps", "2", "--finetune-steps", "1", "--short-batch", "2",
           "--finetune-batch", "2", "--samples", "4", "--world", "2"]


def test_demo_finetune_stages_connect(tmp_path):
    """The demo with tiny settings (seconds): every stage's command runs and is printed, the
    exported models load in transformers with the engine's logits, the rope-scaling stage (one
    step at lr 0) changes no weight but the config, and the record has the table's fields."""
    pytest.importorskip("transformers")
    import json

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from burstengine.model.hf_dir import load_hf_model

    d = tmp_path / "demo"
    env_extra = {"BURST_RESULTS": str(tmp_path / "records")}
    rc, out = _run("demo", "finetune", "--dir", str(d), *TINY_FT, "--record", "ft", env=env_extra)
    assert rc == 0, out
    rec = json.loads((tmp_path / "records" / "ft.json").read_text())

    # the stages: each command printed as it runs, and the same in the record
    assert list(rec["commands"]) == ["train-short", "rope-scaling", "finetune-long", "evaluate"]
    for stage in ("train-short", "rope-scaling", "finetune-long"):
        train, export = rec["commands"][stage]
        assert train.startswith("python -m burstengine train ") and export.startswith("python -m burstengine export ")
        assert f"] {stage}: {train}" in out and f"] {stage}: {export}" in out
    assert "--set init=" + str(d / "stage1") in rec["commands"]["finetune-long"][0]
    assert "--set model.rope_scaling.type=yarn --set model.rope_scaling.factor=2" in rec["commands"]["rope-scaling"][0]

    # the exported directories: stage 1 plain at 32 tokens, the others yarn x2 at 64
    cfgs = {n: json.loads((d / n / "config.json").read_text()) for n in ("stage1", "scaled", "finetuned")}
    assert cfgs["stage1"]["rope_scaling"] is None and cfgs["stage1"]["max_position_embeddings"] == 32
    for n in ("scaled", "finetuned"):
        assert cfgs[n]["rope_scaling"]["rope_type"] == "yarn" and cfgs[n]["rope_scaling"]["factor"] == 2.0
        assert cfgs[n]["rope_scaling"]["original_max_position_embeddings"] == 32
        assert cfgs[n]["max_position_embeddings"] == 64
    w = {n: load_file(str(d / n / "model.safetensors")) for n in ("stage1", "scaled", "finetuned")}
    assert w["stage1"].keys() == w["scaled"].keys() == w["finetuned"].keys()
    assert all(torch.equal(w["stage1"][k], w["scaled"][k]) for k in w["stage1"])  # lr 0: the same weights
    assert any(not torch.equal(w["stage1"][k], w["finetuned"][k]) for k in w["stage1"])  # the fine-tune trained

    # transformers loads each export with the engine's logits (beyond the original context, where
    # the scaling acts)
    ids = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
    for n in ("stage1", "finetuned"):
        hf = AutoModelForCausalLM.from_pretrained(str(d / n), dtype=torch.float32).eval()
        ours = load_hf_model(str(d / n))
        with torch.no_grad():
            ref = hf(input_ids=ids).logits
            got = ours(ids, torch.arange(64)) @ ours.head_weight.t()
        assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-5, n

    # the record: every model at every length, the engine's own evaluation, the check, the times
    assert rec["kind"] == "demo_finetune" and (rec["short"], rec["long"], rec["world"]) == (32, 64, 2)
    assert [m["name"] for m in rec["models"]] == ["stage1", "scaled", "finetuned"]
    assert {(r["model"], r["seq"]) for r in rec["evals"]} == {(m, L) for m in ("stage1", "scaled", "finetuned")
                                                              for L in (32, 64)}
    for r in rec["evals"]:
        assert r["samples"] == 4 and 0 <= r["passkey_acc"] <= 1 and r["answer_loss"] > 0
    assert {n: e["seq_len"] for n, e in rec["engine"].items()} == {"stage1": 32, "scaled": 64, "finetuned": 64}
    assert rec["logits_check"]["ok"] and rec["logits_check"]["max_rel_err"] < 1e-4
    assert list(rec["stage_s"]) == list(rec["commands"]) and rec["wall_s"] > 0
    assert "passkey @32" in "\n".join(finetune_demo.render(rec))

    # the evaluate stage alone, by its printed command, gives the same numbers
    rc, again = _run(*shlex.split(rec["commands"]["evaluate"][0])[3:], *TINY_FT, "--record", "ft2", env=env_extra)
    assert rc == 0, again
    rec2 = json.loads((tmp_path / "records" / "ft2.json").read_text())
    assert rec2["evals"] == rec["evals"]


def test_demo_finetune_rejects_bad_arguments(tmp_path):
    rc, out = _run("demo", "finetune", "--short", "64", "--long", "64")
    assert rc == 2 and "must be longer than --short" in out, out
    rc, out = _run("demo", "finetune", "--short", "30", "--long", "64")
    assert rc == 2 and "--short 30 is not divisible by 4" in out, out
    rc, out = _run("demo", "finetune", "--eval-only", "--dir", str(tmp_path / "nothing"))
    assert rc == 2 and "no exported model in" in out, out
