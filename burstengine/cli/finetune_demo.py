"""`burstengine demo finetune`: extend a model's context on CPU, end to end, in a few minutes.

The whole path of docs/training.md's "Fine-tuning a pretrained model", small enough for a laptop,
run with the public commands (each printed before it runs, so it can be run by hand):

1. ``train-short``: train a tiny LLaMA on the passkey task at --short tokens (256), then
   ``burstengine export`` it as a Hugging Face model directory: the "pretrained model".
2. ``rope-scaling``: ``burstengine train --set init=<that directory>`` with RoPE scaling set by the
   ``model.rope_scaling.*`` keys and seq_len = --long (2048), one step at lr=0 (which changes no
   weight), exported: the same weights with only the scaling applied.
3. ``finetune-long``: the same, trained for --finetune-steps at --long tokens, exported.
4. ``evaluate``: each exported directory loaded with transformers' AutoModelForCausalLM and asked
   the held-out passkeys at every length from --short to --long (doubling); the fine-tuned
   model's transformers logits compared with the engine's on one --long sequence.

Prints a table (passkey accuracy per model and length, the answer tokens' loss, the training
runs' own evaluation, wall time per stage) and, with --record, writes it as a JSON record.  The
runs and models stay under --dir; ``--eval-only`` evaluates the models already there.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

import torch

from ..bench.harness import RankLog
from ..bench.launch import under_launcher
from ..bench.records import write_record
from ..bench.tables import Section, fixed, num, record, table
from ..bench.usage import missing_package
from ..model.hf_dir import load_hf_model
from ..train.data import IGNORE, Passkey, global_sequences
from ..train.metrics import read_jsonl
from . import main

HELP = "extend a tiny model from 256 to 2K tokens by RoPE scaling + fine-tuning, export it, evaluate it in transformers"

# The model and task: small enough that 2 CPU ranks train the short stage in ~30 s (it reaches
# 100% at 256 tokens after ~200 steps), on a task whose answer may lie anywhere in the context.
# A 2-layer, 64-wide LLaMA (4 query / 2 KV heads of 16, RoPE theta 10000) over a 64-token
# vocabulary: 4 special tokens, 16 passkey symbols, 44 filler tokens; a passkey of one symbol
# (chance 1/16).  Passkeys of 2 or 4 symbols are not learnt in a few hundred steps, even 128 wide.
MODEL = ("model.dim=64", "model.ffn_dim=176", "model.vocab_size=64")  # on the tiny preset's 2 layers, 4/2 heads
TASK = ("data=passkey", "passkey_len=1", "passkey_symbols=16")

# The RoPE scaling: YaRN by default.  It keeps the fast-rotating dimensions (which tell neighbouring
# tokens apart) as trained and interpolates only the slow ones, so the model's short-context
# behaviour is left alone, and it is what docs/training.md uses for real models.  Measured on this
# demo (seed 0): every type (linear, yarn, llama3, dynamic, factor 8) takes the 256-token model from
# 23% to 100% at 2048 tokens without any training (this model finds the passkey by its content),
# and the answer losses of the types differ by a few percent (0.0139 for yarn against 0.0142 for the
# others without training; 0.0091 for yarn and 0.0086 for linear after the fine-tune), so the
# choice here rests on the first reason.  --rope picks another.
ROPES = ("yarn", "linear", "llama3", "dynamic")

STAGES = ("train-short", "rope-scaling", "finetune-long", "evaluate")

# the flags the evaluate stage shares with the others (its printed command names those that differ)
DEFAULTS = {"dir": "runs/demo-finetune", "short": 256, "long": 2048, "samples": 64, "seed": 0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=DEFAULTS["dir"],
                   help="where the runs and the exported models go (its stages' folders are overwritten) "
                        "[%(default)s]")
    p.add_argument("--world", type=int, default=2, help="gloo ranks of each training run (CP over all) [%(default)s]")
    p.add_argument("--short", type=int, default=DEFAULTS["short"],
                   help="tokens per sequence of the first training [%(default)s]")
    p.add_argument("--long", type=int, default=DEFAULTS["long"],
                   help="tokens per sequence after the extension [%(default)s]")
    p.add_argument("--rope", choices=ROPES, default="yarn",
                   help="RoPE scaling type (factor = long / short) [%(default)s]")
    p.add_argument("--short-steps", type=int, default=300, help="optimizer steps at --short [%(default)s]")
    p.add_argument("--short-batch", type=int, default=16, help="sequences per step at --short [%(default)s]")
    p.add_argument("--finetune-steps", type=int, default=30, help="optimizer steps at --long [%(default)s]")
    p.add_argument("--finetune-batch", type=int, default=4, help="sequences per step at --long [%(default)s]")
    p.add_argument("--finetune-lr", type=float, default=1e-3, help="peak learning rate at --long [%(default)s]")
    p.add_argument("--samples", type=int, default=DEFAULTS["samples"],
                   help="held-out passkeys per length [%(default)s]")
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"], help="weights, data and passkeys [%(default)s]")
    p.add_argument("--eval-only", action="store_true",
                   help="only the evaluate stage, on the models a previous run left in --dir")
    p.add_argument("--record", metavar="NAME", default=None,
                   help="also write the table as a JSON record NAME.json in $BURST_RESULTS or ./burst-results "
                        "(a numbered name if that exists)")


# --- the plan: every stage as the commands a user would type ------------------------------------

def lengths(short: int, long: int) -> list[int]:
    """short, 2 short, 4 short, ... up to long (long included)."""
    out = [short]
    while out[-1] * 2 < long:
        out.append(out[-1] * 2)
    return out + [long]


def rope_sets(args) -> list[str]:
    factor = args.long / args.short
    sets = [f"model.rope_scaling.type={args.rope}", f"model.rope_scaling.factor={factor:g}"]
    if args.rope != "linear":  # the others need the context the model was trained for
        sets.append(f"model.rope_scaling.original_max_position_embeddings={args.short}")
    return sets


def _train(args, name: str, sets) -> list[str]:
    argv = ["train", "--config", "tiny", "--overwrite", "--world", str(args.world),
            "--set", f"name={name}", "--set", f"out_dir={os.path.join(args.dir, 'runs', name)}"]
    seed = (f"seed={args.seed}",) if args.seed else ()  # 0 is the preset's
    for s in (*sets, *seed, f"eval_samples={args.samples}"):
        argv += ["--set", s]
    return argv


def model_dir(args, name: str) -> str:
    return os.path.join(args.dir, name)


def plan(args) -> dict[str, list[list[str]]]:
    """stage -> the burstengine commands (argv after ``burstengine``) it runs."""
    stage1 = model_dir(args, "stage1")
    short = _train(args, "stage1", (*MODEL, *TASK, f"seq_len={args.short}", f"batch_size={args.short_batch}",
                                     f"steps={args.short_steps}", "lr=3e-3", "warmup_steps=20",
                                     f"eval_every={max(1, args.short_steps // 3)}", f"save_every={args.short_steps}"))
    long_common = (f"init={stage1}", *rope_sets(args), *TASK, f"seq_len={args.long}",
                   f"batch_size={args.finetune_batch}", "eval_every=0")
    scaled = _train(args, "scaled", (*long_common, "steps=1", "lr=0", "warmup_steps=0", "save_every=1"))
    tuned = _train(args, "finetuned", (*long_common, f"steps={args.finetune_steps}", f"lr={args.finetune_lr:g}",
                                       f"warmup_steps={min(5, args.finetune_steps)}",
                                       f"save_every={args.finetune_steps}"))
    run = lambda name: os.path.join(args.dir, "runs", name)  # noqa: E731
    return {
        "train-short": [short, ["export", run("stage1"), stage1, "--overwrite"]],
        "rope-scaling": [scaled, ["export", run("scaled"), model_dir(args, "scaled"), "--overwrite"]],
        "finetune-long": [tuned, ["export", run("finetuned"), model_dir(args, "finetuned"), "--overwrite"]],
        "evaluate": [["demo", "finetune", "--eval-only", *_eval_flags(args)]],
    }


def _eval_flags(args) -> list[str]:
    """The flags of ``demo finetune --eval-only`` that differ from their defaults."""
    out = []
    for flag, default in DEFAULTS.items():
        value = getattr(args, flag)
        if value != default:
            out += [f"--{flag}", str(value)]
    return out


def shell(argv: list[str]) -> str:
    return "python -m burstengine " + shlex.join(argv)


# the three models the evaluation compares: (name, what it is)
def models(args) -> list[tuple[str, str]]:
    return [("stage1", f"trained at {args.short}"),
            ("scaled", f"+ {args.rope} x{args.long / args.short:g}, no training"),
            ("finetuned", f"+ {args.rope} x{args.long / args.short:g}, {args.finetune_steps} steps at {args.long}")]


# --- running the public commands in this process ------------------------------------------------

def invoke(argv: list[str]) -> int:
    """``burstengine <argv>`` (the train and export commands), run in this process by the dispatcher."""
    return main(argv)


def engine_eval(args, name: str) -> dict | None:
    """The training run's own last evaluation (the engine's passkey accuracy at its seq_len)."""
    path = os.path.join(args.dir, "runs", name, "metrics.jsonl")
    if not os.path.exists(path):
        return None
    evals = [r for r in read_jsonl(path) if r.get("kind") == "eval"]
    summary = [r for r in read_jsonl(path) if r.get("kind") == "summary"]
    if not evals:
        return None
    out = {"passkey_acc": evals[-1]["passkey_acc"], "samples": evals[-1]["samples"]}
    if summary:
        s = summary[-1]
        out.update(seq_len=s["seq_len"], first_loss=s["first_loss"], final_loss=s["final_loss"],
                   train_s=s.get("wall_s"))
    return out


# --- evaluation in transformers -----------------------------------------------------------------

def passkey_source(args, seq_len: int) -> Passkey:
    """The held-out passkeys of the training runs at ``seq_len`` (as train/data.make_source)."""
    vocab = int(dict(s.split("=") for s in MODEL)["model.vocab_size"])
    task = dict(s.split("=") for s in TASK)
    return Passkey(seq_len, vocab, int(task["passkey_len"]), int(task["passkey_symbols"]), args.seed)


def hf_model(path: str):
    from transformers import AutoModelForCausalLM  # optional dependency (the hf extra)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def passkey_scores(model, source, samples: int, batch: int = 16) -> dict:
    """An HF causal LM's answers to held-out passkeys 0..samples-1 (stream 1, as the trainer's
    evaluation): a sequence is right when every answer token is the argmax; ``answer_loss`` is the
    mean cross-entropy of the answer tokens."""
    right = tok_right = tok_total = 0
    loss = 0.0
    for start in range(0, samples, batch):
        toks, labs, _ = global_sequences(source, range(start, min(samples, start + batch)), stream=1)
        logits = model(input_ids=toks).logits.float()
        keep = labs != IGNORE
        hit = (logits.argmax(-1) == labs) & keep
        right += int((hit.sum(1) == keep.sum(1)).sum())
        tok_right += int(hit.sum())
        tok_total += int(keep.sum())
        loss += torch.nn.functional.cross_entropy(logits[keep], labs[keep], reduction="sum").item()
    return {"passkey_acc": right / samples, "token_acc": tok_right / tok_total, "answer_loss": loss / tok_total,
            "samples": samples}


@torch.no_grad()
def logits_check(args, path: str) -> dict:
    """transformers' logits of the exported model against the engine's (burstengine's Transformer
    loaded from the same directory) on the first held-out sequence of --long tokens."""
    toks, _, _ = global_sequences(passkey_source(args, args.long), [0], stream=1)
    ref = hf_model(path)(input_ids=toks).logits.float()
    ours = load_hf_model(path)
    got = (ours(toks, torch.arange(toks.shape[1])) @ ours.head_weight.t()).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    return {"seq": args.long, "max_rel_err": err, "tol": 1e-4, "ok": err <= 1e-4,
            "argmax_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item()}


def evaluate(args, log) -> tuple[list[dict], dict]:
    rows = []
    for name, _ in models(args):
        path = model_dir(args, name)
        m = hf_model(path)
        for L in lengths(args.short, args.long):
            r = passkey_scores(m, passkey_source(args, L), args.samples)
            rows.append({"model": name, "seq": L, **r})
            log(f"evaluate: {name} at {L} tokens: passkey {r['passkey_acc']:.1%}, answer loss "
                f"{r['answer_loss']:.4f}")
        del m
    check = logits_check(args, model_dir(args, "finetuned"))
    log(f"evaluate: transformers vs engine logits of {model_dir(args, 'finetuned')} at {args.long} tokens: max "
        f"relative error {check['max_rel_err']:.1e} ({'ok' if check['ok'] else 'ABOVE ' + str(check['tol'])})")
    return rows, check


# --- the table ----------------------------------------------------------------------------------

def print_table(args, rows, engine, stage_s, check, total_s) -> None:
    Ls = lengths(args.short, args.long)
    acc = {(r["model"], r["seq"]): r for r in rows}
    chance = 1 / int(dict(s.split("=") for s in TASK)["passkey_symbols"])
    print()
    print(f"Passkey accuracy in transformers ({args.samples} held-out sequences per length, chance {chance:.1%}); "
          f"answer loss: mean cross-entropy of the answer token at {args.long}; engine: the training run's own "
          f"evaluation at its length")
    head = f"{'model':<44}" + "".join(f"{L:>8}" for L in Ls) + f"{'loss@' + str(args.long):>12}{'engine':>14}"
    print(head)
    print("-" * len(head))
    for name, what in models(args):
        cells = "".join(f"{acc[(name, L)]['passkey_acc']:>8.1%}" for L in Ls)
        e = engine.get(name)
        eng = f"{e['passkey_acc']:.1%}@{e['seq_len']}" if e and "seq_len" in e else "-"
        print(f"{name + ': ' + what:<44}{cells}{acc[(name, args.long)]['answer_loss']:>12.4f}{eng:>14}")
    print()
    print("wall time per stage: " + ", ".join(f"{s} {t:.1f}s" for s, t in stage_s.items()) + f"; total {total_s:.1f}s")
    print(f"transformers vs engine logits ({args.long} tokens, fine-tuned export): max relative error "
          f"{check['max_rel_err']:.1e}, argmax agreement {check['argmax_agreement']:.3f}: "
          + ("OK" if check["ok"] else f"ABOVE {check['tol']:g}"))
    before, after = acc[("stage1", args.long)]["passkey_acc"], acc[("finetuned", args.long)]["passkey_acc"]
    print(f"at {args.long} tokens: {before:.1%} before the extension, {after:.1%} after it", flush=True)


# --- the command --------------------------------------------------------------------------------

def validate(args) -> str | None:
    msg = missing_package("transformers", "burstengine demo finetune (its evaluation)")
    if msg:
        return msg
    if under_launcher():
        return "burstengine demo finetune starts its own ranks: run it without torchrun"
    for name in ("world", "short_steps", "short_batch", "finetune_steps", "finetune_batch", "samples"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if args.seed < 0:
        return f"--seed must be >= 0, got {args.seed}"
    if not 0 < args.finetune_lr <= 1:
        return f"--finetune-lr must be in (0, 1], got {args.finetune_lr}"
    if not args.long > args.short:
        return f"--long ({args.long}) must be longer than --short ({args.short})"
    unit = 2 * args.world  # the zigzag layout of the training runs
    for flag in ("short", "long"):
        if getattr(args, flag) % unit:
            return f"--{flag} {getattr(args, flag)} is not divisible by {unit} (2 x --world, the zigzag layout)"
    if args.short < 16:
        return f"--short must be >= 16 for a passkey and its question, got {args.short}"
    if args.eval_only:
        missing = [model_dir(args, n) for n, _ in models(args)
                   if not os.path.isfile(os.path.join(model_dir(args, n), "config.json"))]
        if missing:
            return f"--eval-only: no exported model in {', '.join(missing)}: run the demo without --eval-only first"
    return None


def run(args) -> int:
    started = time.time()
    msg = validate(args)
    if msg:
        print(f"burstengine demo finetune: error: {msg}", file=sys.stderr)
        return 2
    log = RankLog("demo finetune")  # one process: it starts the ranks of each stage
    steps = plan(args)
    if not args.eval_only:
        log(f"{args.world} gloo ranks; a {args.short}-token model extended to {args.long} tokens with {args.rope} "
            f"RoPE scaling; everything goes to {args.dir}/. The stages, as commands you can run by hand:")
        for stage, cmds in steps.items():
            for c in cmds:
                print(f"    {shell(c)}", flush=True)
    stage_s = {}
    for stage in STAGES[:-1] if not args.eval_only else ():
        t0 = time.perf_counter()
        for argv in steps[stage]:
            log(f"{stage}: {shell(argv)}")
            code = invoke(argv)
            if code:
                log(f"{stage}: the command exited with {code}; stopping")
                return code
        stage_s[stage] = time.perf_counter() - t0
    t0 = time.perf_counter()
    log(f"evaluate: the exported models in transformers at {', '.join(map(str, lengths(args.short, args.long)))} "
        f"tokens ({args.samples} held-out passkeys each)")
    rows, check = evaluate(args, log)
    stage_s["evaluate"] = time.perf_counter() - t0
    engine = {name: engine_eval(args, name) for name, _ in models(args)}
    total = time.time() - started
    print_table(args, rows, engine, stage_s, check, total)
    if args.record:
        path = write_record(args.record, dict(
            kind="demo_finetune", world=args.world, short=args.short, long=args.long, rope=args.rope,
            rope_sets=rope_sets(args), model=list(MODEL), task=list(TASK), seed=args.seed, samples=args.samples,
            short_steps=args.short_steps, finetune_steps=args.finetune_steps, eval_only=args.eval_only,
            models=[{"name": n, "what": w} for n, w in models(args)], evals=rows, engine=engine,
            logits_check=check, stage_s=stage_s,
            commands={stage: [shell(c) for c in cmds] for stage, cmds in steps.items()},
            # from the command's start (after Python's imports) to the table: every stage
            wall_s=total))
        print(f"record: {path}", flush=True)
    return 0 if check["ok"] else 1


# --- docs/results.md ----------------------------------------------------------------------------

def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def table_of(rec) -> list[str]:
    """Passkey accuracy of each model of `burstengine demo finetune` at each length (in
    transformers), its answer loss at the long length and the training run's own evaluation."""
    Ls = sorted({r["seq"] for r in rec["evals"]})
    by = {(r["model"], r["seq"]): r for r in rec["evals"]}
    body = []
    for m in rec["models"]:
        e = (rec.get("engine") or {}).get(m["name"]) or {}
        body.append([f"{m['name']}: {m['what']}"] + [_pct(by[(m["name"], L)]["passkey_acc"]) for L in Ls]
                    + [num(by[(m["name"], rec["long"])]["answer_loss"]),
                       f"{_pct(e['passkey_acc'])} at {e['seq_len']}" if e.get("seq_len") else "—"])
    return table(["model"] + [f"passkey @{L}" for L in Ls] + [f"answer loss @{rec['long']}", "engine's own eval"],
                 body)


def render(rec):
    chk = rec["logits_check"]
    stages = ", ".join(f"{k} {fixed(v, 1)} s" for k, v in rec["stage_s"].items())
    head = [f"{rec['world']} gloo ranks on a {rec['env'].get('cpu_count', '?')}-core machine; a {rec['short']}-token "
            f"model extended to {rec['long']} tokens ({', '.join(rec['rope_sets'])}); {rec['samples']} held-out "
            f"passkeys per length, evaluated in transformers. Whole command {fixed(rec['wall_s'], 1)} s ({stages}). "
            f"transformers' logits of the fine-tuned export against the engine's at {chk['seq']} tokens: max relative "
            f"error {num(chk['max_rel_err'])} ({'within' if chk['ok'] else 'NOT within'} {num(chk['tol'])}).", ""]
    return head + table_of(rec)


DEMO_FINETUNE = "demo_finetune_cpu.json"  # the record the docs quote


def block_demo_finetune(records):
    rec = record(records, DEMO_FINETUNE)
    by = {(r["model"], r["seq"]): r["passkey_acc"] for r in rec["evals"]}
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in rec["stage_s"].items())
    return "\n".join(table_of(rec)
                     + [f"Passkey accuracy at {rec['long']} tokens: {_pct(by[('stage1', rec['long'])])} before the "
                        f"extension, {_pct(by[('finetuned', rec['long'])])} after it. The whole command took "
                        f"{rec['wall_s']:.0f} s on a {rec['env'].get('cpu_count', '?')}-core machine with "
                        f"{rec['world']} ranks ({stages}; `{DEMO_FINETUNE}`)."])


def block_demo_finetune_line(records):
    """The README's line: accuracy before and after the extension, scaling alone, time."""
    rec = record(records, DEMO_FINETUNE)
    by = {(r["model"], r["seq"]): r["passkey_acc"] for r in rec["evals"]}
    L = rec["long"]
    return (f"Passkey accuracy at {L} tokens in transformers: {_pct(by[('stage1', L)])} before the extension, "
            f"{_pct(by[('scaled', L)])} with the RoPE scaling alone, {_pct(by[('finetuned', L)])} after the "
            f"fine-tune; {rec['wall_s']:.0f} s on {rec['env'].get('cpu_count', '?')} cores (`{DEMO_FINETUNE}`).")


def _wrap(cmd: str, width: int = 100) -> str:
    """A long command as shell lines of at most ~``width`` characters, cut before a ``--set``."""
    head, *sets = cmd.split(" --set ")
    lines = [head]
    for s in sets:
        if len(lines[-1]) + len(s) + 7 > width:
            lines[-1] += " \\"
            lines.append("  --set " + s)
        else:
            lines[-1] += " --set " + s
    return "\n".join(lines)


def block_demo_finetune_commands(records):
    rec = record(records, DEMO_FINETUNE)
    lines = ["```bash"]
    for stage, cmds in rec["commands"].items():
        lines.append(f"# {stage}")
        lines += [_wrap(c) for c in cmds]
    return "\n".join(lines + ["```"])


SECTIONS = (Section("Context extension on CPU", r"^demo_finetune", render,
                    "`burstengine demo finetune --record NAME`: a 256-token model extended to 2K tokens by RoPE "
                    "scaling and a fine-tune, exported, evaluated in transformers."),)
BLOCKS = {"demo-finetune": block_demo_finetune, "demo-finetune-line": block_demo_finetune_line,
          "demo-finetune-commands": block_demo_finetune_commands}
