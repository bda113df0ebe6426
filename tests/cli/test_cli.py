"""A new user's commands on CPU, without torchrun: every benchmark starts its own gloo ranks at
tiny sizes; user errors end in one line with exit code 2 before any rank starts; records never
replace one another; the train config round-trips through TOML and explains itself."""
import json
import os
import subprocess
import sys
import warnings

import pytest

import cli_cases
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


def _run(*argv, cwd=None, env_extra=None):
    """``burstengine ARGV`` as from a fresh shell (in this process: tests/cli_cases.py)."""
    return cli_cases.run(argv, cwd=cwd, env=env_extra)


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
    (["demo", "--kernel", "fp8"], "computes the attention forward only"),
    (["bench", "attention", "--device", "cpu", "--kernel", "fp8"], "computes the attention forward only"),
    (["bench", "attention", "--device", "cpu", "--kernel", "nope"], "unknown kernel"),
    (["bench", "attention", "--device", "cpu", "--methods", "torch-cp-cudnn"], "need CUDA"),
    (["bench", "attention", "--device", "cpu", "--seqs", "102"], "equal chunks"),
    (["bench", "sparse", "--device", "cpu", "--doc-lengths", "5"], "--doc-lengths takes lo,hi"),
    (["bench", "topo", "--device", "cpu", "--topology", "3x3"], "does not describe the 2 ranks"),
    (["bench", "train", "--methods", "torch-cp"], "needs CUDA"),
    # keys the training benches set themselves are refused, not silently replaced
    (["bench", "train", "--set", "grad_accum=2"], "--set grad_accum is not taken"),
    (["bench", "profile", "--set", "batch_size=2", "--set", "seq_len=64"], "--set batch_size, seq_len is not taken"),
    (["bench", "prefill", "--kernel", "nope"], "unknown kernel"),
    (["bench", "prefill", "--methods", "megatron-v1", "--efficiency"], "--efficiency rates BurstEngine's rows"),
    (["prefill", "--kernel", "nope"], "unknown kernel"),
    (["train", "--set", "attention=torch-cp"], "attention='torch-cp'"),
    (["train", "--set", "kernel=nope"], "unknown kernel"),
    (["train", "--set", "kernel=fp8"], "kernel 'fp8' computes the attention forward only"),
    (["train", "--world", "0"], "--world must be >= 1"),
    (["train", "--set", "grad_clip=nan"], "grad_clip must be a finite number"),
    (["bench", "profile", "--set", "model.dim=-3"], "model.dim must be >= 1"),
])
def test_user_errors_are_one_line_before_any_rank(argv, msg, tmp_path):
    if argv[0] == "train":
        argv = argv + ["--set", f"out_dir={tmp_path}/run"]
    rc, out, err = _run(*argv, cwd=tmp_path)
    assert rc == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0] and "error:" in lines[0], err
    assert not (tmp_path / "run").exists()


def test_train_refuses_a_forward_only_kernel_from_the_environment(tmp_path):
    # BURST_KERNEL=fp8 with the default kernel="auto": training's attention reads the variable, so the
    # refusal must come before any rank starts, as for --set kernel=fp8
    rc, out, err = _run("train", "--set", f"out_dir={tmp_path}/run", cwd=tmp_path, env_extra={"BURST_KERNEL": "fp8"})
    assert rc == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "BURST_KERNEL: kernel 'fp8' computes the attention forward only" in lines[0], err
    assert "training" not in out and not (tmp_path / "run").exists(), out


def test_profile_data_error_is_one_line(tmp_path):
    """A data error found when the ranks build the trainer: said once, exit 2, no traceback."""
    import numpy as np

    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "toks.bin")  # ids past the tiny vocab of 512
    rc, out, err = _run("bench", "profile", "--set", f"data={tmp_path / 'toks.bin'}", "--world", "2", cwd=tmp_path)
    assert rc == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "holds token id 999 >= model.vocab_size 512" in lines[0], err


def test_profile_keeps_the_data_parallelism_asked_for(tmp_path):
    # --set cp=1 on 2 ranks: data parallel 2 (it used to be overridden by the profile's own cp=0),
    # and a GPU's tokens are its share of the step's two sequences
    rc, out, err = _run("bench", "profile", "--world", "2", "--set", "cp=1", "--set", "model.n_layers=1", "--seq",
                        "128", "--warmup", "0", "--name", "p", "--out-dir", str(tmp_path), cwd=tmp_path)
    assert rc == 0, out + err
    rec = json.loads((tmp_path / "p.json").read_text())
    assert (rec["cp"], rec["dp"], rec["world"]) == (1, 2, 2), rec
    assert rec["tokens_per_s_per_gpu"] * rec["step_wall_s"] == pytest.approx(128)


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
                        "model.n_layers=3", "--set", "progress=false", "--print-config", cwd=tmp_path)
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
    rc, out, err = _run("train", "--help")
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
    rc, out, err = _run("train", "--set", "steps=4", "--set", f"out_dir={run}", "--resume", cwd=tmp_path)
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


# --- the newcomer's commands (issue 40): each error is one line, exit 2, before any rank starts

LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "num_hidden_layers": 1,
                "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64, "vocab_size": 100,
                "max_position_embeddings": 64, "rms_norm_eps": 1e-6}


@pytest.fixture
def newcomer_files(tmp_path, monkeypatch):
    """A GPT-2 directory (config.json only: it is refused on reading), a random Llama one whose
    context is 64 tokens, a token .npy, a text file that is not JSON; the current directory is tmp_path
    (no benchmarks/results here)."""
    import numpy as np

    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 32, "n_layer": 1, "n_head": 2}))
    from burstengine.model.hf_dir import write_random_hf_dir

    write_random_hf_dir(str(tmp_path / "short"), LLAMA_CONFIG, dtype="float32")  # whole: commands read its files
    np.save(tmp_path / "ids.npy", np.arange(20))
    np.save(tmp_path / "long.npy", np.arange(65))
    (tmp_path / "hello.txt").write_text("hello\n")
    monkeypatch.chdir(tmp_path)
    return {"gpt2": "gpt2", "short": "short", "npy": "ids.npy", "long": "long.npy", "hello": "hello.txt"}


@pytest.mark.parametrize("argv,msg", [
    (["bench", "cpu-kernels", "--heads", "4", "--kv-heads", "3"], "--heads 4 is not a multiple of --kv-heads 3"),
    (["bench", "train", "--seqs", "250"], "--seqs 250: seq_len 250 is not divisible by 4"),
    (["generate", "--model", "{gpt2}", "--prompt-tokens", "{npy}", "--max-new-tokens", "2"],
     "architecture 'GPT2LMHeadModel' is not supported"),
    (["prefill", "--model", "{gpt2}"], "architecture 'GPT2LMHeadModel' is not supported"),
    (["plan", "--heads", "0"], "--heads must be >= 1, got 0"),
    (["plan", "--intra-gbps", "0"], "--intra-gbps must be > 0"),
    (["plot", "{hello}"], "'hello.txt' is not a metrics.jsonl of burstengine train"),
    (["report", "--check"], "no records (*.json) in benchmarks/results"),
    (["prefill", "--model", "{short}", "--seq", "128"],
     "the prompt (--seq) has 128 tokens, more than the model's context of 64 (its max_position_embeddings)"),
    (["eval", "needle", "--model", "{short}", "--lengths", "32,128"],
     "the longest of --lengths has 128 tokens, more than the model's context of 64"),
    (["eval", "perplexity", "--model", "{short}", "--data", "{npy}", "--lengths", "65"],
     "the longest of --lengths has 65 tokens, more than the model's context of 64"),
    (["generate", "--model", "{short}", "--prompt-tokens", "{long}", "--max-new-tokens", "2"],
     "prompt 0 has 65 tokens, more than the model's context of 64 (its max_position_embeddings)"),
    (["eval", "perplexity", "--model", "{short}", "--data", "{npy}", "--lengths", "32"],
     "--data 'ids.npy' at length 32: 20 tokens are fewer than one window of 32 + 1"),
    (["eval", "perplexity", "--model", "{short}", "--data", "{hello}", "--lengths", "8"], "has no tokenizer"),
    (["eval", "perplexity", "--model", "{short}", "--data", "{npy}", "--lengths", "8", "--stride", "9"],
     "--stride must be in [1, 8]"),
])
def test_newcomer_errors_are_one_line(argv, msg, newcomer_files, capfd):
    from burstengine import cli

    assert cli.main([a.format(**newcomer_files) for a in argv]) == 2
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0] and "error:" in lines[0], err


def test_allow_longer_lets_a_long_prompt_through(newcomer_files):
    from burstengine import cli
    from burstengine.cli import eval as eval_cli, generate as generate_cli, prefill as prefill_cli

    parser = cli.build_parser()
    assert prefill_cli.validate(parser.parse_args(["prefill", "--model", "short", "--seq", "64"])) is None
    assert prefill_cli.validate(parser.parse_args(["prefill", "--model", "short", "--seq", "128",
                                                   "--allow-longer"])) is None
    assert eval_cli.validate(parser.parse_args(["eval", "needle", "--model", "short", "--lengths", "128",
                                                "--allow-longer"])) is None
    assert generate_cli.validate(parser.parse_args(["generate", "--model", "short", "--prompt-tokens", "long.npy",
                                                    "--max-new-tokens", "2", "--allow-longer"])) is None


def test_context_counts_rope_scaling(tmp_path):
    """The one rule of prefill, generate and eval, read from a model directory: its context
    after RoPE scaling; a preset has none known; a family only transformers runs: its own field."""
    from burstengine.inference.context import check_context
    from burstengine.inference.models import spec_args

    cfg = dict(LLAMA_CONFIG, rope_scaling={"rope_type": "linear", "factor": 4.0})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert spec_args(str(tmp_path)).context == 256
    assert check_context(str(tmp_path), 256) is None and "--allow-longer" in check_context(str(tmp_path), 257)
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16,
                           "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert spec_args(str(tmp_path)).context == 128  # original 16 x 8, longer than max_position_embeddings 64
    assert check_context(str(tmp_path), 128) is None and "context of 128 (max_position_embeddings 64 with llama3 " \
        "RoPE scaling x8)" in check_context(str(tmp_path), 129, "the prompt")
    assert check_context("tiny", 1 << 20) is None  # a preset: no known context
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                                      "max_position_embeddings": 64}))
    assert check_context(str(tmp_path), 64) is None and "context of 64" in check_context(str(tmp_path), 65)


def test_cpu_kernels_kv_heads_default_to_heads(tmp_path):
    from burstengine import cli

    assert cli.main(["bench", "cpu-kernels", "--heads", "4", "--seq", "64", "--iters", "1", "--out-dir",
                     str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "cpu_kernels_cpu.json").read_text())
    assert rec["shape"]["H"] == rec["shape"]["Hkv"] == 4


def _parsers(parser):
    """A parser and every sub-command parser under it."""
    import argparse

    yield parser
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                yield from _parsers(sub)


def test_every_parser_shows_its_defaults(monkeypatch):
    """Every command's and every bench's parser uses the shared formatter, which shows an
    option's default unless its help already says it or there is none."""
    import argparse
    import importlib

    from burstengine import cli
    from burstengine.bench import BENCHES
    from burstengine.bench.usage import HelpFormatter

    class Built(Exception):
        pass

    def caught(self, *a, **k):
        raise Built(self)

    parsers = list(_parsers(cli.build_parser()))
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    for name, mod in BENCHES.items():
        with pytest.raises(Built) as e:
            importlib.import_module(mod).main([])
        parsers += list(_parsers(e.value.args[0]))
    parsers.pop(0)  # `burstengine` itself: a list of commands, no option with a default
    bad = [p.prog for p in parsers if p.formatter_class is not HelpFormatter]
    assert not bad, bad
    p = argparse.ArgumentParser(formatter_class=HelpFormatter)
    p.add_argument("--a", type=int, default=8, help="heads")
    p.add_argument("--b", type=int, default=8)
    p.add_argument("--c", default=None, help="kv heads [= --a]")
    p.add_argument("--d", default=3, help="steps [%(default)s]")
    p.add_argument("--e", action="store_true", help="a switch")
    text = " ".join(p.format_help().split())
    assert "--a A heads [8]" in text and "--b B [8]" in text and "kv heads [= --a] -" in text
    assert "steps [3] -" in text and "a switch" in text and "[False]" not in text and "[None]" not in text
    needle = next(q for q in parsers if q.prog == "burstengine eval needle")
    assert "[0,0.25,0.5,0.75,1]" in needle.format_help()  # the depths' default, though "[0, 1]" ended their help once


def test_ctrl_c_during_train_is_one_line(tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) while `burstengine train` runs on 2
    spawned ranks: one line naming the last complete checkpoint, exit 130, no rank's traceback."""
    import signal
    import time

    run = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    sets = ["model.dim=32", "model.n_heads=4", "model.n_kv_heads=2", "model.ffn_dim=48", "model.vocab_size=64",
            "passkey_symbols=8", "passkey_len=3", "seq_len=32", "batch_size=2", "steps=100000", "save_every=2",
            "eval_every=0", "progress=false", f"out_dir={run}"]
    p = subprocess.Popen([sys.executable, "-m", "burstengine", "train", *[a for s in sets for a in ("--set", s)]],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path,
                         start_new_session=True,  # its own process group, as a terminal's job is
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not (run / "checkpoints").is_dir() or not any(
                (d / "meta.json").exists() for d in (run / "checkpoints").iterdir()):
            assert p.poll() is None and time.monotonic() < deadline, "no checkpoint was saved"
            time.sleep(0.5)
        time.sleep(2)
        os.killpg(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    lines = err.strip().splitlines()
    assert p.returncode == 130 and len(lines) == 1, err
    assert "interrupted; the last complete checkpoint is" in lines[0] and "--resume" in lines[0], err
    assert str(run / "checkpoints" / "step_") in lines[0]


def test_records_name_the_package_version_outside_a_checkout(tmp_path):
    """A record's "commit" is the checkout the package runs from, wherever the command runs; a
    package that is no checkout (an install) gives its version."""
    import re
    import shutil

    import burstengine

    code = "from burstengine.bench.records import git_commit; print(git_commit())"
    root = os.path.dirname(os.path.dirname(os.path.abspath(burstengine.__file__)))
    env = {k: v for k, v in os.environ.items() if k != "BURST_COMMIT"}
    here = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env=dict(env, PYTHONPATH=root))
    assert re.fullmatch(r"[0-9a-f]{40}", here.stdout.strip()), here.stdout + here.stderr
    shutil.copytree(os.path.join(root, "burstengine"), tmp_path / "site" / "burstengine",
                    ignore=shutil.ignore_patterns("__pycache__"))
    installed = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                               env=dict(env, PYTHONPATH=str(tmp_path / "site")))
    assert installed.stdout.strip() == f"v{burstengine.__version__}", installed.stdout + installed.stderr


def test_commands_in_this_process_see_what_a_fresh_one_does(tmp_path, monkeypatch):
    """tests/cli_cases.py, which runs most of the suite's commands in the test process, against the
    console script: the same exit code, stdout and stderr (an error; a note and a TOML on stdout);
    a warning reaches stderr (not pytest's summary), an exception ends as the interpreter ends it,
    a spawned rank's output is captured, and the test process gets its state back."""
    import torch

    from burstengine import cli

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and
           not k.startswith("BURST_")}
    for argv in (["plan", "--heads", "0"], ["train", "--set", "ckpt_every=3", "--print-config"]):
        p = subprocess.run([sys.executable, "-m", "burstengine", *argv], capture_output=True, text=True, timeout=120,
                           env=dict(env, OMP_NUM_THREADS="1"))
        assert cli_cases.run(argv) == (p.returncode, p.stdout, p.stderr), argv
    monkeypatch.setenv("BURST_KERNEL", "nope")
    before = (dict(os.environ), os.getcwd(), list(sys.argv), torch.get_num_threads())

    def noisy(argv):
        assert "BURST_KERNEL" not in os.environ and os.getcwd() == str(tmp_path)
        assert sys.argv[1:] == argv and sys.argv[0].endswith(os.path.join("burstengine", "__main__.py"))
        torch.set_num_threads(3)
        warnings.warn("a warning", UserWarning)
        subprocess.run([sys.executable, "-c", "import sys; print('from a child', file=sys.stderr)"])
        if argv == ["boom"]:
            raise RuntimeError("boom")
        print("out")
        return 5

    monkeypatch.setattr(cli, "main", noisy)
    rc, out, err = cli_cases.run(["quiet"], cwd=tmp_path)
    assert (rc, out) == (5, "out\n") and "UserWarning: a warning" in err and "from a child" in err, err
    rc, out, err = cli_cases.run(["boom"], cwd=tmp_path)
    assert rc == 1 and err.rstrip().endswith("RuntimeError: boom") and "Traceback" in err, err
    assert (dict(os.environ), os.getcwd(), list(sys.argv), torch.get_num_threads()) == before
