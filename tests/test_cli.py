"""A new user's commands on CPU, without torchrun: every benchmark starts its own gloo ranks at
tiny sizes; user errors end in one line with exit code 2 before any rank starts; records never
replace one another; the train config round-trips through TOML and explains itself."""
import json
import os
import subprocess
import sys
import warnings

import pytest

from burstengine.bench.records import write_record
from burstengine.train.config import DEPRECATED, field_help, load, preset, to_toml

# what tiny runs of each benchmark take (no torchrun: `burstengine bench X` spawns 2 gloo ranks)
TINY = {
    "attention": ["--device", "cpu", "--seqs", "64", "--heads", "2", "--head-dim", "8", "--mask", "causal",
                  "--methods", "burst-zigzag,ulysses-math", "--warmup", "0", "--iters", "1"],
    "sparse": ["--device", "cpu", "--cases", "window", "--seq", "128", "--windows", "16", "--heads", "2",
               "--head-dim", "8", "--warmup", "0", "--iters", "1"],
    "topo": ["--device", "cpu", "--seqs", "64", "--heads", "2", "--head-dim", "8", "--schemes", "burst,ring",
             "--warmup", "0", "--iters", "1", "--link-sizes", "1024,8192"],
}


def _run(*argv, cwd=None, env_extra=None, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env_extra or {}))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "BURST_RESULTS", "BURST_KERNEL"):
        env.pop(var, None)
    env.update(env_extra or {})
    p = subprocess.run([sys.executable, "-m", "burstengine", *argv], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=cwd)
    return p.returncode, p.stdout, p.stderr


@pytest.mark.parametrize("bench", sorted(TINY))
def test_bench_runs_without_torchrun(bench, tmp_path):
    # the default record folder is ./burst-results of the current directory, and a second run
    # of the same name gets a new file
    rc, out, err = _run("bench", bench, *TINY[bench], "--name", "tiny", cwd=tmp_path)
    assert rc == 0, out + err
    first = tmp_path / "burst-results" / "tiny.json"
    rec = json.loads(first.read_text())
    assert rec["env"]["device"] == "cpu" and rec["world"] == 2 and rec["rows"]
    if bench == "attention":
        rc, out, err = _run("bench", bench, *TINY[bench], "--name", "tiny", cwd=tmp_path)
        assert rc == 0, out + err
        assert json.loads(first.read_text()) == rec
        assert json.loads((tmp_path / "burst-results" / "tiny-2.json").read_text())["rows"]


@pytest.mark.parametrize("argv,msg", [
    (["demo", "--kernel", "nope"], "unknown kernel 'nope'"),
    (["demo", "--kernel", "cudnn"], "cannot run on device cpu"),
    (["bench", "attention", "--device", "cpu", "--kernel", "nope"], "unknown kernel"),
    (["bench", "attention", "--device", "cpu", "--methods", "torch-cp-cudnn"], "need CUDA"),
    (["bench", "attention", "--device", "cpu", "--seqs", "102"], "equal chunks"),
    (["bench", "sparse", "--device", "cpu", "--doc-lengths", "5"], "--doc-lengths takes lo,hi"),
    (["bench", "topo", "--device", "cpu", "--topology", "3x3"], "does not describe the 2 ranks"),
    (["bench", "train", "--methods", "torch-cp"], "needs CUDA"),
    (["bench", "prefill", "--kernel", "nope"], "unknown kernel"),
    (["prefill", "--kernel", "nope"], "unknown kernel"),
    (["train", "--set", "attention=torch-cp"], "attention='torch-cp'"),
    (["train", "--set", "kernel=nope"], "unknown kernel"),
    (["train", "--world", "0"], "--world must be >= 1"),
    (["train", "--set", "grad_clip=nan"], "grad_clip must be a finite number"),
    (["bench", "profile", "--set", "model.dim=-3"], "model.dim must be >= 1"),
])
def test_user_errors_are_one_line_before_any_rank(argv, msg, tmp_path):
    if argv[0] == "train":
        argv = argv + ["--set", f"out_dir={tmp_path}/run"]
    rc, out, err = _run(*argv, cwd=tmp_path, timeout=120)
    assert rc == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0] and "error:" in lines[0], err
    assert not (tmp_path / "run").exists()


def test_profile_data_error_is_one_line(tmp_path):
    """A data error found when the ranks build the trainer: said once, exit 2, no traceback."""
    import numpy as np

    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "toks.bin")  # ids past the tiny vocab of 512
    rc, out, err = _run("bench", "profile", "--set", f"data={tmp_path / 'toks.bin'}", "--world", "2", cwd=tmp_path,
                        timeout=120)
    assert rc == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "holds token id 999 >= model.vocab_size 512" in lines[0], err


@pytest.mark.parametrize("over,msg", [
    ("grad_clip=nan", "grad_clip must be a finite number >= 0"),
    ("lr=inf", r"lr must be in \[0, 1\]"),
    ("lr=1e30", r"lr must be in \[0, 1\]"),
    ("lr=nan", r"lr must be in \[0, 1\]"),
    ("weight_decay=nan", "weight_decay must be a finite number"),
    ("fault_timeout=nan", "fault_timeout must be a finite number"),
    ("fault_timeout=inf", "fault_timeout must be a finite number"),
    ("peak_tflops=-1", "peak_tflops must be a finite number"),
    ("beta2=nan", r"beta2 must be in \[0, 1\]"),
    ("activation_checkpoint_split=nan", "activation_checkpoint_split must be in"),
    ("model.norm_eps=0", "model.norm_eps must be a finite number > 0"),
    ("model.rope_theta=inf", "model.rope_theta must be a finite number > 0"),
])
def test_config_ranges(over, msg):
    with pytest.raises(ValueError, match=msg):
        load("tiny", [over])


def test_print_config_is_toml_that_config_reads(tmp_path):
    rc, out, err = _run("train", "--set", "steps=7", "--set", "activation_checkpoint=full", "--set",
                        "model.n_layers=3", "--set", "progress=false", "--print-config", cwd=tmp_path, timeout=120)
    assert rc == 0 and not err, err
    path = tmp_path / "c.toml"
    path.write_text(out)
    cfg = load(str(path))
    want = load("tiny", ["steps=7", "activation_checkpoint=full", "model.n_layers=3", "progress=false"])
    assert cfg == want
    # every preset, exactly
    for name in ("tiny", "llama-7b"):
        path.write_text(to_toml(preset(name)))
        assert load(str(path)) == preset(name)


def test_help_lists_every_field_with_default_and_meaning():
    rc, out, err = _run("train", "--help", timeout=120)
    assert rc == 0, err
    cfg = preset("tiny").to_dict()
    for title, fields in field_help():
        assert title in out
        table = title[1:title.index("]")] if title.startswith("[") else None  # [model], [lora]
        for name, text in fields:
            key = f"{table}.{name}" if table else name
            assert text, f"config field {key} has no help comment"
            line = next(l for l in out.splitlines() if l.strip().startswith(f"{key} = "))
            assert text.split()[0] in line, (key, line)
    assert {n for _, f in field_help() for n, _ in f} == set(cfg) - {"model", "lora"} | set(cfg["model"]) | set(cfg["lora"])


def test_old_config_names_still_work_with_a_note():
    with pytest.warns(FutureWarning, match="'ckpt_every' is deprecated.*'save_every'"):
        cfg = load("tiny", ["ckpt_every=3"])
    assert cfg.save_every == 3
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load("tiny", [f"{old}={v}" for old, v in (("checkpoint", "full"), ("checkpoint_split", "0.25"),
                                                       ("ckpt_keep", "3"))])
    assert (cfg.activation_checkpoint, cfg.activation_checkpoint_split, cfg.save_keep) == ("full", 0.25, 3)
    assert len(caught) == 3 and set(DEPRECATED) >= {"checkpoint", "checkpoint_split", "ckpt_keep"}


def test_resume_of_a_finished_run_has_nothing_to_do(tmp_path):
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_00000004"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"step": 4}))
    rc, out, err = _run("train", "--set", "steps=4", "--set", f"out_dir={run}", "--resume", cwd=tmp_path,
                        timeout=120)
    assert rc == 0 and "nothing to do" in err and len(err.strip().splitlines()) == 1, out + err
    assert sorted(os.listdir(run)) == ["checkpoints"]


def test_missing_optional_package_names_its_extra(monkeypatch, tmp_path):
    import importlib.util

    from burstengine.bench import usage
    from burstengine.cli import prefill as prefill_cli

    real = importlib.util.find_spec
    monkeypatch.setattr(usage.importlib.util, "find_spec", lambda name, *a: None if name == "safetensors" else
                        real(name, *a))
    (tmp_path / "config.json").write_text("{}")
    p = __import__("argparse").ArgumentParser()
    prefill_cli.add_arguments(p)
    msg = prefill_cli.validate(p.parse_args(["--model", str(tmp_path)]))
    assert msg and "safetensors" in msg and "burstengine[hf]" in msg
    msg = prefill_cli.validate(p.parse_args(["--save-kv", str(tmp_path / "kv")]))
    assert msg and "burstengine[hf]" in msg
    assert usage.missing_package("tokenizers", "jsonl data") is None


def test_records_never_replace_each_other(tmp_path):
    a = write_record("r", {"x": 1}, str(tmp_path))
    b = write_record("r", {"x": 2}, str(tmp_path))
    assert os.path.basename(a) == "r.json" and os.path.basename(b) == "r-2.json"
    assert json.load(open(a))["x"] == 1
    # a run rewriting its own record says so
    assert write_record("r", {"x": 3}, path=b) == b and json.load(open(b))["x"] == 3
    assert sorted(os.listdir(tmp_path)) == ["r-2.json", "r.json"]


def test_cli_sets_expandable_segments_unless_configured(monkeypatch):
    from burstengine import cli

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"
