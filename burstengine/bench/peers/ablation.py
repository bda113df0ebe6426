"""The BurstEngine ablation (paper Table 2) and the memory-vs-split curve of sequence-level
selective checkpointing (§3.2, Fig. 7), as rows of ``burstengine bench train --ablation``.

Each row is the training step of ``bench train`` (same model, FSDP2 over all ranks, CP over all
ranks, BurstAttention, bf16 on GPUs) with a few config fields set; the rows of the table add one
optimisation at a time:

=============  ===============================================================================
baseline       RingAttention backward (K, V, dK, dV travel), naive LM head + cross-entropy (the
               N x vocab logits stored), full activation checkpointing
+burst-bwd     BurstAttention's backward (Q, dO, D, lse and dQ travel; K, V stay home)
+fused-loss    fused LM head + cross-entropy (BurstEngine Alg. 3: no logits kept)
+seq-ckpt      sequence-level selective checkpointing: the attention output of the last
               ``--split`` of each rank's tokens kept, the front recomputed
store-all      instead of it: every attention output kept (selective checkpointing++, split 1)
=============  ===============================================================================

and, not run unless named in ``--rows``, ``selective``: the ``selective`` policy (attention's
output *and* its q, k, v kept, only the norms / projections / MLP recomputed).  The paper's
topology-aware ring row has no counterpart on one node: there the ring is a single ring (on
several nodes every row runs the double ring, baseline included).

The curve (``--splits``) runs ``+fused-loss`` with ``activation_checkpoint=sequence`` at each split; a split
that equals a table row's (``--split``, 1) reuses that row's run.  Per run: median step time,
tokens/s per GPU (TGS), MFU, peak allocated memory per GPU (max over ranks; on CPU the process's
peak RSS, which only grows from row to row and says nothing per row), and the step-0 loss, which
must agree between rows (same weights, same batch).  The JSON record is rewritten after every
run, so an interrupted launch keeps what it finished; with ``--append`` a launch adds its rows to
the record of an earlier one (same name), which lets rows that do not fit one job's time run in
several.
"""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from ...train import load
from ..records import free_path, results_dir, write_record

# (name, what it adds, config overrides); each row keeps the ones before it
TABLE = (
    ("baseline", "RingAttention backward, naive LM head + loss, full checkpointing",
     ("attn_backward=ring", "loss=naive", "activation_checkpoint=full", "fused_ops=false")),
    ("+burst-bwd", "+ BurstAttention backward", ("attn_backward=burst",)),
    ("+fused-loss", "+ fused LM head + cross-entropy", ("loss=fused",)),
    ("+seq-ckpt", "+ sequence-level selective checkpointing (split {split:g})",
     ("activation_checkpoint=sequence", "activation_checkpoint_split={split}")),
)
# rows that replace the last table row's checkpointing (on top of +fused-loss)
ALTERNATIVES = (
    ("store-all", "selective checkpointing++: all attention outputs kept (split 1)",
     ("activation_checkpoint=sequence", "activation_checkpoint_split=1")),
    ("selective", "selective policy: attention output and its q, k, v kept", ("activation_checkpoint=selective",)),
    ("+fused-ops", "store-all + RMSNorm, RoPE, SwiGLU as one compiled kernel each",
     ("activation_checkpoint=sequence", "activation_checkpoint_split=1", "fused_ops=true")),
    ("auto", "+ fused ops, checkpointing planned per layer from the device's memory (activation_checkpoint=auto)",
     ("activation_checkpoint=auto", "fused_ops=true")),
)
DEFAULT_ROWS = ("baseline", "+burst-bwd", "+fused-loss", "+seq-ckpt", "store-all", "curve")
ROW_NAMES = tuple(n for n, _, _ in TABLE) + tuple(n for n, _, _ in ALTERNATIVES) + ("curve",)


def _merge(assignments) -> dict:
    return dict(kv.split("=", 1) for kv in assignments)


def row_runs(split: float, splits: list[float], names) -> list[dict]:
    """The runs for row ``names``: dicts with ``rows`` (the names it stands for: a table row and
    the curve's ``split=x`` may be one run), ``what`` and ``config`` (key -> value)."""
    unknown = [n for n in names if n not in ROW_NAMES]
    if unknown:
        raise ValueError(f"unknown ablation rows {unknown}; expected some of {list(ROW_NAMES)}")
    defs, acc = [], {}
    for name, what, over in TABLE:
        acc = {**acc, **_merge([o.format(split=split) for o in over])}
        defs.append((name, what.format(split=split), acc))
    fused = defs[2][2]
    defs += [(name, what, {**fused, **_merge(over)}) for name, what, over in ALTERNATIVES]
    if "curve" in names:
        defs += [(f"split={s:g}", f"curve: activation_checkpoint=sequence, split {s:g}",
                  {**fused, **_merge(["activation_checkpoint=sequence", f"activation_checkpoint_split={s}"])})
                 for s in splits]
    runs: list[dict] = []
    for name, what, cfg in defs:
        if name not in names and not (name.startswith("split=") and "curve" in names):
            continue
        same = next((r for r in runs if _same(r["config"], cfg)), None)
        if same:
            same["rows"].append(name)
        else:
            runs.append({"rows": [name], "what": what, "config": cfg})
    return runs


def _same(a: dict, b: dict) -> bool:
    # the split means nothing without activation_checkpoint=sequence, and 0.50 == 0.5
    def norm(c):
        c = dict(c)
        if c.get("activation_checkpoint") != "sequence":
            c.pop("activation_checkpoint_split", None)
        elif "activation_checkpoint_split" in c:
            c["activation_checkpoint_split"] = float(c["activation_checkpoint_split"])
        return c

    return norm(a) == norm(b)


def runs_of(args, model: str, seqs=(), world: int | None = None) -> tuple[list[dict], list[float]]:
    """The runs the arguments ask for and the curve's splits.  ValueError, before any rank
    starts a run, if a row name, a split, or a row's config (with --set's overrides, at each of
    ``seqs`` on ``world`` ranks) is bad."""
    names = [n for n in (args.rows or ",".join(DEFAULT_ROWS)).split(",") if n]
    try:
        splits = [float(s) for s in args.splits.split(",") if s] if args.splits else []
    except ValueError:
        raise ValueError(f"--splits must be numbers in [0, 1], got {args.splits!r}") from None
    for s in [args.split] + splits:
        if not 0.0 <= s <= 1.0:
            raise ValueError(f"split {s} is not in [0, 1]")
    runs = row_runs(args.split, splits, names)
    for r in runs:
        for seq in seqs or [None]:
            # cp=0 before --set's, as bench train runs it (--set cp=N keeps data parallelism beside it)
            cfg = load(model, (["cp=0"] if seq else []) + list(args.overrides)
                       + [f"{k}={v}" for k, v in r["config"].items()] + ([f"seq_len={seq}"] if seq else []))
            if seq and world:
                cfg.check_world(world)
    return runs, splits


def run(args, model: str, seqs: list[int], run_case, record_name: str, say) -> int:
    """All ranks: every run of the ablation at every sequence, the tables, the record (rank 0);
    ``run_case`` and ``say`` (print on rank 0) are bench/peers/train.py's."""
    world = dist.get_world_size()
    try:
        runs, splits = runs_of(args, model, seqs, world)
    except ValueError as e:
        say(f"error: {e}")
        return 2
    out_dir = results_dir(args.out_dir)
    path = os.path.join(out_dir, f"{record_name}.json")
    done, earlier = [], []
    own = None  # the record this launch rewrites after every run: --append's, else its first write's
    if args.append and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        done, earlier = old.get("rows", []), old.get("earlier_commands", []) + [old.get("command")]
        own = path
    elif os.path.isdir(out_dir):
        path = free_path(out_dir, record_name)  # a new record never replaces an earlier one
    say(f"ablation of {model} on {world} ranks at S={', '.join(map(str, seqs))}: "
         f"{', '.join('/'.join(r['rows']) for r in runs)}; {args.warmup} warm-up + {args.steps} timed steps each; "
         f"overrides {args.overrides or 'none'}" + (f"; appending to {path} ({len(done)} rows)" if done else ""))
    results = []
    per, peak_label = ("GPU", "peak") if torch.cuda.is_available() else ("rank", "peak RSS")  # as train.py says them
    for seq in seqs:
        for r in runs:
            cfg = [f"{k}={v}" for k, v in r["config"].items()]
            row = run_case(model, "burst", seq, args, cfg,
                           {"rows": r["rows"], "what": r["what"], "config": r["config"], "overrides": args.overrides,
                            "warmup": args.warmup, "steps": args.steps})
            results.append(row)
            say(f"{'/'.join(r['rows']):>24} S={seq}: " + (
                f"{row['median_step_s']:.3f} s/step, {row['tokens_per_s_per_gpu']:,.0f} tok/s/{per}, "
                f"MFU {_pct(row['mfu'])}, {peak_label} {row['peak_mem_gib']:.2f} GiB, step-0 loss {row['first_loss']:.5f}"
                if row["ok"] else row["error"]))
            if dist.get_rank() == 0:  # after every run: a stopped launch keeps what it finished
                rows = _combine(done, results)
                path = own = write_record(record_name, {"model": model, "world": world, "warmup": args.warmup, "steps": args.steps,
                                           "overrides": args.overrides, "split": args.split, "splits": splits,
                                           "peak_mem": _mem_kind(), "earlier_commands": earlier, "rows": rows},
                             out_dir=out_dir, path=own)
    if dist.get_rank() == 0:
        rows = _combine(done, results)
        print(tables(rows))
        print(f"record: {path}")
    return 0


def _combine(done: list[dict], new: list[dict]) -> list[dict]:
    """Earlier rows (--append) that this launch did not rerun, then this launch's."""
    fresh = {(r["seq_len"], json.dumps(r["config"], sort_keys=True)) for r in new}
    return [r for r in done if (r["seq_len"], json.dumps(r["config"], sort_keys=True)) not in fresh] + list(new)


def _mem_kind() -> str:
    return ("max allocated per GPU (max over ranks)" if torch.cuda.is_available()
            else "process peak RSS (grows over the runs of a launch: not per row)")


def _pct(x) -> str:
    return f"{x:.1%}" if x is not None else "-"


def tables(rows: list[dict]) -> str:
    """Table 2 (the table rows in order, TGS and memory relative to the baseline) and the
    memory-vs-split curve, per sequence length."""
    order = [n for n, _, _ in TABLE] + [n for n, _, _ in ALTERNATIVES]
    lines = []
    for seq in sorted({r["seq_len"] for r in rows}):
        at = [r for r in rows if r["seq_len"] == seq]
        named = {n: r for r in at for n in r["rows"]}
        # ratios against the baseline, or the first row that ran if it did not (out of memory)
        base_name = next((n for n in order if named.get(n, {}).get("ok")), None)
        base = named[base_name] if base_name else None
        ref_loss = next((r["first_loss"] for r in at if r.get("ok")), None)
        ratio = f"/{base_name}" if base_name else "/-"
        head = (f"{'s/step':>8} {'TGS':>9} {'MFU':>7} {'GiB':>8} {'TGS' + ratio:>15} {'mem' + ratio:>15} "
                f"{'loss diff':>9}")
        lines.append(f"\nS={seq}: ablation (BurstEngine Table 2); loss diff: step-0 loss against the first row run")
        lines.append(f"{'row':>12} {head}  what")
        for n in order:
            r = named.get(n)
            if r is None:
                continue
            lines.append(f"{n:>12} " + _cells(r, base, ref_loss) + f"  {r['what'] if n == r['rows'][0] else ''}")
        curve = sorted(((float(r["config"]["activation_checkpoint_split"]), r) for r in at
                        if r["config"].get("activation_checkpoint") == "sequence" and r["config"].get("loss") == "fused"
                        and r["config"].get("attn_backward") == "burst"), key=lambda t: t[0])
        if curve:
            lines.append(f"\nS={seq}: memory vs split (fused loss, burst backward, activation_checkpoint=sequence)")
            lines.append(f"{'split':>12} {head}")
            for s, r in curve:
                lines.append(f"{s:>12g} " + _cells(r, base, ref_loss))
    return "\n".join(lines)


def _cells(r: dict, base, ref_loss) -> str:
    if not r.get("ok"):
        return f"{r.get('error', 'failed')}"
    tgs = f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.2f}x" if base else "-"
    mem = f"{r['peak_mem_gib'] / base['peak_mem_gib']:.2f}x" if base and base["peak_mem_gib"] else "-"
    diff = f"{abs(r['first_loss'] - ref_loss) / abs(ref_loss):.1e}" if ref_loss else "-"
    return (f"{r['median_step_s']:>8.3f} {r['tokens_per_s_per_gpu']:>9,.0f} {_pct(r['mfu']):>7} "
            f"{r['peak_mem_gib']:>8.2f} {tgs:>15} {mem:>15} {diff:>9}")
