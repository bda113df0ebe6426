"""`burstengine report`: docs/results.md, generated from the JSON records in benchmarks/results/.

Every figure the docs quote comes from a record a run wrote (command, commit, device, raw
numbers). This command reads the records and writes one section per benchmark family, one table
per record, built from the record's raw fields; every ratio is computed here from raw times of
the same record. It also rewrites the marked blocks ``<!-- report:NAME -->`` ... ``<!-- /report -->``
in README.md and docs/*.md (the few headline figures quoted outside results.md).

    burstengine report            # rewrite docs/results.md and the marked blocks
    burstengine report --check    # exit 1 when they differ from what the records give

Run it from the repository root (the defaults are relative paths). A record whose structure a
family's table does not know is listed in a compact generic table instead, never dropped.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics
import sys

HELP = "write docs/results.md (and the figures marked in the docs) from benchmarks/results/*.json; --check compares"

RECORDS_LABEL = "benchmarks/results"  # how tables name a record, wherever --records points
GIB = 1024 ** 3
MIB = 1024 ** 2


# ---------------------------------------------------------------- formatting helpers

def med(xs) -> float:
    return statistics.median(xs)


def num(x, digits: int = 3) -> str:
    """A number with ``digits`` significant digits (no exponent for ordinary magnitudes)."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if x == 0:
        return "0"
    if abs(x) < 1e-3 or abs(x) >= 1e7:
        return f"{x:.{max(digits - 1, 0)}e}"
    return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:.0f}"


def fixed(x, places: int = 2) -> str:
    return "—" if x is None else f"{x:.{places}f}"


def ms(seconds) -> str:
    return "—" if seconds is None else num(seconds * 1e3, 4)


def gib(nbytes) -> str:
    return "—" if nbytes is None else f"{nbytes / GIB:.1f}"


def ratio(a, b, places: int = 2) -> str:
    return "—" if a is None or b in (None, 0) else f"{a / b:.{places}f}"


def span(values, places: int = 2) -> str:
    """'lo–hi' of some ratios (one value when they agree to the places shown)."""
    lo, hi = f"{min(values):.{places}f}", f"{max(values):.{places}f}"
    return lo if lo == hi else f"{lo}–{hi}"


def table(header, rows) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return out + [""]


def device_of(rec) -> str:
    env = rec.get("env", {})
    dev = env.get("device", "?")
    count = env.get("device_count")
    if dev != "cpu" and count and count > 1:
        used = rec.get("world") or rec.get("env", {}).get("WORLD_SIZE")
        if used and int(used) < count:
            return f"{int(used)}× {dev} (of {count})"
        return f"{count}× {dev}"
    return dev


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


# ---------------------------------------------------------------- one renderer per family
# Each takes (record) and returns markdown lines; a KeyError/TypeError/... falls back to the
# generic table, so a new record shape is listed rather than breaking the report.

def attention(rec):
    rows = rec["rows"]
    out = []
    base_of = {}
    for r in rows:
        key = (r["S"], r["Hkv"], r["causal"])
        if r["method"].startswith("burst") and key not in base_of:
            base_of[key] = r
    body = []
    for r in rows:
        base = base_of.get((r["S"], r["Hkv"], r["causal"]))
        comparable = base is not None and base is not r and base["S_run"] == r["S_run"]
        body.append([r["method"], r["S"], r["S_run"], f"{r['H']}/{r['Hkv']}", "causal" if r["causal"] else "full",
                     ms(med(r["fwd_s"])), ms(med(r["fwdbwd_s"])), num(r.get("fwd_tflops"), 4),
                     num(r.get("fwdbwd_tflops"), 4), gib(r.get("peak_bytes")),
                     ratio(med(r["fwdbwd_s"]), med(base["fwdbwd_s"])) if comparable else "—"])
    out += table(["method", "S", "S run", "H/Hkv", "mask", "fwd ms", "fwd+bwd ms", "fwd TFLOP/s/GPU",
                  "fwd+bwd TFLOP/s/GPU", "peak GiB", "fwd+bwd time ÷ burst's"], body)
    out.append("Times are medians of the record's raw times; \"÷ burst's\" divides by the first `burst-*` row of "
               "the same S, KV heads and mask (only where the per-GPU work, S run, is the same).")
    out.append("")
    if rec.get("profile"):
        out += table(["S", "layout", "backward", "step ms", "NCCL ms", "exposed ms"],
                     [[p["S"], p["layout"], p["backward"], num(p["step_ms"], 5), num(p["nccl_ms"], 4),
                       num(p["exposed_ms"], 3)] for p in rec["profile"]])
    return out


def probe_speed(rec):
    return table(["S", "mask", "layout", "backward", "kernel", "fwd ms", "fwd+bwd ms (median of raw)",
                  "fwd TFLOP/s", "fwd+bwd TFLOP/s", "peak GiB"],
                 [[r["S"], "causal" if r["causal"] else "full", r["layout"], r["backward"], r["kernel"],
                   ms(r["fwd_s"]), ms(med(r["raw"])), num(r["fwd_tflops"], 4), num(r["fwdbwd_tflops"], 4),
                   fixed(r["peak_gib"], 1)] for r in rec["rows"]])


def gpu_correctness(rec):
    groups: dict = {}
    for r in rec["rows"]:
        groups.setdefault((r["kernel"], r["backward"]), []).append(r)
    body = [[k, b, len(rs), sum(bool(r["ok"]) for r in rs)] + [num(max(r[q] for r in rs)) for q in
                                                                ("out", "lse", "dq", "dk", "dv")]
            for (k, b), rs in sorted(groups.items())]
    head = [f"{rec['passed']}/{rec['cases']} cases within {num(rec['tolerance'])} (normwise relative error against "
            "float64, bf16 over NCCL).", ""]
    return head + table(["kernel", "backward", "cases", "passed", "worst out", "lse", "dQ", "dK", "dV"], body)


def _by(rows, *keys):
    out = {}
    for r in rows:
        out[tuple(r[k] for k in keys)] = r
    return out


def lao_bench(rec):
    out = []
    sl = rec["single_launch"]
    rows = _by(sl["rows"], "S", "mask", "method", "what")
    cases = sorted({(r["S"], r["mask"]) for r in sl["rows"]}, key=lambda c: (c[0], c[1] != "full"))
    body = []
    for S, mask in cases:
        line = [S, mask]
        for what in ("fwd", "fwd+bwd"):
            ours = rows.get((S, mask, "ours", what))
            line.append(num(ours["tflops"], 4) if ours else "—")
            for peer in ("cudnn", "flash", "flex"):
                p = rows.get((S, mask, peer, what))
                line.append(num(p["tflops"], 4) if p else "—")
            for peer in ("cudnn", "flex"):
                p = rows.get((S, mask, peer, what))
                line.append(ratio(med(p["times"]), med(ours["times"])) if p and ours else "—")
        body.append(line)
    out.append(f"One launch, {sl.get('dtype', '?')}, d={sl.get('head_dim', '?')}, {sl.get('heads', '?')} heads, "
               f"batch {sl.get('batch', '?')}: TFLOP/s and our speed relative to a peer (the peer's median time "
               "÷ ours).")
    out.append("")
    out += table(["S", "mask", "fwd ours", "cuDNN", "flash", "Flex", "ours/cuDNN", "ours/Flex",
                  "f+b ours", "cuDNN", "flash", "Flex", "ours/cuDNN", "ours/Flex"], body)
    rs = rec.get("ring_step") or {}
    if rs.get("rows"):
        rrows = _by(rs["rows"], "n", "hkv", "mask", "kernel", "what")
        keys = sorted({(r["n"], r["hkv"], r["mask"], r["what"]) for r in rs["rows"]})
        body = []
        for n, hkv, mask, what in keys:
            o, c = rrows.get((n, hkv, mask, "ours", what)), rrows.get((n, hkv, mask, "cudnn", what))
            body.append([n, f"{rs.get('heads', '?')}/{hkv}", mask, what, ms(med(o["times"])) if o else "—",
                         ms(med(c["times"])) if c else "—",
                         ratio(med(c["times"]), med(o["times"])) if o and c else "—"])
        out.append("Ring step (one block pair onto the running float32 state), n rows per block: our kernel "
                   "against cuDNN plus the torch merge or gradient adds.")
        out.append("")
        out += table(["n", "H/Hkv", "mask", "call", "ours ms", "cuDNN(+merge) ms", "ours speed ÷ cuDNN's"], body)
    notes = [f"{k.replace('_', ' ')}: {rec[k]}" for k in ("plain_forward", "plain_backward", "ring_forward_into",
                                                          "ring_backward_into", "flops") if rec.get(k)]
    if notes:
        out += ["- " + n for n in notes] + [""]
    return out


def lao_check(rec):
    groups: dict = {}
    for r in rec["rows"]:
        groups.setdefault(r["case"].split("-d")[0], []).append(r)
    body = []
    for kind, rs in sorted(groups.items()):
        worst = [num(max(r.get(q) or 0.0 for r in rs)) for q in ("out", "lse", "dq", "dk", "dv")]
        gluon = sum(bool(r.get("gluon") or r.get("gluon_bwd") or r.get("gluon_into") or r.get("gluon_bwd_into"))
                    for r in rs)
        body.append([kind, len(rs), sum(bool(r["ok"]) for r in rs), gluon] + worst)
    head = [f"{rec['passed']}/{rec['total']} cases within {num(rec['tol'])} of float64 "
            f"({len(rec.get('compile_errors') or [])} compile errors).", ""]
    return head + table(["mask kind", "cases", "passed", "ran Gluon", "worst out", "lse", "dQ", "dK", "dV"], body)


def sparse(rec):
    base = {}
    for r in rec["rows"]:
        base.setdefault(r["group"], r)
    body = []
    for r in rec["rows"]:
        b = base[r["group"]]
        speed = b["fwdbwd_s"] / r["fwdbwd_s"]
        ideal = b["visible_pairs"] / r["visible_pairs"]
        sent = max(p["fwd_bytes"] + p["bwd_bytes"] for p in r["per_rank"]) if r.get("per_rank") else None
        body.append([r["name"], r["layout"], r.get("window") or "—", r.get("documents", "—"), r["steps"],
                     ms(r["fwdbwd_s"]), fixed(speed), fixed(ideal), fixed(speed / ideal) if r is not b else "",
                     fixed(r["balance"], 3), "—" if sent is None else f"{sent / MIB:.0f}",
                     "—" if r.get("whole_shard_bytes") is None else f"{r['whole_shard_bytes'] / MIB:.0f}",
                     num(r.get("check_err"))])
    a = rec.get("args", {})
    head = [f"S={a.get('seq')}, H={a.get('heads')}, Hkv={a.get('kv_heads') or a.get('heads')}, "
            f"d={a.get('head_dim')}, world {rec.get('world')}. Speedup: the fwd+bwd time (slowest rank's median) of "
            "the first row of the group (causal; one document) ÷ this row's; ideal: the ratio of visible pairs; "
            "balance: the slowest rank's compute time ÷ the mean over ranks.", ""]
    return head + table(["case", "layout", "window", "documents", "steps run", "fwd+bwd ms", "speedup",
                         "ideal", "efficiency", "balance", "MiB sent per rank", "whole shards MiB",
                         "error vs reference"], body)


def prefill(rec):
    rows = rec["rows"]
    base = {(r["model"], r["S"]): r for r in rows if r["method"] == "burst"}
    body = [[r["model"], r["method"], r["S"], r["world"], ms(med(r["seconds"])), num(r["S"] / med(r["seconds"]), 4),
             gib(r.get("peak_bytes")), num(r.get("logits_rel_diff_vs_burst")),
             ratio(med(r["seconds"]), med(base[(r["model"], r["S"])]["seconds"])) if (r["model"], r["S"]) in base
             else "—"] for r in rows if "seconds" in r]
    out = table(["model", "method", "S", "world", "first-token ms", "tokens/s", "peak GiB",
                 "logits vs burst", "time ÷ burst's"], body)
    if rec.get("longest_fit"):
        out += table(["method@model", "longest prompt that fit"], [[k, v] for k, v in rec["longest_fit"].items()])
    return out


def train(rec):
    if "summary" in rec:  # a `burstengine train` run: summary + held-out evaluations
        s = rec["summary"]
        out = [f"{s['steps']} steps, world {s['world']} (dp {s['dp']} × cp {s['cp']}), seq {s['seq_len']}, "
               f"layout {s.get('layout')}: loss {fixed(s['first_loss'], 3)} → {fixed(s['final_loss'], 3)}, "
               f"{num(s['mean_step_time_s'])} s per step, {num(s['mean_tokens_per_s_per_gpu'], 4)} tokens/s per rank.",
               ""]
        body = [[e["step"], e["samples"], fixed(e["passkey_acc"], 3), fixed(e["chance_passkey_acc"], 3),
                 " / ".join(fixed(x, 2) for x in e["passkey_acc_by_depth"])] for e in rec.get("evals", [])]
        return out + table(["step", "samples", "passkey accuracy", "chance", "by depth quartile"], body)
    body = [[r["method"], r.get("seq_len", "—"), num(r.get("ok")),
             num(med(r["step_times_s"]), 4) if r.get("step_times_s") else "—",
             num(r.get("tokens_per_s_per_gpu"), 4), fixed(r.get("mfu"), 3), fixed(r.get("peak_mem_gib"), 1),
             fixed(r.get("first_loss"), 4)] for r in rec["rows"]]
    head = [f"model {rec.get('model', '?')}, world {rec.get('world', '?')}, {rec.get('steps', '?')} steps after "
            f"{rec.get('warmup', '?')} warm-up.", ""]
    return head + table(["method", "seq", "ok", "median step s", "tokens/s/GPU", "MFU", "peak GiB", "step-0 loss"],
                        body)


def seqckpt(rec):
    return table(["mode", "split", "held GiB", "peak GiB", "median ms", "dx error vs none"],
                 [[r["mode"], "—" if r["split"] is None else r["split"], fixed(r["held_gib"], 3),
                   fixed(r["peak_gib"], 3), ms(med(r["times_s"])), num(r["dx_err_vs_none"])] for r in rec["rows"]])


def longest(rec):
    body = []
    for r in rec["rows"]:
        tries = "; ".join(f"S={t['S']}: " + (f"{t['peak_gib']} GiB" if t.get("peak_gib") else "OOM")
                          for t in r.get("tries", []))
        body.append([r["method"], r.get("longest", "—"), tries or r.get("error", "")])
    return table(["method", "longest S", "tries"], body)


def topo(rec):
    body = [[r["label"], r["S"], f"{r['H']}/{r['Hkv']}", r["topology"], ms(med(r["raw_s"])), ms(r["predicted_s"]),
             f"{(r['predicted_s'] - med(r['raw_s'])) / med(r['raw_s']):+.1%}"] for r in rec["rows"]]
    c = rec.get("cluster") or {}
    head = []
    if c:
        head = [f"Calibrated: intra {num(c['intra']['gbps'])} GB/s + {num(c['intra']['latency_us'])} µs, "
                f"inter {num(c['inter']['gbps'])} GB/s + {num(c['inter']['latency_us'])} µs, kernels "
                f"{num(c['fwd_tflops'])} / {num(c['bwd_tflops'])} TFLOP/s fwd / bwd.", ""]
    return head + table(["scheme", "S", "H/Hkv", "topology", "measured ms", "predicted ms", "prediction error"], body)


def plan(rec):
    a, c = rec["attn"], rec["cluster"]
    head = [f"{c['nodes']} nodes × {c['gpus_per_node']} GPUs ({c.get('name', '')}), S={a['seq']}, "
            f"{a['heads']} heads × {a['head_dim']}, {'causal' if a['causal'] else 'full'}; "
            f"choice: `{rec['choice']['call']}`.", ""]
    body = [[p["scheme"], fixed(p["total_s"], 3) if p["feasible"] else f"— ({p['why']})",
             fixed(p["compute_s"], 3) if p["feasible"] else "", fixed(p["comm_only_s"], 3) if p["feasible"] else "",
             fixed(p.get("exposed_s"), 3) if p["feasible"] else "",
             f"{p['inter_bytes'] / 1e9:.1f}" if p["feasible"] else ""] for p in rec["predictions"]]
    out = head + table(["scheme", "fwd+bwd s", "compute s", "communication only s", "exposed s", "inter-node GB"],
                       body)
    t = rec.get("table1")
    if t:
        out += [f"Table 1 relations of the paper, same figures: ring {fixed(t['ring'], 3)} s, double ring "
                f"{fixed(t['double_ring'], 3)} s, Burst on the double ring {fixed(t['burst_double'], 3)} s.", ""]
    return out


def check_cost(rec):
    body = []
    for r in rec["rows"]:
        m = r["median_s"]
        body.append([r["world"], r["shape"], "×".join(map(str, r["B_n_H_Hkv_D"]))]
                    + [ms(m[f"check_{lv}"]) for lv in ("local", "agree", "full")]
                    + [ms(m[f"forward_{lv}"]) for lv in ("local", "agree", "full")]
                    + [f"{m['check_full'] / m['forward_local']:.1%}"])
    head = [f"{rec.get('what', '')}; medians of {rec.get('iters', '?')} calls, "
            f"{rec.get('threads_per_rank', '?')} thread(s) per rank.", ""]
    return head + table(["world", "shape", "B×n×H×Hkv×D", "check local ms", "check agree ms", "check full ms",
                         "forward local ms", "forward agree ms", "forward full ms", "check full ÷ forward local"],
                        body)


def fault_times(rec):
    body = []
    if "ring_kill" in rec:
        r = rec["ring_kill"]
        body.append(["rank SIGKILLed mid ring step", r["world"], f"BURST_TIMEOUT {num(r['burst_timeout_s'])} s",
                      r["victim"], ", ".join(f"rank {k} raised RankLost after {fixed(v, 3)} s"
                                            for k, v in sorted(r["seconds_to_raise"].items()))])
    if "watchdog_freeze" in rec:
        r = rec["watchdog_freeze"]
        body.append(["rank frozen (SIGSTOP) mid step", r["world"], f"watchdog {num(r['watchdog_timeout_s'])} s",
                     r["victim"], ", ".join(f"rank {k} exited after {fixed(v, 2)} s"
                                           for k, v in sorted(r["seconds_to_exit"].items()))])
    if "different_groups" in rec:
        r = rec["different_groups"]
        body.append(["ranks pass different groups", r["world"], f"BURST_TIMEOUT {num(r['burst_timeout_s'])} s",
                     "—", ", ".join(f"rank {k} exit code {v}" for k, v in sorted(r["exit_codes"].items()))])
    if "train_kill" in rec:
        r = rec["train_kill"]
        body.append([f"rank SIGKILLed in training step {r['step']}", r["world"],
                     f"fault_timeout {num(r['fault_timeout_s'])} s", r["victim"],
                     ", ".join(f"rank {k} exit {v['rc']} after {fixed(v['seconds'], 2)} s"
                               for k, v in sorted(r["survivors"].items()))])
    return table(["fault", "world", "deadline", "victim", "what the others did (seconds after the fault)"], body)


FAULT_WHAT = {
    "first_call": "SIGKILL at the start of the first call (before the argument check)",
    "subgroups": "SIGKILL before the double ring's sub-groups are made",
    "ring_step": "SIGKILL mid forward ring step",
    "skip_call": "skips the last call (alive elsewhere)",
    "skip_backward": "skips a backward, goes on to the next call",
    "freeze": "frozen (SIGSTOP) mid ring step",
    "store_host": "rank 0 (hosts the c10d store) SIGKILLed mid ring step",
    "checkpoint_save": "SIGKILL while writing a DCP checkpoint (under the watchdog)",
}


def faults(rec):
    head = [f"{rec['world']} ranks on {rec['device']}, BURST_TIMEOUT {num(rec['deadline_s'])} s; seconds from the "
            f"fault to each survivor's exit (non-zero), and whether its error names the lost rank.", ""]
    body = []
    for name, r in rec["faults"].items():
        s = r["survivors"]
        body.append([name, FAULT_WHAT.get(name, name), r["victim"],
                     ", ".join(f"{fixed(v['seconds'], 2)}" if v["seconds"] is not None else "hung"
                               for _, v in sorted(s.items())),
                     sum(v["hung"] for v in s.values()),
                     "all" if all(v["named_victim"] for v in s.values()) else
                     f"{sum(v['named_victim'] for v in s.values())} of {len(s)}"])
    out = head + table(["fault", "what the victim does", "victim", "survivors' seconds to exit", "hung",
                        "named the victim"], body)
    fz = rec.get("fuzz")
    if fz:
        out += ["", f"Bad-call fuzz (tests/test_fuzz.py's cases): {fz['bad'] + fz['good']} calls on every rank of "
                f"worlds 2-4 ({fz['bad']} bad, {fz['good']} valid; {fz['calls']} rank-calls), {fz['failures']} "
                f"failures, {fz['hangs']} hangs, {fz['silent_wrong']} silent wrong answers.", ""]
        out += table(["batch", "bad", "valid", "failures", "silent wrong", "slowest call s"],
                     [[k, v["bad"], v["good"], v["failures"], v["silent_wrong"], fixed(v["slowest_call_s"], 3)]
                      for k, v in fz["worlds"].items()])
    return out


def soak(rec):
    head = [f"{rec['steps']} training steps on {rec['world']} ranks, evaluation and checkpoint every "
            f"{rec['eval_and_ckpt_every']} steps, {ms(rec['wall_s'] / rec['steps'])} ms per step; growth of resident "
            f"memory from step {rec['from_step']} against a bound of {num(rec['bound_mib'])} MiB per rank: "
            f"{'pass' if rec['pass'] else 'FAIL'}.", ""]
    body = [[i, p["from_step"], p["to_step"], fixed(p["rss_from_mib"], 1), fixed(p["rss_to_mib"], 1),
             fixed(p["growth_mib"], 2), fixed(p["slope_kib_per_step"], 2), fixed(p["late_slope_kib_per_step"], 3)]
            for i, p in enumerate(rec["per_rank"])]
    return head + table(["rank", "from step", "to step", "RSS from MiB", "RSS to MiB", "growth MiB",
                         "KiB/step", "KiB/step, last steps"], body)


def lce_bench(rec):
    rows = rec["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = _by(rows, "vocab", "tokens", "method")
    shapes = sorted({(r["vocab"], r["tokens"]) for r in rows}, key=lambda s: (-s[0], s[1]))
    body = []
    for v, t in shapes:
        line = [f"{v} × {t}"]
        for m in methods:
            r = by.get((v, t, m))
            line.append(f"{ms(med(r['times_s']))} ms, {fixed(r['peak_gib'], 1)} GiB" if r and r.get("times_s") else "—")
        body.append(line)
    a = rec.get("args", {})
    out = [f"hidden {a.get('hidden')}, {a.get('dtype')}, forward + backward; median of the raw times, peak = most "
           "allocated beyond the inputs.", ""]
    out += table(["vocab × tokens"] + methods, body)
    chk = rec.get("check")
    if chk and chk.get("rows"):
        tol = chk.get("tol")
        tol = ", ".join(f"{k.replace('torch.', '')} {num(v)}" for k, v in tol.items()) if isinstance(tol, dict) else num(tol)
        out += [f"Check against float64 (tolerance {tol}; passed: {num(chk.get('passed'))}):", ""]
        out += table(["method", "dtype", "options", "loss error", "dh error", "dW error"],
                     [[r["method"], r["dtype"], r.get("opt", ""), num(r["loss"]), num(r["dh"]), num(r["dw"])]
                      for r in chk["rows"]])
    return out


def delta_error(rec):
    body = [[r["kernel"], "causal" if r["causal"] else "full", r["D"], r["gqa"], r["S"], num(r["delta_rebuild_err"]),
             num(max(r["true_out"].values())), num(max(r["rebuilt_out"].values()))] for r in rec["rows"]]
    return table(["kernel", "mask", "D", "GQA", "S", "D rebuild error", "worst grad error (true O)",
                  "worst grad error (rebuilt O)"], body)


def gluon_variants(rec):
    body = [[r["S"], r["method"], ms(med(r["times"])), f"{r['tflops']:.0f}"] for r in rec["bench"] if "method" in r]
    return table(["S", "kernel", "ms", "TFLOP/s"], body)


def ncu(rec):
    keys = ["Issued Ipc Active", "Warp Cycles Per Issued Instruction", "Local Memory Spilling Requests",
            "L1TEX scoreboard stall cycles per issue", "barrier stall cycles per issue", "Duration"]
    rows = [("before", r) for r in rec["before"]] + [("after", r) for r in rec["after"]]
    body = [[when, r["kernel"][:40], r["grid"]] + [num(r["metrics"].get(k)) if k in r["metrics"] else "—" for k in keys]
            for when, r in rows]
    out = table(["", "kernel", "grid", "issue IPC", "cycles per issue", "spill requests", "L1TEX stall",
                 "barrier stall", "ms (clock locked)"], body)
    if rec.get("after_stall_samples"):
        top = sorted(rec["after_stall_samples"].items(), key=lambda kv: -kv[1])[:6]
        out += ["", "Stall samples after, by reason: " + ", ".join(f"{k} {v:,}" for k, v in top) + "."]
    return out


def ptxas(rec):
    body = [[name, b["commit"], b["spill_store_bytes"], b["spill_load_bytes"],
             " ".join(str(x["ldl"]) for x in b["loops"])] for name, b in rec["builds"].items()]
    return table(["build", "commit", "spill stores (B)", "spill loads (B)", "LDL per wgmma loop (SASS order)"], body)


def clocks(rec):
    s = rec["summary"]
    if not s.get("loaded_samples"):
        return [f"While `{rec['sampled']}` ran: no loaded samples."]
    thr = ", ".join(f"{k} {100 * v:.0f}%" for k, v in s["share_of_loaded_samples_throttled_by"].items() if v)
    return [f"While `{rec['sampled']}` ran ({fixed(rec['seconds'], 0)} s): {s['loaded_samples']} samples under load "
            f"(power above half the limit); median SM clock {s['median_sm_mhz']:.0f} of {s['max_sm_mhz']:.0f} MHz, "
            f"median power {s['median_power_w']:.0f} of {s['limit_w']:.0f} W, at most {s['max_temp_c']:.0f} C; "
            f"share of those samples throttled by: {thr or 'nothing'}."]


def probe_offload(rec):
    body = [[r["plan"], fixed(r["median_step_s"], 3) if "median_step_s" in r else r.get("error", "?"),
             fixed(r.get("held_after_forward_gib"), 1), fixed(r.get("peak_gib"), 1)] for r in rec["rows"]]
    ln = rec.get("link", {})
    return ([f"{rec['layers']} layers of {rec['model']}, {rec['seq']} tokens, commit {rec['commit']}: the step of "
             f"each plan (median of 3), device memory held from forward to backward and the step's peak; host link "
             f"{fixed(ln.get('d2h_gb_s'), 1)} GB/s to the host, {fixed(ln.get('h2d_gb_s'), 1)} GB/s back; "
             f"offload against pointwise, largest relative gradient difference "
             f"{rec['checks'].get('offload_vs_pointwise_grad_rel', float('nan')):.3g} (none against pointwise "
             f"{rec['checks'].get('none_vs_pointwise_grad_rel', float('nan')):.3g}).", ""]
            + table(["plan", "s/step", "held GiB", "peak GiB"], body))


def probe_host_copy(rec):
    body = []
    for kind in dict.fromkeys(r["kind"] for r in rec["rows"]):
        rs = [r for r in rec["rows"] if r["kind"] == kind]
        host = sorted(r["host_call_s"] for r in rs)[len(rs) // 2]
        dev = sorted(r["device_copy_s"] for r in rs)[len(rs) // 2]
        body.append([kind, fixed(host * 1e3, 2), fixed(dev * 1e3, 2), fixed(rec["mib"] * 2**20 / dev / 1e9, 1),
                     str(rs[0]["is_pinned"])])
    return [f"{rec['mib']} MiB copied from the device with `non_blocking=True` while matmuls are queued before it "
            "(medians of the record's trials):", ""] + table(
        ["host memory", "host call ms", "copy on the device ms", "GB/s", "is_pinned"], body)


def profile(rec):
    wall = rec["step_wall_s"]
    busy = rec.get("gpu_busy_s", rec.get("cpu_busy_s"))
    mfu = f", MFU {rec['mfu'] * 100:.1f}%" if rec.get("mfu") else ""
    mem = f", peak {fixed(rec['peak_mem_gib'], 1)} GiB" if rec.get("peak_mem_gib") else ""
    head = [f"{rec['model']} at {rec['seq_len']} tokens on {rec['world']} rank(s), overrides "
            f"`{' '.join(rec.get('overrides') or []) or 'none'}`: one step {fixed(wall, 3)} s, kernels busy "
            f"{fixed(busy, 3)} s{mfu}{mem}.", ""]
    body = [[c, fixed(t, 3), f"{100 * t / wall:.1f}%"] for c, t in rec["categories_s"].items()]
    body.append(["host gaps (nothing running)", fixed(rec["host_gap_s"], 3), f"{100 * rec['host_gap_s'] / wall:.1f}%"])
    tail = []
    if "compute_gaps_s" in rec:  # bench profile's timeline (later records)
        g, t = rec["compute_gaps_s"], rec["transfers_s"]
        tail = ["", f"No compute kernel running: {fixed(g['forward'], 3)} s in the forward, {fixed(g['backward'], 3)} s "
                    f"in the backward; host transfers {fixed(t['dtoh'], 3)} s to the host and {fixed(t['htod'], 3)} s "
                    f"back, {fixed(rec['transfer_only_s'], 3)} s of them under no compute kernel."]
    return head + table(["category", "seconds", "share of the step"], body) + tail


def decode(rec):
    graphs = rec.get("graphs")
    head = [f"{rec['describe']}; {rec['world']} rank(s), {rec['dtype'].replace('torch.', '')}; device-to-device copy "
            f"bandwidth {rec['copy_bandwidth_Bps'] / 1e9:,.0f} GB/s measured in the launch. Decode time per token is "
            "the median of the timed steps; the bound reads the KV cache and the weights once per token at that "
            "bandwidth." + (" Decode steps replayed from a CUDA graph; the same prompts decoded op by op in a second "
                            "call (whose prefill gives the second first-token time: nothing left to allocate or "
                            "compile)." if graphs else ""), ""]
    body = []
    for r in rec["rows"]:
        if "error" in r:
            body.append([r["S"], r["batch"], r["error"]] + ["—"] * (7 if graphs else 5))
            continue
        sdpa = r.get("sdpa_first_token_s")
        first = fixed(r["first_token_s"], 2)
        if graphs:
            first += f" / {fixed(r['eager_first_token_s'], 2)}"
        row = [r["S"], r["batch"], first, fixed(sdpa, 2) if sdpa else "—", ms(r["decode_s_per_token"])]
        if graphs:
            row.append(ms(r["eager_decode_s_per_token"]))
        row += [ms(r["bound_s"]), f"{r['ratio_to_bound']:.2f}×", fixed(r["peak_bytes"] / 2**30, 1)]
        if graphs:
            row.insert(-1, "yes" if r.get("tokens_equal") else "NO")
        body.append(row)
    cols = ["prompt tokens", "batch", "first token s" + (" (first / again)" if graphs else ""), "SDPA prefill s",
            "decode ms/token" + (" (graph)" if graphs else "")]
    cols += ["op by op ms/token"] if graphs else []
    cols += ["bound ms/token", "× bound"] + (["same tokens"] if graphs else []) + ["peak GiB"]
    return head + table(cols, body)


def cpu_kernels(rec):
    sh = rec["shape"]
    head = [f"One {rec['mask']} block, B={sh['B']}, S={sh['S']}, H={sh['H']} (kv {sh['Hkv']}), D={sh['D']}, "
            f"{rec['threads']} threads; median of {rec['iters']} runs; speed-ups against the reference kernel of the "
            "same dtype, from the same record.", ""]
    ref = {(r["dtype"]): r for r in rec["rows"] if r["kernel"] == "reference"}
    body = [[r["kernel"], r["dtype"], ms(med(r["fwd_all"])), ms(med(r["bwd_all"])),
             ratio(med(ref[r["dtype"]]["fwd_all"]), med(r["fwd_all"])) if r["dtype"] in ref else "—",
             ratio(med(ref[r["dtype"]]["bwd_all"]), med(r["bwd_all"])) if r["dtype"] in ref else "—"]
            for r in rec["rows"]]
    return head + table(["kernel", "dtype", "forward ms", "backward ms", "forward ×", "backward ×"], body)


def finetune(rec):
    """One line per fine-tuning record, whatever its kind (make / load / train / export / compare)."""
    kind = rec.get("kind") or ("train" if "summary" in rec else "?")
    if kind == "train":
        t, c = rec["summary"], rec["config"]
        cells = [("sequence", c["seq_len"]), ("doc_mask", c.get("doc_mask")), ("steps", t["steps"]),
                 ("tokens/s/GPU", f"{t['mean_tokens_per_s_per_gpu']:,.0f}"), ("step s", fixed(t["mean_step_time_s"], 2)),
                 ("MFU (document-masked FLOPs)", f"{100 * t['mean_mfu']:.1f}%" if t.get("mean_mfu") else "—"),
                 ("peak GiB", fixed(t["peak_mem_gib"], 1)), ("loss first → last", f"{t['first_loss']:.4f} → {t['final_loss']:.4f}")]
    elif kind == "load":
        cells = [("parameters", f"{rec['params'] / 1e9:.2f}B"), ("ranks", rec["world"]),
                 ("load s (slowest rank)", fixed(rec["load_s_max_rank"], 1)),
                 ("GiB read (most by a rank)", fixed(rec["read_gib_max_rank"], 1)),
                 ("peak host RSS GiB", fixed(rec["peak_host_rss_gib_max_rank"], 2)), ("peak GPU GiB", fixed(rec["peak_gpu_gib"], 1))]
    elif kind == "export":
        cells = [("step", rec["step"]), ("dtype", rec["dtype"]), ("GiB", fixed(rec["bytes"] / 2**30, 2)),
                 ("files", rec["files"]), ("export s", fixed(rec["export_s"], 1)),
                 ("peak host RSS GiB", fixed(rec["peak_rss_gib"], 2)),
                 ("max_position_embeddings", rec["max_position_embeddings"])]
    elif kind == "compare":
        cells = [("sequence", rec["seq"]), ("positions compared", rec["rows"]), ("dtype", rec["dtype"]),
                 ("max relative logit error", num(rec["max_rel_err"])), ("argmax agreement", fixed(rec["argmax_agreement"], 3))]
    elif kind == "make":
        cells = [("config", rec["config"]), ("GiB written", fixed(rec["bytes"] / 2**30, 2)), ("files", rec["files"]),
                 ("write s", fixed(rec["write_s"], 1))]
    else:
        raise KeyError(kind)
    return [f"{kind}:", ""] + table([k for k, _ in cells], [[v for _, v in cells]])


def demo(rec):
    sh = rec["shape"]
    head = [f"{rec['world']} gloo ranks on a {rec['env'].get('cpu_count', '?')}-core machine, "
            f"B={sh['B']} S={sh['S']} H={sh['H']} (kv {sh['Hkv']}) D={sh['D']}, "
            f"{'causal' if rec['causal'] else 'full'} {rec['layout']}, kernel {rec['kernel']}; whole command "
            f"{fixed(rec['wall_s'], 1)} s (spawn, both schemes, the float64 reference); "
            f"{'all within' if rec['ok'] else 'NOT all within'} {num(rec['tol'])} of float64.", ""]
    body = [[r["scheme"], num(r["out"]), num(r["dq"]), fixed(r["fwd_s"], 2), fixed(r["bwd_s"], 2),
             f"{r['fwd_bytes']:,}", f"{r['bwd_bytes']:,}"] for r in rec["rows"]]
    return head + table(["backward scheme", "out error", "dq error", "forward s", "backward s",
                         "forward bytes/rank", "backward bytes/rank"], body)


def _pct(x) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def demo_finetune_table(rec) -> list[str]:
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


def demo_finetune(rec):
    chk = rec["logits_check"]
    stages = ", ".join(f"{k} {fixed(v, 1)} s" for k, v in rec["stage_s"].items())
    head = [f"{rec['world']} gloo ranks on a {rec['env'].get('cpu_count', '?')}-core machine; a {rec['short']}-token "
            f"model extended to {rec['long']} tokens ({', '.join(rec['rope_sets'])}); {rec['samples']} held-out "
            f"passkeys per length, evaluated in transformers. Whole command {fixed(rec['wall_s'], 1)} s ({stages}). "
            f"transformers' logits of the fine-tuned export against the engine's at {chk['seq']} tokens: max relative "
            f"error {num(chk['max_rel_err'])} ({'within' if chk['ok'] else 'NOT within'} {num(chk['tol'])}).", ""]
    return head + demo_finetune_table(rec)


# family: (title, file-name pattern, renderer, one-line description)
FAMILIES = [
    ("Attention on 1-2 GPUs beside the peers", r"^attention_", attention,
     "`burstengine bench attention`: BurstAttention against torch's context parallelism, Ulysses and one GPU."),
    ("Per-call speed inside the ring", r"^probe_speed", probe_speed,
     "`burstengine bench probe-speed`: one configuration of the ring, repeated."),
    ("Correctness on GPUs", r"^gpu_correctness", gpu_correctness,
     "`burstengine bench gpu-correctness`: the bf16 correctness matrix over NCCL against float64."),
    ("LAO kernels: speed", r"^lao_bench", lao_bench,
     "`burstengine bench lao-bench`: our kernels against cuDNN, flash and FlexAttention on one GPU."),
    ("LAO kernels: correctness", r"^lao_check", lao_check,
     "`burstengine bench lao-check`: every mask kind, MaskSpec flag, GQA ratio, head dim and dtype against float64."),
    ("Sparse masks", r"^sparse_", sparse,
     "`burstengine bench sparse`: sliding windows and packed documents against their causal baseline."),
    ("Prefill", r"^prefill", prefill,
     "`burstengine bench prefill`: first-token latency beside tensor and torch-native context parallelism."),
    ("Training", r"^(train_|ablation)", train,
     "`burstengine train` and `burstengine bench train` (throughput, ablation)."),
    ("Sequence-level checkpointing", r"^seqckpt", seqckpt,
     "`burstengine bench seqckpt-memory`: memory and time of one block against the split."),
    ("Longest sequence", r"^longest", longest, "`burstengine bench longest`: the longest sequence each method fits."),
    ("Topology: measured against the cost model", r"^topo_bench", topo,
     "`burstengine bench topo`: every scheme timed, beside the cost model calibrated on the same machine."),
    ("Cost model predictions", r"^plan_", plan, "`burstengine plan --json`: predictions, no run."),
    ("Argument-check cost", r"^check_cost", check_cost, "`burstengine bench check-cost`: the cost of `BURST_CHECKS` levels."),
    ("Fault times", r"^fault_times", fault_times,
     "`burstengine bench fault-times`: the fault jobs of the tests, timed once."),
    ("Fine-tuning a pretrained model", r"^ft_", finetune,
     "`benchmarks/finetune_h200.sh` (`burstengine bench finetune`, `train --set init=...`, `export`): random-weight "
     "HF directories with real architectures' configs, loaded sharded, trained with packed documents, exported, "
     "compared with transformers."),
    ("The demo", r"^demo_(?!finetune)", demo, "`burstengine demo --record NAME`: the README's first command."),
    ("Context extension on CPU", r"^demo_finetune", demo_finetune,
     "`burstengine demo finetune --record NAME`: a 256-token model extended to 2K tokens by RoPE scaling and a "
     "fine-tune, exported, evaluated in transformers."),
    ("Local kernels on CPU", r"^cpu_kernels", cpu_kernels,
     "`burstengine bench cpu-kernels`: torch's CPU flash attention op against the reference kernel."),
    ("Decode against the sharded KV cache", r"^decode_", decode,
     "`burstengine bench decode`: first-token latency beside plain SDPA prefill, decode time per token beside "
     "the HBM-bandwidth bound."),
    ("Faults at every phase", r"^faults_", faults,
     "`burstengine bench faults`: a rank lost at each phase of a job, and the bad-call fuzz."),
    ("Gluon kernel variants", r"^gluon_", gluon_variants,
     "`benchmarks/probe_gluon.py`: the Gluon kernels and variants of them built behind flags for one measurement "
     "(docs/kernels.md): causal forward and backward alone, beside cuDNN in the same launch."),
    ("Kernel builds for sm_90a", r"^ptxas_", ptxas,
     "`benchmarks/ptxas_gluon_bwd.py`: a Gluon kernel built without a GPU; ptxas's spills and the local loads "
     "each wgmma loop runs per step."),
    ("Kernel profiler counters", r"^ncu_", ncu,
     "Nsight Compute on one kernel launch: issue rate, stalls, spills (the clock is locked while it measures)."),
    ("GPU clocks and power under load", r"^clocks_", clocks,
     "`python benchmarks/sample_clocks.py NAME -- COMMAND`: nvidia-smi's SM clock, power and throttle reasons "
     "every 250 ms around a run."),
    ("Offloading activations to the host", r"^probe_offload", probe_offload,
     "`python benchmarks/probe_offload.py SEQ LAYERS`: the `offload` checkpointing policy beside `pointwise`, "
     "`none` and `sequence` on a few layers of the 3B model."),
    ("Copies to host memory", r"^probe_host_copy", probe_host_copy,
     "`python benchmarks/probe_host_copy.py MIB`: whether a non-blocking copy from the device returns to the host "
     "at once, for the host memory `offload` uses and two others."),
    ("Where a training step's time goes", r"^profile_", profile,
     "`burstengine bench profile`: one step under torch.profiler, kernel time by category."),
    ("Soak", r"^soak", soak, "`burstengine bench soak`: resident memory over many tiny training steps."),
    ("Fused LM head + cross-entropy", r"^lce_bench", lce_bench,
     "`burstengine bench lce`: forward + backward time and peak memory against the peers."),
    ("Backward from a rebuilt D", r"^delta_error", delta_error,
     "`burstengine bench delta-error`: gradient error when D = rowsum(dO·O) comes from the merged O."),
]


def generic(rows) -> list[str]:
    """The compact table for records no family renders: provenance and the top-level keys."""
    body = []
    for name, rec in rows:
        keys = ", ".join(k for k in rec if k not in ("command", "commit", "env"))
        body.append([f"`{name}`", f"`{rec.get('command', '?')}`", f"`{str(rec.get('commit', '?'))[:10]}`",
                     device_of(rec), rec.get("env", {}).get("date", "")[:10], keys])
    return table(["record", "command", "commit", "device", "date", "fields"], body)


def load_records(records_dir: str) -> list[tuple[str, dict]]:
    paths = sorted(glob.glob(os.path.join(records_dir, "*.json")))
    if not paths:
        raise SystemExit(f"burstengine report: no records (*.json) in {records_dir}")
    out = []
    for p in paths:
        with open(p) as f:
            try:
                out.append((os.path.basename(p), json.load(f)))
            except json.JSONDecodeError as e:
                raise SystemExit(f"burstengine report: {p} is not valid JSON: {e}") from None
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
    for title, pattern, render, what in FAMILIES:
        members = [(n, r) for n, r in records if re.match(pattern, n)]
        if not members:
            continue
        lines += [f"## {title}", "", what, ""]
        for name, rec in members:
            done.add(name)
            try:
                body = render(rec)
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

def _rec(records, name):
    for n, r in records:
        if n == name:
            return r
    raise KeyError(f"record {name} is missing")


def _lao_ratios(rec, what, peer):
    rows = _by(rec["single_launch"]["rows"], "S", "mask", "method", "what")
    return [med(p["times"]) / med(rows[(S, m, "ours", w)]["times"])
            for (S, m, meth, w), p in rows.items() if meth == peer and w == what and (S, m, "ours", w) in rows]


def block_lao(records):
    h200 = _rec(records, "lao_bench.json")
    h100 = _rec(records, "lao_bench_h100.json")
    parts = []
    for rec, name in ((h200, "lao_bench.json"), (h100, "lao_bench_h100.json")):
        parts.append(f"on {device_of(rec)} (`{name}`) the forward runs at {span(_lao_ratios(rec, 'fwd', 'cudnn'))}× "
                     f"cuDNN's speed and {span(_lao_ratios(rec, 'fwd', 'flex'))}× FlexAttention's, forward + backward "
                     f"at {span(_lao_ratios(rec, 'fwd+bwd', 'cudnn'))}× cuDNN and "
                     f"{span(_lao_ratios(rec, 'fwd+bwd', 'flex'))}× Flex")
    sl = h200["single_launch"]
    dtype = {"bfloat16": "bf16", "float16": "fp16"}.get(sl.get("dtype"), sl.get("dtype"))
    return f"In one launch ({dtype}, d={sl.get('head_dim')}), " + "; ".join(parts) + "."


def block_headline(records):
    att = _rec(records, "attention_2gpu_128k_gluon.json")
    rows = {r["method"]: r for r in att["rows"]}
    b, t = rows["burst-zigzag"], rows["torch-cp-cudnn"]
    lao = _rec(records, "lao_check.json")
    soak_rec = _rec(records, "soak_cpu.json")
    return (f"On {device_of(att)} at {b['S'] // 1024}K tokens, {'causal' if b['causal'] else 'full'}, "
            f"BurstAttention's forward + backward takes "
            f"{ratio(med(b['fwdbwd_s']), med(t['fwdbwd_s']))}× the time of torch's context parallelism on cuDNN "
            f"(`attention_2gpu_128k_gluon.json`); our Triton/Gluon kernels pass {lao['passed']}/{lao['total']} "
            f"checks against float64 (`lao_check.json`); {soak_rec['steps']} tiny training steps grow no rank's memory "
            f"beyond {num(soak_rec['bound_mib'])} MiB (`soak_cpu.json`).")


def block_demo(records):
    rec = dict(records).get("demo_cpu.json")
    if rec is None or rec.get("wall_s") is None:
        return "in docs/results.md."
    return (f"{rec['wall_s']:.0f} s on a {rec['env'].get('cpu_count', 2)}-core machine with {rec['world']} ranks, "
            f"after the install (`demo_cpu.json`).")


DEMO_FINETUNE = "demo_finetune_cpu.json"


def block_demo_finetune(records):
    rec = _rec(records, DEMO_FINETUNE)
    by = {(r["model"], r["seq"]): r["passkey_acc"] for r in rec["evals"]}
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in rec["stage_s"].items())
    return "\n".join(demo_finetune_table(rec)
                     + [f"Passkey accuracy at {rec['long']} tokens: {_pct(by[('stage1', rec['long'])])} before the "
                        f"extension, {_pct(by[('finetuned', rec['long'])])} after it. The whole command took "
                        f"{rec['wall_s']:.0f} s on a {rec['env'].get('cpu_count', '?')}-core machine with "
                        f"{rec['world']} ranks ({stages}; `{DEMO_FINETUNE}`)."])


def block_demo_finetune_line(records):
    """The README's line: accuracy before and after the extension, scaling alone, time."""
    rec = _rec(records, DEMO_FINETUNE)
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
    rec = _rec(records, DEMO_FINETUNE)
    lines = ["```bash"]
    for stage, cmds in rec["commands"].items():
        lines.append(f"# {stage}")
        lines += [_wrap(c) for c in cmds]
    return "\n".join(lines + ["```"])


def block_decode_graphs(records):
    """docs/inference.md: the decode step's CUDA graph and kernel on one GPU, from the records."""
    chk = _rec(records, "decode_8b_graphs.json")["check"]
    runs = [("decode_8b_h200_graphs2.json", _rec(records, "decode_8b_h200_graphs2.json")),
            ("decode_8b_h200_graphs.json", _rec(records, "decode_8b_h200_graphs.json"))]
    att = chk["attention"]
    seen, body = set(), []
    for name, rec in runs:
        for r in rec["rows"]:
            if "error" in r or (r["S"], r["batch"]) in seen:
                continue
            seen.add((r["S"], r["batch"]))
            sdpa = r.get("sdpa_first_token_s")
            body.append([f"{r['S'] // 1024}K", r["batch"], ms(r["decode_s_per_token"]), ms(r["eager_decode_s_per_token"]),
                         ms(r["bound_s"]), f"{r['ratio_to_bound']:.2f}×",
                         f"{fixed(r['eager_first_token_s'], 2)} / {fixed(sdpa, 2)}" if sdpa else "—",
                         "yes" if r["tokens_equal"] else "NO", f"`{name}`"])
    body.sort(key=lambda row: (int(row[0][:-1]), row[1]))
    dev = device_of(runs[0][1])
    toks = chk["tokens"]
    head = (f"On {dev}, {runs[0][1]['describe'].split(':')[0]} with Llama-3.1-8B's shape: `bench decode --check` passed "
            f"({len(att)} kernel cases within {num(max(r['out_err'] for r in att))} of float64; with and without the "
            f"graph the float32 model chose float64's tokens and bf16 the same tokens both ways, "
            f"{sum(len(t['lengths']) for t in toks)} prompts, windows {', '.join(str(t['window']) for t in toks)}; "
            "`decode_8b_graphs.json`). Decode per token with the graph, op by op, and the bound of reading the "
            "weights and the KV cache once at the copy bandwidth measured in the launch; first token of a second "
            "prefill (warm) beside plain SDPA's:")
    return "\n".join([head, ""] + table(["prompt", "batch", "graph ms", "op by op ms", "bound ms", "× bound",
                                         "first token s (ours / SDPA)", "same tokens", "record"], body))


def block_finetune_gpu(records):
    """docs/training.md: the fine-tuning path on one H200, from the ft_* records."""
    rows = []
    for S in (65536, 131072):
        t = _rec(records, f"ft_train_3b_{S}.json")
        e = _rec(records, f"ft_export_3b_{S}.json")
        c = _rec(records, f"ft_compare_3b_{S}.json")
        sm = t["summary"]
        rows.append([f"3B, {S // 1024}K, doc_mask", sm["steps"], f"{sm['mean_tokens_per_s_per_gpu']:,.0f}",
                     f"{100 * sm['mean_mfu']:.1f}%", fixed(sm["peak_mem_gib"], 1), "—", fixed(e["export_s"], 1),
                     num(c["max_rel_err"]), fixed(c["argmax_agreement"], 2)])
    ld, ex, c8 = (_rec(records, n) for n in ("ft_load_8b.json", "ft_export_8b.json", "ft_compare_8b.json"))
    rows.append(["8B, load + save + export", "—", "—", "—", fixed(ld["peak_gpu_gib"], 1),
                 f"{fixed(ld['load_s_max_rank'], 1)} ({fixed(ld['peak_host_rss_gib_max_rank'], 1)} GiB host)",
                 fixed(ex["export_s"], 1), num(c8["max_rel_err"]), fixed(c8["argmax_agreement"], 2)])
    dev = device_of(ld)
    return "\n".join([f"On {dev} (`benchmarks/finetune_h200.sh`; records `ft_*.json`; MFU counts the document-masked "
                      "attention FLOPs; logits of the export in transformers vs the engine, both bf16, on "
                      f"{c['rows']} positions of one random sequence at the trained length, 8K for the 8B):", ""]
                     + table(["run", "steps", "tokens/s/GPU", "MFU", "peak GPU GiB", "load s", "export s",
                              "max rel. logit error", "argmax agreement"], rows))


def _probe_speeds(rec) -> dict:
    # benchmarks/probe_gluon.py's records: TFLOP/s by (S, method)
    return {(r["S"], r["method"]): r["tflops"] for r in rec["bench"] if "method" in r}


def _probe_worst(rec) -> float:
    # the largest error against float64 over the record's check cases
    return max(v for c in rec["check"] for v in c.values() if isinstance(v, float))


def block_gluon_variants(records):
    """docs/kernels.md: the Gluon variants measured and not kept, beside cuDNN, from one record."""
    name = "gluon_variants_h200.json"
    rec = _rec(records, name)
    speed = _probe_speeds(rec)
    cols = [("cudnn fwd", "cuDNN"), ("gluon fwd pp=0", "ours"), ("gluon fwd pp=1", "ping-pong"),
            ("cudnn bwd", "cuDNN"), ("gluon bwd variant=0", "ours"), ("gluon bwd variant=1", "FA3 order"),
            ("gluon bwd variant=2", "transposed")]
    body = [[f"{S // 1024}K"] + [f"{speed[(S, m)]:.0f}" for m, _ in cols]
            for S in sorted({S for S, _ in speed})]
    worst = _probe_worst(rec)
    return "\n".join([f"On {device_of(rec)} (`{name}`, commit {rec['commit']}, which held the variants; causal, "
                      "24 q heads on 8 kv heads, d=128, bf16; TFLOP/s of the forward and of the backward alone, "
                      f"median of 5; every variant within {num(worst)} of float64 on the check cases of the run):",
                      ""] + table(["S"] + [f"fwd: {h}" for _, h in cols[:3]] + [f"bwd: {h}" for _, h in cols[3:]],
                                  body))


def block_gluon_bwd(records):
    """docs/kernels.md: the Gluon backward before and after the spill fix, and its variants, beside cuDNN."""
    name, h100_name = "gluon_bwd_variants_h200.json", "gluon_bwd_h100.json"
    tr_name = "gluon_bwd_transposed_h200.json"
    rec, h100, tr = _rec(records, name), _rec(records, h100_name), _rec(records, tr_name)
    speed, hs, ts = _probe_speeds(rec), _probe_speeds(h100), _probe_speeds(tr)
    cols = [("cudnn bwd", "cuDNN"), ("gluon bwd indep=0 pf=0 opaque=0", "before"),
            ("gluon bwd indep=0 pf=0 opaque=1", "+ descriptors in the step"),
            ("gluon bwd indep=0 pf=1 opaque=1", "+ lse/D a step ahead (kept)"),
            ("gluon bwd indep=2 pf=0 opaque=1", "own dQ per warpgroup"),
            ("gluon bwd indep=2 pf=1 opaque=1", "own dQ + lse/D ahead")]
    body = [[f"{S // 1024}K"] + [f"{speed[(S, m)]:.0f}" for m, _ in cols] for S in sorted({S for S, _ in speed})]
    worst = _probe_worst(rec)
    tr_line = "; ".join(f"{S // 1024}K: transposed {ts[(S, 'gluon bwd tr=1')]:.0f}, as kept "
                        f"{ts[(S, 'gluon bwd tr=0')]:.0f}, cuDNN {ts[(S, 'cudnn bwd')]:.0f}"
                        for S in sorted({S for S, _ in ts}))
    h100_line = "; ".join(f"{S // 1024}K: ours {hs[(S, 'gluon bwd')]:.0f}, cuDNN {hs[(S, 'cudnn bwd')]:.0f}"
                          for S in sorted({S for S, _ in hs}))
    return "\n".join([f"On {device_of(rec)} (`{name}`, commit {rec['commit']}, which held the variants as flags; "
                      "causal, 24 q heads on 8 kv heads, d=128, bf16; TFLOP/s of the backward alone, median of 7; "
                      f"every variant within {num(worst)} of float64 on the check cases of the run):", ""]
                     + table(["S"] + [h for _, h in cols], body)
                     + ["", f"The kernel as kept, on {device_of(h100)} (`{h100_name}`, TFLOP/s): {h100_line}. "
                        f"FlashAttention-3's transposed pair on top of the fix, on {device_of(tr)} (`{tr_name}`, "
                        f"TFLOP/s): {tr_line}."])


def block_train_3b(records):
    """docs/training.md: BurstEngine against the plain-PyTorch baseline on one H200 (one launch),
    where the 128K step's time goes, and the clock the board's power limit left it."""
    name, prof_name, clk_name = "train_llama-3b_1xh200.json", "profile_3b_128k_pointwise.json", \
        "clocks_train_3b_h200.json"
    rec, prof, clk = _rec(records, name), _rec(records, prof_name), _rec(records, clk_name)
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


def block_offload(records):
    """docs/training.md: the 3B step with offloaded layers in auto's plan beside the default plan
    (same commit, two launches), where the offloading step waited before the fix, and the probe's
    plans on six layers."""
    names = ("train_llama-3b_1xh200.json", "train_llama-3b_1xh200_offload.json")
    body = []
    for name in names:
        rec = _rec(records, name)
        for r in rec["rows"]:
            if r.get("method") == "burst" and r.get("ok"):
                plan = ", ".join(f"{n} {p}" for p, n in r["checkpoint_plan"].items())
                body.append([f"`{name}`", f"{r['seq_len'] // 1024}K", plan, fixed(r["median_step_s"], 3),
                             f"{100 * r['mfu']:.1f}%", fixed(r.get("offload_host_gib") or 0, 1)])
    gaps = []
    for name in ("profile_3b_65536_offload_gaps.json", "profile_3b_131072_offload_gaps.json"):
        rec = _rec(records, name)
        gaps.append(f"at {rec['seq_len'] // 1024}K (`{name}`, commit {rec['commit']}) no compute kernel ran for "
                    f"{fixed(rec['compute_gaps_s']['forward'], 2)} s of the forward, while "
                    f"{fixed(rec['transfer_only_s'], 2)} s of the copies ran alone")
    probe = []
    for name in ("probe_offload_64k.json", "probe_offload_128k.json"):
        rec = _rec(records, name)
        t = {r["plan"]: r["median_step_s"] for r in rec["rows"] if "median_step_s" in r}
        probe.append(f"at {rec['seq'] // 1024}K (`{name}`) all pointwise {fixed(t['pointwise'], 3)} s, the first "
                     f"three offloaded {fixed(t['3 offload + pointwise'], 3)} s, the first three sequence "
                     f"{fixed(t['3 sequence + pointwise'], 3)} s")
    first, second = _rec(records, names[0]), _rec(records, names[1])
    return "\n".join([f"On {device_of(first)}, BurstEngine's rows of `{names[0]}` (commit {first['commit'][:7]}, the "
                      "default plan; `bench train --model llama-3b --methods burst,plain --seqs 65536,131072`) and "
                      f"`{names[1]}` (commit {second['commit'][:7]}, the next launch: the same with `--methods burst "
                      "--set activation_offload=true`):", ""]
                     + table(["record", "tokens", "auto's plan", "s/step", "MFU", "host GiB"], body)
                     + ["", "Before the fix, with the scan read back in every layer: " + "; ".join(gaps) + ".",
                        "", "On six layers alone (`benchmarks/probe_offload.py`): " + "; ".join(probe) + "."])


BLOCKS = {"headline": block_headline, "lao": block_lao, "demo": block_demo, "demo-finetune": block_demo_finetune,
          "demo-finetune-line": block_demo_finetune_line, "demo-finetune-commands": block_demo_finetune_commands,
          "decode-graphs": block_decode_graphs, "finetune-gpu": block_finetune_gpu,
          "gluon-variants": block_gluon_variants, "gluon-bwd": block_gluon_bwd,
          "train-3b": block_train_3b, "offload": block_offload}
BLOCK_RE = re.compile(r"(<!-- report:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /report -->)", re.S)


def rewrite_blocks(text: str, records, path: str) -> str:
    def sub(m):
        name = m.group("name")
        if name not in BLOCKS:
            raise SystemExit(f"burstengine report: {path}: unknown block report:{name} (known: {', '.join(BLOCKS)})")
        try:
            body = BLOCKS[name](records)
        except KeyError as e:
            raise SystemExit(f"burstengine report: {path}: block report:{name}: {e.args[0]}") from None
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
