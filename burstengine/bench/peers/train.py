"""End-to-end training throughput: BurstEngine beside torch-native context parallelism.

    torchrun --nproc_per_node 2 -m burstengine bench train --model llama-7b \\
        --seqs 131072,262144,524288 --longest

Same model, same FSDP2 setup (parameters sharded over all ranks, bf16 compute, fp32 reduce
and master weights), same data and loss, same launch; only the attention differs: ``burst``
(BurstAttention over our layout) or ``torch-cp`` (plain SDPA inside
torch.distributed.tensor.experimental.context_parallel, its head-tail load balancing).  For
each total sequence length it runs --warmup + --steps optimizer steps per method and reports
the median step time as tokens/s per GPU (TGS), MFU (docs/design.md's FLOPs per token, 989 TFLOP/s
on H100/H200) and peak allocated memory (max over ranks), then writes a JSON record with the
raw step times.  ``--longest`` finds, per method and for this launch's GPU count, the longest
sequence that trains: it doubles the sequence after the last one until a method runs out of
memory (or passes --max-seq), then bisects between the longest that trained and the shortest that
did not (to --resolution of it), and reports that row's MFU and peak memory beside the other
methods' (torch-native CP in the same launch).  Each row also carries what the planner predicted
for it (``planned``: parameters and states, kept activations, transient, host; the line
``burstengine train`` says before its first step).  The loss of step 0 is printed per method: the
same batch and weights give the same loss whichever attention runs (a cheap end-to-end
correctness check).

On a CPU machine without torchrun it spawns --world gloo ranks (a tiny model, burst only, by
default) so the whole path can be tried anywhere; torch-cp needs CUDA (torch's CP has no rule
for the CPU SDPA kernel).

``--ablation`` runs the BurstEngine ablation instead (paper Table 2: baseline, + burst backward,
+ fused LM head/loss, + sequence-level selective checkpointing, vs keeping every attention
output) and the memory-vs-split curve of sequence-level checkpointing, all with BurstAttention
(see burstengine/bench/peers/ablation.py):

    torchrun --nproc_per_node 4 -m burstengine bench train --ablation --model llama-7b --seqs 524288
"""
from __future__ import annotations

import argparse
import gc
import time

import torch
import torch.distributed as dist

from ...attention.checks import arg_checks
from ...timing import median
from ...train import Trainer, load
from ...train.metrics import peak_memory_gib
from ..harness import ranked_bench, step_check_level, step_overrides_refused
from ..probes.profile import allocator_counts
from ..records import OUT_DIR_HELP, write_record
from ..tables import Section, device_of, fixed, med, num, ratio, record, table
from . import ablation
from .ablation import runs_of
from .methods import METHODS as ALL_METHODS, unknown
from .plain_llama import best_case

METHODS = ("burst", "torch-cp", "plain")  # a GPU run's unless --methods says otherwise


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="preset (default: llama-7b on GPU, tiny on CPU)")
    p.add_argument("--seqs", default=None, help="total sequence lengths, comma-separated "
                                                "(default: 131072,262144,524288 on GPU, 512,1024 on CPU)")
    p.add_argument("--longest", action="store_true",
                   help="then double the sequence until a method runs out of memory (or passes --max-seq), and "
                        "bisect to the longest that trains")
    p.add_argument("--max-seq", type=int, default=None,
                   help="cap for --longest (default: 4194304 on GPU, 2048 on CPU)")
    p.add_argument("--resolution", type=float, default=0.125,
                   help="--longest stops bisecting when the gap is at most this share of the longest that "
                        "trained [%(default)s]")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated subset of {','.join(METHODS)} [cuda: all, cpu: burst]")
    p.add_argument("--steps", type=int, default=5, help="timed steps per case [%(default)s]")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first [%(default)s]")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="config overrides for every case (e.g. activation_checkpoint=selective)")
    p.add_argument("--fallback", default="full,full-offload",
                   help="activation_checkpoint plans to retry a case with, in order, when it runs out of memory "
                        "under the planned one (each method gets the best plan that fits: the planner counts "
                        "BurstEngine's memory, not a peer's); '' for none; not with --set activation_checkpoint "
                        "[%(default)s]")
    p.add_argument("--name", default=None, help="record name [train_<model>_<world>x<device>]")
    p.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    p.add_argument("--ablation", action="store_true",
                   help="run the ablation rows (BurstEngine Table 2) and the memory-vs-split curve instead of "
                        "--methods (default seqs: 524288 on GPU, 512 on CPU)")
    p.add_argument("--rows", default=None,
                   help="ablation rows to run, comma-separated, from baseline,+burst-bwd,+fused-loss,+seq-ckpt,"
                        "store-all,selective,curve [all but selective]")
    p.add_argument("--split", type=float, default=0.5,
                   help="activation_checkpoint_split of the +seq-ckpt row: share of each rank's tokens whose attention "
                        "output is kept [%(default)s]")
    p.add_argument("--splits", default="0,0.25,0.5,0.75,1",
                   help="activation_checkpoint_split values of the memory-vs-split curve [%(default)s]")
    p.add_argument("--append", action="store_true",
                   help="--ablation: add this launch's rows to the record of the same name instead of replacing it")
    p.add_argument("--world", type=int, default=None, help="ranks to spawn without torchrun [one per GPU, else 2]")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before spawned ranks are stopped")


def _say(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_case(model: str, method: str, seq: int, args, config: list[str] = (), row: dict | None = None) -> dict:
    """One (method, sequence): a fresh trainer, warm-up + timed steps; OOM is reported, not raised.
    ``config``: overrides after --set's (an ablation row's); ``row``: the fields the result starts from.
    The attention's argument checks run at `burstengine train`'s level (bench/harness.py)."""
    with arg_checks(step_check_level()):
        return _run_case(model, method, seq, args, config, row)


def _run_case(model, method, seq, args, config, row) -> dict:
    # cp=0 (all ranks) unless --set cp=N asks for data parallelism beside it (the paper's Table 5)
    over = ["cp=0"] + list(args.overrides) + list(config) + [
        f"seq_len={seq}", f"attention={ALL_METHODS[method].attention}", "progress=false", f"steps={args.warmup + args.steps}",
        "batch_size=1", "grad_accum=1", "eval_every=0"]
    row = dict(row or {}, method=method, seq_len=seq)
    trainer = None
    oom = torch.zeros(1)
    try:
        cfg = load(model, over)
        trainer = Trainer(cfg, echo=False, lock=False)  # never writes a run directory
        dev = trainer.device
        oom = oom.to(dev)
        row["planned"] = {k: v / 2**30 if type(v) is int and k != "tokens" else v  # bytes -> GiB
                          for k, v in trainer.memory_needs().items() if v is not None}
        row["planned_line"] = trainer.memory_line()
        times, warm, first_loss = [], [], None
        stats0 = {}
        for step in range(args.warmup + args.steps):
            if step == args.warmup and dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
                stats0 = allocator_counts(dev)
            batch = trainer.batch(step)
            _sync(dev)
            dist.barrier()
            t0 = time.perf_counter()
            loss_sum, count, _ = trainer.train_step(batch, step)
            _sync(dev)
            dt = time.perf_counter() - t0
            if step == 0:
                total = loss_sum.clone()
                dist.all_reduce(total)
                first_loss = (total / count).item()
            (times if step >= args.warmup else warm).append(dt)
        t = torch.tensor(times + warm, dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace of a step
        t, w = t[:len(times)], t[len(times):]
        mem = torch.tensor([peak_memory_gib(dev)], device=dev)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        med = median(t.tolist())
        world = dist.get_world_size()
        tgs = seq * trainer.mesh.dp / world / med  # every data-parallel rank group trains its own sequence
        peak = trainer.peak
        # the untimed steps too: the first step at a length (kernel builds, autotuning, allocation)
        row.update(ok=True, cp=trainer.mesh.cp, dp=trainer.mesh.dp, step_times_s=t.tolist(), warmup_step_times_s=w.tolist(),
                   median_step_s=med, tokens_per_s_per_gpu=tgs,
                   mfu=tgs * trainer.flops_per_token / peak if peak else None, peak_mem_gib=mem.item(),
                   first_loss=first_loss, flops_per_token=trainer.flops_per_token)
        if stats0:  # the caching allocator over the timed steps: retries free its cache (a device-wide stall)
            row["allocator"] = {k: v - stats0[k] for k, v in allocator_counts(dev).items()}
        plan = getattr(trainer.model, "checkpoint_plan", None)
        if plan:  # checkpoint="auto": how many layers took each policy, and the host memory offloading took
            row["checkpoint_plan"] = {p: plan.count(p) for p in dict.fromkeys(plan)}
        if trainer.model.offloader is not None:
            row["offload_host_gib"] = trainer.model.offloader.host_bytes() / 2**30
    except torch.OutOfMemoryError:
        oom.fill_(1)
        row.update(ok=False, error="out of memory")
    except RuntimeError as e:  # pinned host memory that could not be had (model/offload.py)
        if not str(e).startswith("offload:"):
            raise
        oom.fill_(1)
        row.update(ok=False, error=f"out of host memory: {str(e).splitlines()[0][:160]}")
    except NotImplementedError as e:  # torch-cp on CPU: its ring patches only the CUDA SDPA ops
        oom.fill_(1)
        row.update(ok=False, error=f"not supported here: {str(e).splitlines()[0][:160]}")
    finally:
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    # every rank must agree that the case failed before the next one starts
    if oom.device.type == "cpu" and torch.cuda.is_available():
        oom = oom.cuda()
    dist.all_reduce(oom, op=dist.ReduceOp.MAX)
    if oom.item() and row.get("ok"):
        row.update(ok=False, error="failed on another rank")
    return row


def fitting_case(model: str, method: str, seq: int, args, case=None) -> dict:
    """``run_case`` under the planned checkpointing, then, while it runs out of device memory, under
    each of ``--fallback``'s plans: the row of the first that trains (or the last OOM), with the
    plans that did not fit in ``row["tried"]``.  A user's own activation_checkpoint is kept as is."""
    case = case or run_case
    row = case(model, method, seq, args)
    own = any(o.split("=", 1)[0].strip() == "activation_checkpoint" for o in args.overrides)
    tried = []
    for plan in [] if own else _fallback_plans(args):
        if row["ok"] or row.get("error") != "out of memory":
            break
        tried.append({"activation_checkpoint": row.get("activation_checkpoint", "auto"), "error": row["error"]})
        _say(f"{method:>9} S={seq:>8}: out of memory; again with activation_checkpoint={plan}")
        row = case(model, method, seq, args, [f"activation_checkpoint={plan}"], {"activation_checkpoint": plan})
    if tried:
        row["tried"] = tried
    return row


def _fallback_plans(args) -> list[str]:
    return [p for p in (args.fallback or "").split(",") if p]


def _ablation_seqs(args) -> list[int]:
    try:
        return [int(s) for s in (args.seqs or ("524288" if torch.cuda.is_available() else "512")).split(",")]
    except ValueError:
        raise ValueError(f"--seqs must be comma-separated integers, got {args.seqs!r}") from None


def run_rank(args) -> int:
    on_gpu = torch.cuda.is_available()
    model = args.model or ("llama-7b" if on_gpu else "tiny")
    world = dist.get_world_size()
    if args.ablation:
        if args.longest:
            _say("error: --longest does not apply to --ablation")
            return 2
        try:
            seqs = _ablation_seqs(args)
        except ValueError as e:
            _say(f"error: {e}")
            return 2
        name = args.name or f"ablation_{model}_{world}x{'gpu' if on_gpu else 'cpu'}"
        return ablation.run(args, model, seqs, run_case, name, _say)
    seqs = [int(s) for s in (args.seqs or ("131072,262144,524288" if on_gpu else "512,1024")).split(",")]
    max_seq = args.max_seq or (4194304 if on_gpu else 2048)
    methods = [m for m in args.methods.split(",") if m]
    bad = unknown("train", methods)
    if bad:
        _say(f"error: unknown methods {bad}; expected {METHODS}")
        return 2
    _say(f"{model} on {world} x {torch.cuda.get_device_name() if on_gpu else 'cpu'}: {', '.join(methods)} at "
         f"{', '.join(map(str, seqs))}{' then doubling' if args.longest else ''}; {args.warmup} warm-up + "
         f"{args.steps} timed steps each; overrides {args.overrides or 'none'}")
    rows = []
    # what the figures are: per GPU and allocated memory, or per rank and its peak RSS on CPU (metrics.py)
    per, peak_label = ("GPU", "peak") if on_gpu else ("rank", "peak RSS")
    name = args.name or f"train_{model}_{world}x{'gpu' if on_gpu else 'cpu'}"
    longest = {}
    payload = {"model": model, "world": world, "methods": methods, "warmup": args.warmup, "steps": args.steps,
               "overrides": args.overrides, "rows": rows, **({"longest": longest} if args.longest else {})}
    path = None  # the first write picks a free name; later rows rewrite that file (a timeout keeps the rows done)
    unit = 2 * world * (1024 if on_gpu else 16)  # zigzag's 2 x cp chunks, in round lengths
    for method in methods:
        todo = list(seqs)
        trained, failed = None, None  # --longest: the longest row that trained, the shortest length that did not
        while todo:
            seq = todo.pop(0)
            if ALL_METHODS[method].attention == "plain":
                if world > 1:
                    _say("plain: the plain-PyTorch baseline runs on one GPU (no context parallelism); skipped")
                    break
                cfg = load(model, list(args.overrides))
                tried = best_case(cfg.model, seq, args.warmup, args.steps, torch.device(
                    "cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu"), say=_say)
                rows += tried[:-1]
                row = tried[-1]
                row["plain_ac"] = row["method"]  # plain-<the activation checkpointing that fit>
                row["method"] = "plain"
            else:
                row = fitting_case(model, method, seq, args)
            rows.append(row)
            if row["ok"]:
                mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
                plan = f" (activation_checkpoint={row['activation_checkpoint']})" if row.get("activation_checkpoint") else ""
                _say(f"{method:>9} S={seq:>8}: {row['median_step_s']:.3f} s/step, {row['tokens_per_s_per_gpu']:,.0f} "
                     f"tok/s/{per}, MFU {mfu}, {peak_label} {row['peak_mem_gib']:.1f} GiB, step-0 loss "
                     f"{row['first_loss']:.5f}{plan}")
            else:
                _say(f"{method:>9} S={seq:>8}: {row['error']}")
            if args.longest:
                if row["ok"] and (trained is None or seq > trained["seq_len"]):
                    trained = row
                elif not row["ok"]:
                    failed = seq if failed is None else min(failed, seq)
                if trained is not None:
                    longest[method] = {k: trained.get(k) for k in ("seq_len", "mfu", "peak_mem_gib",
                                                                    "tokens_per_s_per_gpu", "median_step_s")}
            if dist.get_rank() == 0:
                path = write_record(name, payload, out_dir=args.out_dir, path=path)
            if args.longest and not todo:
                nxt = next_longest(trained["seq_len"] if trained else None, failed, max_seq, unit, args.resolution)
                if nxt is not None:
                    todo.append(nxt)
    # the table, and ratios to torch-cp at the same sequence
    by = {(r["method"], r["seq_len"]): r for r in rows}
    if dist.get_rank() == 0:
        print(f"\n{'method':>9} {'seq':>9} {'s/step':>8} {'tok/s/' + per:>11} {'MFU':>7} {'GiB':>7} {'TGS/peer':>13}")
        for r in rows:
            if not r["ok"]:
                print(f"{r['method']:>9} {r['seq_len']:>9} {r['error']}")
                continue
            base = by.get(("torch-cp", r["seq_len"])) or by.get(("plain", r["seq_len"]))
            ratio = f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.2f}x" if base and base["ok"] else "-"
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
            print(f"{r['method']:>9} {r['seq_len']:>9} {r['median_step_s']:>8.3f} {r['tokens_per_s_per_gpu']:>11,.0f} "
                  f"{mfu:>7} {r['peak_mem_gib']:>7.1f} {ratio:>13}")
        for seq in sorted({r["seq_len"] for r in rows}):
            a, b = by.get(("burst", seq)), by.get(("torch-cp", seq))
            if a and b and a["ok"] and b["ok"]:
                rel = abs(a["first_loss"] - b["first_loss"]) / abs(b["first_loss"])
                print(f"S={seq}: step-0 loss burst {a['first_loss']:.5f} vs torch-cp {b['first_loss']:.5f} "
                      f"(rel diff {rel:.1e})")
        for method, r in longest.items():
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
            print(f"longest that trains on {world} GPU(s): {method} {r['seq_len']:,} tokens, MFU {mfu}, peak "
                  f"{r['peak_mem_gib']:.1f} GiB, {r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU")
        path = write_record(name, payload, out_dir=args.out_dir, path=path)
        print(f"record: {path}")
    return 0


def next_longest(trained: int | None, failed: int | None, cap: int, unit: int, resolution: float) -> int | None:
    """--longest's next length to try (None: done), a multiple of ``unit``: double the longest
    that trained until one fails or passes ``cap``, then bisect between them until the gap is at
    most ``resolution`` of the longest that trained (or one unit); halve while nothing has trained."""
    if trained is None:
        nxt = failed // 2 // unit * unit
        return nxt if nxt >= unit else None
    if failed is None:
        return trained * 2 if trained * 2 <= cap else None
    if failed - trained <= max(unit, resolution * trained):
        return None
    mid = (trained + failed) // 2 // unit * unit
    return mid if trained < mid < failed else None


def validate(args) -> str | None:
    """One line for arguments that cannot work (before any rank starts), else None."""

    on_gpu = torch.cuda.is_available()
    model = args.model or ("llama-7b" if on_gpu else "tiny")
    refused = step_overrides_refused(args.overrides, "bench train")
    if refused:
        return refused
    for plan in _fallback_plans(args):
        try:
            load(model, list(args.overrides) + [f"activation_checkpoint={plan}"])
        except ValueError as e:
            return f"--fallback {plan}: {e}"
    try:
        load(model, list(args.overrides))
        seqs = _ablation_seqs(args) if args.ablation else \
            [int(s) for s in (args.seqs or "1").split(",") if s]
    except ValueError as e:
        return str(e).replace("invalid literal for int() with base 10", "--seqs takes comma-separated integers")
    if not seqs or min(seqs) < 1 or (args.max_seq is not None and args.max_seq < 1):
        return "--seqs and --max-seq must be positive"
    if args.steps < 1 or args.warmup < 0:
        return "--steps must be >= 1 and --warmup >= 0"
    if not 0 < args.resolution < 1:
        return f"--resolution must be in (0, 1), got {args.resolution}"
    if args.ablation:

        if args.longest:
            return "--longest does not apply to --ablation"
        try:  # a bad row, split or length fails here, before any rank is spawned
            runs_of(args, model, seqs, args.world)
        except ValueError as e:
            return str(e)
        return None
    methods = [m for m in (args.methods or "").split(",") if m]
    bad = unknown("train", methods)
    if bad or not methods:
        return f"unknown methods {bad}; expected some of {METHODS}"
    if any(ALL_METHODS[m].cuda_only for m in methods) and not on_gpu:
        return "torch-cp (torch's context_parallel) needs CUDA GPUs: torch has no CPU rule for it; use --methods burst"
    for seq in seqs:  # what every case's config will say on these ranks (--longest's doublings divide alike)
        try:
            load(model, ["cp=0"] + list(args.overrides) + [f"seq_len={seq}"]).check_world(args.world)
        except ValueError as e:
            return f"--seqs {seq}: {e}"
    return None


def _default_methods(args) -> None:
    if args.methods is None:
        args.methods = ",".join(METHODS) if torch.cuda.is_available() else "burst"


build_parser, main = ranked_bench("train", __doc__, add_arguments, run_rank, validate, prepare=_default_methods)


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    if "summary" in rec:  # a `burstengine train` run: summary + held-out evaluations
        s = rec["summary"]
        out = [f"{s['steps']} steps, world {s['world']} (dp {s['dp']} × cp {s['cp']}), seq {s['seq_len']}, "
               f"layout {s.get('layout')}: loss {fixed(s['first_loss'], 3)} → {fixed(s['final_loss'], 3)}, "
               f"{num(s['mean_step_time_s'])} s per step, {num(s['mean_tokens_per_s_per_gpu'], 4)} tokens/s per rank.",
               ""]
        body = [[e["step"], e["samples"], fixed(e["passkey_acc"], 3), fixed(e["chance_passkey_acc"], 3),
                 " / ".join(fixed(x, 2) for x in e["passkey_acc_by_depth"])] for e in rec.get("evals", [])]
        return out + table(["step", "samples", "passkey accuracy", "chance", "by depth quartile"], body)
    body = [[r["method"] + (f" ({r['activation_checkpoint']})" if r.get("activation_checkpoint") else ""),
             r.get("seq_len", "—"), num(r.get("ok")),
             num(med(r["step_times_s"]), 4) if r.get("step_times_s") else "—",
             num(r.get("tokens_per_s_per_gpu"), 4), fixed(r.get("mfu"), 3), fixed(r.get("peak_mem_gib"), 1),
             fixed(r.get("first_loss"), 4)] for r in rec["rows"]]
    r0 = rec["rows"][0] if rec["rows"] else {}
    mesh = f" (dp {r0['dp']} × cp {r0['cp']})" if "dp" in r0 else ""
    over = f"; overrides {', '.join(rec['overrides'])}" if rec.get("overrides") else ""
    head = [f"model {rec.get('model', '?')}, world {rec.get('world', '?')}{mesh}, {rec.get('steps', '?')} steps after "
            f"{rec.get('warmup', '?')} warm-up{over}.", ""]
    return head + table(["method", "seq", "ok", "median step s", "tokens/s/GPU", "MFU", "peak GiB", "step-0 loss"],
                        body)


def block_train_3b(records):
    """docs/training.md: BurstEngine against the plain-PyTorch baseline on one H200 (one launch),
    where the 128K step's time goes, and the clock the board's power limit left it."""
    name, prof_name, clk_name = "train_llama-3b_1xh200.json", "profile_3b_128k_pointwise.json", \
        "clocks_train_3b_h200.json"
    rec, prof, clk = record(records, name), record(records, prof_name), record(records, clk_name)
    rows = {(r["method"], r["seq_len"]): r for r in rec["rows"] if r.get("ok")}
    body = []
    for S in sorted({S for _, S in rows}):
        b, p = rows[("burst", S)], rows[("plain", S)]
        body.append([f"{S // 1024}K", fixed(b["median_step_s"], 2), f"{100 * b['mfu']:.1f}%",
                     fixed(b["peak_mem_gib"], 1), fixed(p["median_step_s"], 2), f"{100 * p['mfu']:.1f}%",
                     p.get("plain_ac", "plain"), f"{ratio(p['median_step_s'], b['median_step_s'])}×"])
    cats = ", ".join(f"{k} {fixed(v, 2)} s" for k, v in prof["categories_s"].items())
    c = clk["summary"]
    return "\n".join([f"On {device_of(rec)}, Llama-3.2-3B shapes, `{name}` (commit {rec['commit']}, BurstEngine "
                      "and the plain baseline in one launch; MFU as defined above):", ""]
                     + table(["tokens", "BurstEngine s/step", "MFU", "peak GiB", "plain s/step", "MFU",
                              "plain's checkpointing", "tokens/s vs plain"], body)
                     + ["", f"One 128K step under the profiler (`{prof_name}`, commit {prof['commit']}): {cats}. During "
                        f"a run of the same command (commit {clk['commit']}) the SM clock's median was {c['median_sm_mhz']:.0f} of {c['max_sm_mhz']:.0f} MHz at "
                        f"{c['median_power_w']:.0f} of {c['limit_w']:.0f} W, power-capped in "
                        f"{100 * c['share_of_loaded_samples_throttled_by']['sw power cap']:.0f}% of the loaded "
                        f"samples (`{clk_name}`)."])


def _plan_cell(row) -> str:
    """A record row's checkpointing plan as "9 offload, 19 pointwise" (its layers per policy)."""
    return ", ".join(f"{n} {p}" for p, n in (row.get("checkpoint_plan") or {}).items())


def block_offload(records):
    """docs/training.md: the 3B step with offloaded layers in auto's plan beside the plan without
    them (the default then; same commit, two launches), where the offloading step waited before
    the fix, and the probe's plans on six layers."""
    names = ("train_llama-3b_1xh200.json", "train_llama-3b_1xh200_offload.json")
    body = []
    for name in names:
        rec = record(records, name)
        for r in rec["rows"]:
            if r.get("method") == "burst" and r.get("ok"):
                body.append([f"`{name}`", f"{r['seq_len'] // 1024}K", _plan_cell(r), fixed(r["median_step_s"], 3),
                             f"{100 * r['mfu']:.1f}%", fixed(r.get("offload_host_gib") or 0, 1)])
    gaps = []
    for name in ("profile_3b_65536_offload_gaps.json", "profile_3b_131072_offload_gaps.json"):
        rec = record(records, name)
        gaps.append(f"at {rec['seq_len'] // 1024}K (`{name}`, commit {rec['commit']}) no compute kernel ran for "
                    f"{fixed(rec['compute_gaps_s']['forward'], 2)} s of the forward, while "
                    f"{fixed(rec['transfer_only_s'], 2)} s of the copies ran alone")
    probe = []
    for name in ("probe_offload_64k.json", "probe_offload_128k.json"):
        rec = record(records, name)
        t = {r["plan"]: r["median_step_s"] for r in rec["rows"] if "median_step_s" in r}
        probe.append(f"at {rec['seq'] // 1024}K (`{name}`) all pointwise {fixed(t['pointwise'], 3)} s, the first "
                     f"three offloaded {fixed(t['3 offload + pointwise'], 3)} s, the first three sequence "
                     f"{fixed(t['3 sequence + pointwise'], 3)} s")
    first, second = record(records, names[0]), record(records, names[1])
    return "\n".join([f"On {device_of(first)}, BurstEngine's rows of `{names[0]}` (commit {first['commit'][:7]}, the "
                      "default plan then, offload off; `bench train --model llama-3b --methods burst,plain --seqs "
                      "65536,131072`) and "
                      f"`{names[1]}` (commit {second['commit'][:7]}, the next launch: the same with `--methods burst "
                      "--set activation_offload=true`):", ""]
                     + table(["record", "tokens", "auto's plan", "s/step", "MFU", "host GiB"], body)
                     + ["", "Before the fix, with the scan read back in every layer: " + "; ".join(gaps) + ".",
                        "", "On six layers alone (`benchmarks/probe_offload.py`): " + "; ".join(probe) + "."])


def _planned(row) -> str:
    """The planner's device total for the step (parameters and states, workspace, kept activations,
    the backward's transient), beside the measured peak; "—" for records made before it was kept."""
    p = row.get("planned")
    return "—" if not p else fixed(p["state"] + p["workspace"] + p["activations"] + p["transient"], 1)


def _scale_block(records, runs, table5, what):
    """A docs block: ``runs`` (records of burst beside torch-native CP, one launch per length) and
    the paper's Table 5 from the ``table5`` records."""
    body = []
    for name in runs:
        rec = record(records, name)
        by = {r["method"]: r for r in rec["rows"]}
        b, t = by["burst"], by.get("torch-cp")
        if t is None and "torch-cp" not in rec.get("methods", ("torch-cp",)):
            peer = "not in this launch (burst alone" + (f", `--set {' '.join(rec['overrides'])}`)" if rec.get("overrides") else ")")
        elif t is None:
            peer = "did not finish in the call (the record's note says why)" if rec.get("note") else \
                "not run (the call's time ran out)"
        elif not t["ok"]:
            peer = t["error"]
        else:
            plan = f" (its default plan out of memory: {t['activation_checkpoint']})" if t.get("tried") else ""
            peer = (f"{fixed(t['median_step_s'], 2)} s, {100 * t['mfu']:.1f}%, {fixed(t['peak_mem_gib'], 1)} GiB"
                    f"{plan}; BurstEngine {ratio(b['tokens_per_s_per_gpu'], t['tokens_per_s_per_gpu'])}×")
        body.append([f"`{name}`", device_of(rec), rec["model"], f"{b['seq_len'] // 1024}K",
                     f"{rec['warmup']} + {rec['steps']}", fixed(b["median_step_s"], 2), f"{100 * b['mfu']:.1f}%",
                     fixed(b["peak_mem_gib"], 1), _planned(b), peer])
    t5 = []
    for name in table5:
        rec = record(records, name)
        r = {x["method"]: x for x in rec["rows"]}["burst"]
        t5.append([f"`{name}`", device_of(rec), r.get("cp", rec["world"]), r.get("dp", 1), f"{r['seq_len'] // 1024}K",
                   f"{100 * r['mfu']:.1f}%", f"{r['tokens_per_s_per_gpu']:,.0f}", fixed(r["peak_mem_gib"], 1)])
    return "\n".join([f"`bench train --methods burst,torch-cp --seqs S` {what}:", ""]
                     + table(["record", "device", "model", "tokens", "steps", "BurstEngine s/step", "MFU",
                              "peak GiB", "planned GiB", "torch-native CP"], body)
                     + ["", "The paper's Table 5 on this machine (32K tokens per GPU, `--set cp=N`; the other ranks "
                        "data parallel, FSDP over all of them):", ""]
                     + table(["record", "device", "CP", "DP", "sequence", "MFU", "tokens/s/GPU", "peak GiB"], t5))


def block_scale_2gpu(records):
    """docs/training.md: the 7B and 3B presets over 2 ranks at 128K and 256K beside torch-native CP,
    and the paper's Table 5 at 32K tokens per GPU."""
    return _scale_block(records, ("train_llama-7b_2gpu_128k.json", "train_llama-7b_2gpu_128k_offload.json",
                                  "train_llama-7b_2gpu_128k_home16.json", "train_llama-7b_2gpu_128k_fsdppool.json",
                                  "train_llama-7b_2gpu_128k_pool.json", "train_llama-7b_2gpu_128k_plan2.json",
                                  "train_llama-7b_2gpu_128k_tiled.json", "train_llama-7b_2gpu_256k.json",
                                  "train_llama-3b_2gpu_128k.json", "train_llama-3b_2gpu_128k_plan2.json"),
                        ("table5_llama-7b_2gpu_cp1.json", "table5_llama-7b_2gpu_cp2.json"),
                        "over 2 ranks, one launch per length (warm-up + timed steps)")


def block_scale_4gpu(records):
    """docs/training.md: llama-8b over 4 ranks at 128K-512K beside torch-native CP (one launch per
    length; a peer that ran out of memory said so), and the paper's Table 5 at 32K tokens per GPU."""
    return _scale_block(records, ("train_llama-8b_4gpu_128k.json", "train_llama-8b_4gpu_128k_pair.json",
                                  "train_llama-8b_4gpu_128k_h100.json", "train_llama-8b_4gpu_256k.json",
                                  "train_llama-8b_4gpu_256k_pair.json", "train_llama-8b_4gpu_256k_warm.json",
                                  "train_llama-8b_4gpu_512k.json",
                                  "train_llama-8b_4gpu_128k_offload.json", "train_llama-8b_4gpu_256k_h200.json"),
                        ("table5_llama-8b_4gpu_cp1.json", "table5_llama-8b_4gpu_cp2.json",
                         "train_llama-8b_4gpu_128k_h100.json", "table5_llama-8b_4gpu_cp1_h200.json",
                         "train_llama-8b_4gpu_128k_offload.json"),
                        "over 4 ranks, one launch per length (warm-up + timed steps; `_256k_pair` and 512K: one cold "
                        "step each)")


# 36's tokens/s at 128K with each long-context option on beside off: (option, record), one launch each
OPTION_RUNS = (("none (the default plan, untiled)", "longctx_speed_3b_128k_base.json"),
               ("`lora.rank=16`", "longctx_speed_3b_128k_lora.json"),
               ("`tiled_mlp=on`", "longctx_speed_3b_128k_tiled.json"),
               ("`activation_checkpoint=full`", "longctx_speed_3b_128k_full.json"),
               ("`activation_checkpoint=full-offload`", "longctx_speed_3b_128k_full_offload.json"))


def block_longctx_options(records):
    """docs/training.md: what each long-context option costs at 128K (the 3B preset, 2 ranks),
    each launch's step time beside the first row's."""
    body, base = [], None
    for option, name in OPTION_RUNS:
        rec = record(records, name)
        r = {x["method"]: x for x in rec["rows"]}["burst"]
        base = base or r
        body.append([option, f"{rec['world']} × {device_of(rec).split('× ')[-1]}", fixed(r["median_step_s"], 2),
                     f"{r['tokens_per_s_per_gpu']:,.0f}", f"{ratio(r['tokens_per_s_per_gpu'], base['tokens_per_s_per_gpu'])}×",
                     f"{100 * r['mfu']:.1f}%", fixed(r["peak_mem_gib"], 1), f"`{name}` ({rec['commit'][:7]})"])
    return "\n".join(["The 3B preset at 128K over 2 ranks (`bench train --model llama-3b --methods burst --seqs 131072 "
                      "--warmup 1 --steps 2 --set ...`, one launch per row, `tiled_mlp=off` unless the row sets it; "
                      "MFU counts 4 × parameters for a frozen base under LoRA):", ""]
                     + table(["option", "GPUs", "s/step", "tokens/s/GPU", "vs none", "MFU", "peak GiB", "record"], body))


SECTIONS = (Section("Training", r"^(train_|ablation|longctx_|table5_)", render,
                    "`burstengine train` and `burstengine bench train` (throughput, ablation)."),)
# auto's tiled-MLP choice measured (35): (what, the untiled record, the tiled record); each pair ran in one
# device call, the first of each pair auto's choice at its commit
TILED_PAIRS = (("llama-7b, 128K over 2 ranks", "train_llama-7b_2gpu_128k_plan2.json", "train_llama-7b_2gpu_128k_tiled.json"),
               ("llama-3b, 64K on 1 GPU", "train_llama-3b_1xh200_64k_untiled.json", "train_llama-3b_1xh200_64k_tiled.json"))


def block_tiled_choice(records):
    """docs/training.md: the same step planned untiled and tiled (`--set tiled_mlp=on`), one device
    call each pair: what auto's rule (recompute.plan_cost) rests on."""
    body = []
    for what, un, ti in TILED_PAIRS:
        u, t = ({x["method"]: x for x in record(records, n)["rows"]}["burst"] for n in (un, ti))
        for name, r, tiled in ((un, u, "no"), (ti, t, "yes")):
            rec = record(records, name)
            body.append([what, device_of(rec), tiled, _plan_cell(r), fixed(r["median_step_s"], 2),
                         f"{100 * r['mfu']:.1f}%", str(r.get("allocator", {}).get("num_alloc_retries", "—")),
                         fixed(r["peak_mem_gib"], 1), f"`{name}` ({rec['commit'][:7]})"])
    return "\n".join(["`bench train --methods burst`, one warm-up step, auto's checkpointing plan; each pair in one "
                      "device call:", ""]
                     + table(["step", "device", "tiled MLP", "plan (layers)", "s/step", "MFU", "allocator retries",
                              "peak GiB", "record"], body))


BLOCKS = {"train-3b": block_train_3b, "offload": block_offload, "scale-2gpu": block_scale_2gpu,
          "scale-4gpu": block_scale_4gpu, "longctx-options": block_longctx_options, "tiled-choice": block_tiled_choice}
