"""`burstengine report`: docs/results.md, generated from the JSON records in benchmarks/results/.

Every figure the docs quote comes from a record a run wrote (command, commit, device, raw
numbers). This command reads the records and writes one section per benchmark family, one table
per record, built from the record's raw fields; every ratio is computed here from raw times of
the same record. It also rewrites the marked blocks ``<!-- report:NAME -->`` ... ``<!-- /report -->``
in README.md and docs/*.md (the few headline figures quoted outside results.md).

    burstengine report            # rewrite docs/results.md and the marked blocks
    burstengine report --check    # exit 1 when they differ from what the records give (2: no records here)

Run it from the repository root (the defaults are relative paths). A record whose structure a
family's table does not know is listed in a compact generic table instead, never dropped.

The tables are drawn beside the runs that write the records: each bench module (and command)
declares its ``SECTIONS`` and ``BLOCKS`` (burstengine/bench/tables.py); this module finds the
records, collects those from the registries (the commands', burstengine.bench.BENCHES and
RENDERERS), orders the sections (PAGE), writes the files and checks them.
"""
from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import re
import statistics
import sys

from ..bench import BENCHES, RENDERERS
from ..bench.tables import device_of, med, num, ratio, record, table
from . import COMMANDS

HELP = "write docs/results.md (and the figures marked in the docs) from benchmarks/results/*.json; --check compares"

RECORDS_LABEL = "benchmarks/results"  # how tables name a record, wherever --records points

# the modules whose SECTIONS make docs/results.md, in the page's order; a module of the registries
# (the commands', the benches', the renderers') with SECTIONS that is not listed here follows them
PAGE = ("burstengine.bench.peers.attention", "burstengine.bench.probes.probe_speed",
        "burstengine.bench.checks.gpu_correctness", "burstengine.bench.probes.lao_bench",
        "burstengine.bench.checks.lao_check", "burstengine.bench.peers.sparse", "burstengine.bench.peers.prefill",
        "burstengine.bench.peers.train", "burstengine.bench.checks.seqckpt_memory", "burstengine.bench.probes.longest",
        "burstengine.bench.peers.topo", "burstengine.cli.plan", "burstengine.bench.checks.check_cost",
        "burstengine.bench.faults.fault_times", "burstengine.bench.peers.finetune", "burstengine.cli.demo",
        "burstengine.cli.finetune_demo", "burstengine.bench.probes.cpu_kernels", "burstengine.bench.peers.decode",
        "burstengine.bench.faults.phases", "burstengine.bench.probes.scripts", "burstengine.bench.probes.profile",
        "burstengine.bench.faults.soak", "burstengine.bench.probes.lce", "burstengine.bench.checks.delta_error")


def sources() -> list:
    """The modules that render records: PAGE's, then any other of the registries' with SECTIONS."""
    names = list(PAGE) + [m for m in [*COMMANDS.values(), *BENCHES.values(), *RENDERERS] if m not in PAGE]
    mods = [importlib.import_module(n) for n in dict.fromkeys(names)]
    return [m for m in mods if hasattr(m, "SECTIONS") or hasattr(m, "BLOCKS")]


def sections() -> list:
    return [s for m in sources() for s in getattr(m, "SECTIONS", ())]


def all_blocks() -> dict:
    """Every <!-- report:NAME --> block's renderer, from the modules' BLOCKS (this one's among them)."""
    out = {}
    for m in sources():
        for name, fn in getattr(m, "BLOCKS", {}).items():
            if name in out:
                raise ValueError(f"two renderers of block report:{name}: {out[name].__module__} and {m.__name__}")
            out[name] = fn
    return out


def provenance(name, rec) -> list[str]:
    env = rec.get("env", {})
    commit = str(rec.get("commit", "unknown"))[:10]
    bits = [f"record `{RECORDS_LABEL}/{name}`", f"commit `{commit}`", f"device {device_of(rec)}"]
    if env.get("torch"):
        bits.append(f"torch {env['torch']}")
    if env.get("date"):
        bits.append(env["date"][:10])
    for k in ("NCCL_P2P_DISABLE", "BURST_KERNEL", "PYTORCH_CUDA_ALLOC_CONF"):
        if k in env:
            bits.append(f"{k}={env[k]}")
    lines = [" · ".join(bits), f"command: `{rec.get('command', '?')}`"]
    lines += [f"{k.replace('_', ' ')}: {rec[k]}" for k in ("commit_note", "note", "path_note", "env_note") if rec.get(k)]
    return [line + "  " for line in lines[:-1]] + [lines[-1], ""]  # two spaces: a markdown line break


def generic(rows) -> list[str]:
    """The compact table for records no family renders: provenance and the top-level keys."""
    body = []
    for name, rec in rows:
        keys = ", ".join(k for k in rec if k not in ("command", "commit", "env"))
        body.append([f"`benchmarks/results/{name}`", f"`{rec.get('command', '?')}`", f"`{str(rec.get('commit', '?'))[:10]}`",
                     device_of(rec), rec.get("env", {}).get("date", "")[:10], keys])
    return table(["record", "command", "commit", "device", "date", "fields"], body)


def load_records(records_dir: str) -> list[tuple[str, dict]]:
    paths = sorted(glob.glob(os.path.join(records_dir, "*.json")))
    if not paths:
        raise ValueError(f"no records (*.json) in {records_dir} (run it from the repository root, or give --records DIR)")
    out = []
    for p in paths:
        with open(p) as f:
            try:
                out.append((os.path.basename(p), json.load(f)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{p} is not valid JSON: {e}") from None
    return out


def results_md(records) -> str:
    lines = ["# Results", "",
             "<!-- generated by `burstengine report` from benchmarks/results/*.json: do not edit by hand; "
             "`burstengine report --check` fails when this file and the records disagree -->", "",
             "Every table below is built from one JSON record in `benchmarks/results/`, written by the run it "
             "describes (its command, commit, device and raw numbers). Times are medians of the record's raw "
             "times; ratios are computed from times of the same record. To add a result, run the benchmark "
             "(it writes the record), then `burstengine report`.", ""]
    done = set()
    leftovers = []
    for sec in sections():
        members = [(n, r) for n, r in records if re.match(sec.pattern, n)]
        if not members:
            continue
        lines += [f"## {sec.title}", "", sec.what, ""]
        for name, rec in members:
            done.add(name)
            try:
                body = sec.render(rec)
            except (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError,
                    statistics.StatisticsError):
                leftovers.append((name, rec))
                continue
            lines += [f"### {name[:-5]}", ""] + provenance(name, rec) + body
    leftovers += [(n, r) for n, r in records if n not in done]
    if leftovers:
        lines += ["## Other records", "",
                  "Records whose structure no table above knows, listed with their provenance and fields.", ""]
        lines += generic(leftovers)
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- headline blocks in the docs

ATTENTION_RUN = "attention_2gpu_128k_kern.json"


def block_headline(records):
    att = record(records, ATTENTION_RUN)
    rows = {r["method"]: r for r in att["rows"] if r["causal"] and r["H"] == r["Hkv"]}  # causal, MHA
    b, t = rows["burst-zigzag"], rows["torch-cp-cudnn"]
    lao = record(records, "lao_check.json")
    tr = record(records, "train_llama-8b_4gpu_128k.json")
    burst, peer = ({r["method"]: r for r in tr["rows"]}[m] for m in ("burst", "torch-cp"))
    topo = record(records, "topo_bench_4gpu_2x2_interctas1.json")
    ms = {r["label"]: r["measured_s"] for r in topo["rows"]}
    return (f"On {device_of(att)} at {b['S'] // 1024}K tokens, {'causal' if b['causal'] else 'full'}, "
            f"BurstAttention's forward + backward takes "
            f"{ratio(med(b['fwdbwd_s']), med(t['fwdbwd_s']))}× the time of torch's context parallelism on cuDNN "
            f"(`{ATTENTION_RUN}`); llama-8b trains at {burst['seq_len'] // 1024}K tokens on "
            f"{device_of(tr)} at {100 * burst['mfu']:.1f}% MFU, "
            f"{ratio(burst['tokens_per_s_per_gpu'], peer['tokens_per_s_per_gpu'])}× torch-native CP "
            f"(`train_llama-8b_4gpu_128k.json`); with a slow hop between two emulated nodes the double ring runs "
            f"{ratio(ms['burst'], ms['burst_double'])}× faster than one ring (`topo_bench_4gpu_2x2_interctas1.json`); "
            f"our kernels pass {lao['passed']}/{lao['total']} checks against float64 (`lao_check.json`).")


BLOCKS = {"headline": block_headline}  # the README's line, from four benches' records
BLOCK_RE = re.compile(r"(<!-- report:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /report -->)", re.S)


def rewrite_blocks(text: str, records, path: str) -> str:
    blocks = all_blocks()

    def sub(m):
        name = m.group("name")
        if name not in blocks:
            raise ValueError(f"{path}: unknown block report:{name} (known: {', '.join(blocks)})")
        try:
            body = blocks[name](records)
        except KeyError as e:
            raise ValueError(f"{path}: block report:{name}: {e.args[0]}") from None
        return m.group(1) + body + "\n" + m.group(4)
    return BLOCK_RE.sub(sub, text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--records", default="benchmarks/results", help="folder of JSON records (default: %(default)s)")
    p.add_argument("--out", default="docs/results.md", help="the results page to write (default: %(default)s)")
    p.add_argument("--docs", nargs="*", default=None, metavar="FILE",
                   help="markdown files whose <!-- report:NAME --> blocks are rewritten (default: README.md and "
                        "docs/*.md; give --docs with no file for none)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file differs from the records")


def run(args) -> int:
    try:
        return _run(args)
    except (ValueError, OSError) as e:  # no records, a bad one, a doc or block it cannot read
        print(f"burstengine report: error: {e}", file=sys.stderr)
        return 2


def _run(args) -> int:
    records = load_records(args.records)
    docs = args.docs
    if docs is None:
        docs = [p for p in ["README.md"] + sorted(glob.glob("docs/*.md")) if os.path.exists(p)]
    wanted = {args.out: results_md(records)}
    for path in docs:
        if os.path.abspath(path) == os.path.abspath(args.out):
            continue
        with open(path) as f:
            wanted[path] = rewrite_blocks(f.read(), records, path)
    stale = []
    for path, text in wanted.items():
        try:
            with open(path) as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current == text:
            continue
        stale.append(path)
        if not args.check:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
    if args.check:
        for path in stale:
            print(f"burstengine report --check: {path} differs from what {args.records} gives; "
                  "run `burstengine report`", file=sys.stderr)
        return 1 if stale else 0
    print(f"burstengine report: {len(records)} records; " + (f"rewrote {', '.join(stale)}" if stale else "up to date"))
    return 0
