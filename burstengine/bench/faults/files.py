"""Damaged files in, one line out: the file fuzz of `burstengine bench faults` (and the test suite).

Every case damages a copy of a good file set the way disks, copies and users do, runs a command
on it as a user would (a subprocess, no launcher: it spawns its own ranks), and checks that the
command exits 2 with exactly one line on stderr naming the file or tensor at fault (or, for a
run whose newest checkpoint is damaged, falls back to the newest intact one and says so):

* HF model directories (``init=`` of train, generate, prefill): a shard deleted, the index
  pointing a tensor at the wrong file, a shard truncated, a shard's header garbled, the index
  or config.json not JSON, a weight holding NaN.
* Checkpoints for ``burstengine export``: bytes flipped in a shard, a shard truncated or
  removed, .metadata missing or truncated (each in the newest checkpoint of a run, which must
  fall back, and named directly, which must be refused); an out_dir that is a file, or another
  model's directory without --overwrite.
* A full disk under export (the safetensors writer fails with ENOSPC): "no space left on".
* Two exports into one out_dir at once: both succeed and the directory holds one whole export.

    burstengine bench faults-files [--out-dir DIR]     # tests/bench/test_fault_files.py runs the same cases
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import burstengine

from ..usage import command_parser

# a Llama small enough to write, load and spawn ranks on in seconds
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
               "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 128, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
               "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}


def _shards(d: str) -> list[str]:
    return sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))


def _second(d: str) -> str:
    return os.path.join(d, _shards(d)[1])


def _truncate(f: str) -> str:
    os.truncate(f, os.path.getsize(f) // 2)
    return f


def _garble_header(f: str) -> str:
    with open(f, "r+b") as fh:
        fh.seek(8)
        fh.write(b"x" * 24)
    return f


def _index_wrong_file(d: str) -> str:
    path = os.path.join(d, "model.safetensors.index.json")
    index = json.load(open(path))
    name = sorted(index["weight_map"])[-1]
    here = index["weight_map"][name]
    index["weight_map"][name] = next(s for s in _shards(d) if s != here)
    json.dump(index, open(path, "w"))
    return index["weight_map"][name]


def _nan_weight(d: str) -> str:
    from safetensors.torch import load_file, save_file

    f = _second(d)
    tensors = load_file(f)
    name = sorted(n for n in tensors if tensors[n].dim() == 2)[0]
    tensors[name][0, 0] = float("nan")
    save_file(tensors, f, metadata={"format": "pt"})
    return name


def _remove(f: str) -> str:
    os.remove(f)
    return os.path.basename(f)


def _garbage(path: str) -> str:
    with open(path, "w") as fh:
        fh.write("{garbage")
    return path


# name -> damage(dir) -> what the one-line message must contain (a file or tensor name)
HF_DAMAGE = {
    "missing_shard": lambda d: _remove(_second(d)),
    "index_wrong_file": _index_wrong_file,
    "truncated_shard": lambda d: os.path.basename(_truncate(_second(d))),
    "garbled_header": lambda d: os.path.basename(_garble_header(_second(d))),
    "garbage_index": lambda d: os.path.basename(_garbage(os.path.join(d, "model.safetensors.index.json"))),
    "garbage_config": lambda d: os.path.basename(_garbage(os.path.join(d, "config.json"))),
    "nan_weight": _nan_weight,
}


def _flip(f: str) -> str:
    with open(f, "r+b") as fh:
        fh.seek(os.path.getsize(f) // 2)
        data = fh.read(16)
        fh.seek(-len(data), 1)
        fh.write(bytes(b ^ 0xFF for b in data))
    return f


def _distcp(c: str) -> str:
    return os.path.join(c, sorted(n for n in os.listdir(c) if n.endswith(".distcp"))[0])


# name -> damage(checkpoint dir) -> the file the message must name
CKPT_DAMAGE = {
    "flipped_bytes": lambda c: os.path.basename(_flip(_distcp(c))),
    "truncated_shard": lambda c: os.path.basename(_truncate(_distcp(c))),
    "removed_shard": lambda c: _remove(_distcp(c)),
    "missing_metadata": lambda c: _remove(os.path.join(c, ".metadata")),
    "truncated_metadata": lambda c: os.path.basename(_truncate(os.path.join(c, ".metadata"))),
}


def cli(argv, timeout: float = 300.0, env=None, code: str | None = None) -> tuple[int, str, str]:
    """``burstengine ARGV`` in a fresh process (``code``: Python run first in that process, e.g. a
    patch); (exit code, stdout, stderr)."""
    root = os.path.dirname(os.path.abspath(burstengine.__path__[0]))  # the checkout: the child imports this tree
    full = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    full["PYTHONPATH"] = os.pathsep.join([root, full.get("PYTHONPATH", "")])
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "BURST_CHECKS"):
        full.pop(var, None)
    prog = f"{code or ''}\nimport sys\nfrom burstengine.cli import main\nsys.exit(main({list(argv)!r}))"
    p = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=timeout, env=full)
    return p.returncode, p.stdout, p.stderr


def one_line(rc: int, err: str, *want: str) -> str | None:
    """What is wrong with a command's refusal (None: exit 2, one line, naming ``want``)."""
    lines = [ln for ln in err.strip().splitlines() if ": note: " not in ln and not ln.startswith("[")]
    if rc != 2:
        return f"exit {rc}, not 2: {err.strip()[-300:]}"
    if len(lines) != 1 or "Traceback" in err:
        return f"{len(lines)} lines, not one: {err.strip()[-300:]}"
    missing = [w for w in want if w not in lines[0]]
    return f"does not name {missing}: {lines[0]}" if missing else None


def make_hf_dir(path: str) -> str:
    """A random tiny Llama as an HF directory of several shards with an index."""
    from ...model.hf_dir import write_random_hf_dir  # torch: only when a case runs, not for --help

    write_random_hf_dir(path, TINY_CONFIG, dtype="float32", max_shard_bytes=40_000)
    return path


def damaged_hf_dir(good: str, name: str, dst: str) -> tuple[str, str]:
    """A copy of ``good`` with damage ``name``; (its path, what a message must name)."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(good, dst)
    return dst, HF_DAMAGE[name](dst)


HF_COMMANDS = {
    "train": lambda d, tmp: ["train", "--set", f"init={d}", "--set", "steps=1", "--set", f"out_dir={tmp}/run",
                             "--world", "2"],
    "generate": lambda d, tmp: ["generate", "--model", d, "--prompt-tokens", _prompt(tmp), "--max-new-tokens", "2",
                                "--world", "2"],
    "prefill": lambda d, tmp: ["prefill", "--model", d, "--seq", "64", "--world", "2"],
}


def _prompt(tmp: str) -> str:
    import numpy as np

    path = os.path.join(tmp, "prompt.npy")
    if not os.path.exists(path):
        np.save(path, np.arange(16))
    return path


def hf_case(good: str, damage: str, command: str, tmp: str) -> str | None:
    """One damaged HF directory through one command: None when it ends in the one line."""
    d, want = damaged_hf_dir(good, damage, os.path.join(tmp, f"hf_{damage}"))
    rc, _, err = cli(HF_COMMANDS[command](d, tmp))
    return one_line(rc, err, want)


def make_run(path: str) -> str:
    """A 2-step run of the tiny preset with a checkpoint at each step (one rank)."""
    rc, out, err = cli(["train", "--set", "steps=2", "--set", "save_every=1", "--set", "save_keep=2",
                        "--set", f"out_dir={path}", "--set", "cp=1", "--set", "progress=false", "--world", "1"])
    if rc:
        raise RuntimeError(f"the run for the checkpoint cases failed: {err[-2000:]}")
    return path


def _newest(run: str) -> str:
    ckpts = os.path.join(run, "checkpoints")
    return os.path.join(ckpts, sorted(os.listdir(ckpts))[-1])


def checkpoint_case(good_run: str, damage: str, tmp: str) -> list[str]:
    """One damage of the newest checkpoint: an export of the run falls back to the older intact
    checkpoint and says why; an export of the checkpoint itself is refused in one line naming
    the file.  The problems found (empty: both right)."""
    run = os.path.join(tmp, f"run_{damage}")
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(good_run, run)
    newest = _newest(run)
    bad = CKPT_DAMAGE[damage](newest)
    problems = []
    rc, out, err = cli(["export", run, os.path.join(tmp, f"out_{damage}")])
    if rc != 0 or "step_00000001" not in out or bad not in err or "not intact" not in err:
        problems.append(f"{damage}: the run's export did not fall back to step 1 naming {bad}: rc {rc}, "
                        f"{(out + err).strip()[-300:]}")
    rc, _, err = cli(["export", newest, os.path.join(tmp, f"out_{damage}_direct")])
    problem = one_line(rc, err, bad)
    if problem:
        problems.append(f"{damage} (checkpoint named): {problem}")
    return problems


def out_dir_cases(good_run: str, good_hf: str, tmp: str) -> list[str]:
    """An out_dir that is a file, another model's directory (refused without --overwrite, then
    replaced whole with it), an export over an earlier export (allowed)."""
    problems = []
    a_file = os.path.join(tmp, "a_file")
    open(a_file, "w").close()
    rc, _, err = cli(["export", good_run, a_file])
    problems += [f"out_dir a file: {p}" for p in [one_line(rc, err, a_file)] if p]
    foreign = os.path.join(tmp, "foreign")
    shutil.rmtree(foreign, ignore_errors=True)
    shutil.copytree(good_hf, foreign)
    open(os.path.join(foreign, "tokenizer.json"), "w").write("{}")
    rc, _, err = cli(["export", good_run, foreign])
    problems += [f"foreign out_dir: {p}" for p in [one_line(rc, err, foreign, "--overwrite")] if p]
    rc, _, err = cli(["export", good_run, foreign, "--overwrite"])
    if rc != 0 or "tokenizer.json" in os.listdir(foreign):
        problems.append(f"--overwrite: rc {rc}, left {sorted(os.listdir(foreign))}: {err[-300:]}")
    rc, _, err = cli(["export", good_run, foreign])  # over our own export: no --overwrite needed
    if rc != 0:
        problems.append(f"export over an earlier export: rc {rc}: {err[-300:]}")
    return problems


FULL_DISK = """
import errno
import safetensors.torch as st
def full(tensors, filename, metadata=None):
    with open(filename, "wb") as f:
        f.write(b"x" * 100)
    raise OSError(errno.ENOSPC, "No space left on device", filename)
st.save_file = full
"""


def full_disk_case(good_run: str, tmp: str) -> list[str]:
    """A disk that fills while export writes the weights; an earlier export there stays intact."""
    out = os.path.join(tmp, "out_full")
    rc, _, err = cli(["export", good_run, out])
    if rc:
        return [f"full disk: the first export failed: rc {rc}: {err[-300:]}"]
    before = sorted(os.listdir(out))
    rc, _, err = cli(["export", good_run, out], code=FULL_DISK)
    problems = [f"full disk: {p}" for p in [one_line(rc, err, "no space left on", out)] if p]
    if not os.path.isdir(out) or sorted(os.listdir(out)) != before:
        problems.append(f"full disk: the earlier export changed: {before} -> "
                        f"{sorted(os.listdir(out)) if os.path.isdir(out) else 'gone'}")
    leftovers = [n for n in os.listdir(tmp) if n.startswith(".out_full.export-")]
    if leftovers:
        problems.append(f"full disk: temporary directories left behind: {leftovers}")
    return problems


def concurrent_exports(good_run: str, tmp: str, n: int = 3) -> list[str]:
    """``n`` exports into one out_dir at once: all succeed, one whole export remains, no temporary
    directory is left."""
    out = os.path.join(tmp, "out_concurrent")
    root = os.path.dirname(os.path.abspath(burstengine.__path__[0]))  # the checkout: the child imports this tree
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-m", "burstengine", "export", good_run, out], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(n)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    problems = [f"concurrent export {i}: rc {rc}: {err[-300:]}" for i, (rc, err) in enumerate(results) if rc]
    from ...model.hf_dir import load_hf_model  # torch: only when a case runs, not for --help

    try:
        load_hf_model(out)
    except Exception as e:  # noqa: BLE001 (whatever it is, the export is not whole)
        problems.append(f"concurrent exports: the result does not load: {type(e).__name__}: {e}")
    leftovers = [n for n in os.listdir(tmp) if n.startswith(".out_concurrent.export-")]
    if leftovers:
        problems.append(f"concurrent exports: temporary directories left behind: {leftovers}")
    return problems


def run_all(tmp: str | None = None, commands=tuple(HF_COMMANDS)) -> dict:
    """Every case; a summary for the record: cases tried and the problems found."""
    tmp = tmp or tempfile.mkdtemp(prefix="burst_files_")
    t0 = time.perf_counter()
    good_hf = make_hf_dir(os.path.join(tmp, "good_hf"))
    good_run = make_run(os.path.join(tmp, "good_run"))
    problems, tried = [], 0
    for damage in HF_DAMAGE:
        for command in commands:
            tried += 1
            p = hf_case(good_hf, damage, command, tmp)
            if p:
                problems.append(f"{damage} via {command}: {p}")
    for damage in CKPT_DAMAGE:
        tried += 2
        problems += checkpoint_case(good_run, damage, tmp)
    tried += 4
    problems += out_dir_cases(good_run, good_hf, tmp)
    tried += 1
    problems += full_disk_case(good_run, tmp)
    tried += 1
    problems += concurrent_exports(good_run, tmp)
    return {"cases": tried, "problems": problems, "seconds": round(time.perf_counter() - t0, 1),
            "hf_damage": list(HF_DAMAGE), "checkpoint_damage": list(CKPT_DAMAGE), "commands": list(commands)}


def main(argv=None) -> int:
    p = command_parser("burstengine bench faults-files", __doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default=None, help="where the JSON record goes (default $BURST_RESULTS or "
                                                   "./burst-results)")
    args = p.parse_args(argv)
    from ..records import write_record  # only when writing a record

    res = run_all()
    print("\n".join(res["problems"]) or f"all {res['cases']} damaged-file cases ended in one line")
    print("wrote", write_record("faults_files", res, args.out_dir))
    return 1 if res["problems"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
