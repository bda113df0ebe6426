"""Tables for the records the scripts in benchmarks/ write (outside the package: Gluon kernel
probes, ptxas builds, Nsight Compute counters, GPU clocks, offloading probes), for `burstengine
report`; registered in burstengine.bench.RENDERERS."""
from __future__ import annotations

from ..tables import Section, device_of, fixed, med, ms, num, record, table


def gluon_variants(rec):
    body = [[r["S"], r["method"], ms(med(r["times"])), f"{r['tflops']:.0f}"] for r in rec["bench"] if "method" in r]
    return table(["S", "kernel", "ms", "TFLOP/s"], body)


def ptxas(rec):
    # a build holds one kernel's counts, or several under "kernels" (later records); loops marked
    # innermost (later records) are the step loops, the hot code
    def inner(k):
        xs = [f"{x['instructions']}/{x['ldl']}" for x in k["loops"] if x.get("innermost")]
        return " ".join(xs) if xs else "—"

    body = [[name, b["commit"], kname, k["spill_store_bytes"], k["spill_load_bytes"],
             " ".join(str(x["ldl"]) for x in k["loops"]), inner(k)]
            for name, b in rec["builds"].items()
            for kname, k in (b["kernels"].items() if "kernels" in b else [("", b)])]
    return table(["build", "commit", "kernel", "spill stores (B)", "spill loads (B)",
                  "LDL per wgmma loop (SASS order)", "innermost loops: instructions/LDL"], body)


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


def probe_gluon_bwd(rec):
    rows = rec["rows"]
    base = {(r.get("call", "backward"), r["D"], r["S"], r["mask"]): med(r["times"]) for r in rows
            if r["method"] == "cudnn"}
    body = [[r["D"], r.get("call", "backward"), f"{r['S'] // 1024}K", r["mask"], r["method"], ms(med(r["times"])),
             f"{r['tflops']:.0f}", f"{base[(r.get('call', 'backward'), r['D'], r['S'], r['mask'])] / med(r['times']):.2f}×"]
            for r in rows]
    bad = sum(not c["ok"] for c in rec["check"])
    adds = "; cuDNN's backward_into time includes its three gradient adds" if any(
        r.get("call") == "backward_into" for r in rows) else ""
    return ([f"{rec['heads']} q / {rec['kv_heads']} kv heads, bf16; {len(rec['check'])} check cases against float64, "
             f"{bad} failed{adds}.", ""]
            + table(["d", "call", "S", "mask", "kernel", "ms", "TFLOP/s", "× cuDNN"], body))


def probe_bwd_power(rec):
    body = [[f"{r['S'] // 1024}K", r["method"], r["rep"], len(r["times"]), f"{r['tflops']:.0f}",
             fixed(r["median_sm_mhz"], 0), fixed(r["median_power_w"], 0), fixed(r.get("tflops_per_ghz"), 0),
             fixed(r.get("joules_per_call"), 0)] for r in rec["rows"]]
    return table(["S", "kernel", "run", "calls", "TFLOP/s", "SM MHz", "W", "TFLOP/s per GHz", "J a call"], body)


def _ncu_value(row, metric: str, per: float = 1.0):
    # ncu_bwd_bytes.py's rows: ncu's CSV value ("1,234", in the unit the script asked for: bytes,
    # ns, %, sectors) over ``per``, or None where ncu gave none
    v = row["metrics"].get(metric)
    return float(v[0].replace(",", "")) / per if v else None


def _dram(row) -> tuple[float, float]:
    # an ncu_bwd_bytes.py row: (GB of DRAM read and written, L2 hit %)
    return (_ncu_value(row, "dram__bytes_read.sum", 1e9) + _ncu_value(row, "dram__bytes_write.sum", 1e9),
            _ncu_value(row, "lts__t_sector_hit_rate.pct"))


def ncu_bwd_bytes(rec):
    cols = (("gpu__time_duration.sum", 1e6, 0), ("dram__bytes_read.sum", 1e9, 1), ("dram__bytes_write.sum", 1e9, 1),
            ("lts__t_sector_hit_rate.pct", 1.0, 1), ("lts__t_sectors_op_read.sum", 1e9, 1),
            ("lts__t_sectors_op_red.sum", 1e9, 1))
    body = [[f"{r['S'] // 1024}K", r["method"]] + [fixed(_ncu_value(r, m, per), d) for m, per, d in cols]
            for r in rec["rows"] if r["metrics"]]
    return table(["S", "kernel", "ms (clock locked)", "DRAM read GB", "DRAM written GB", "L2 hit %",
                  "L2 read sectors (G)", "L2 reduce sectors (G)"], body)


def block_gluon_bwd_d64(records):
    """docs/kernels.md: the backward at d=64 before and with LAG, and the split of the group over
    programs on the ring step's backward_into."""
    name, split_name = "probe_gluon_bwd_lag2_h200.json", "probe_gluon_bwd_split_h200.json"
    rec, split = record(records, name), record(records, split_name)
    t = {(r["S"], r["mask"], r["method"]): r["tflops"] for r in rec["rows"] if r["D"] == 64}
    cols = [(m, k, h) for m in ("causal", "full") for k, h in (("cudnn", "cuDNN"), ("ours v0", "ours"),
                                                               ("ours v4", "ours, LAG (kept)"))]
    body = [[f"{S // 1024}K"] + [f"{t[(S, m, k)]:.0f}" for m, k, _ in cols] for S in sorted({k[0] for k in t})]
    u = {(r["D"], r["S"], r["mask"], r["method"].split(" max_steps=")[-1].removesuffix(" into")): r["tflops"]
         for r in split["rows"]}
    scols = [("cudnn", "cuDNN + adds"), ("off", "ours, group whole"), ("1", "ours, one q head a program (kept)")]
    sbody = [[D, f"{S // 1024}K", m] + [f"{u[(D, S, m, k)]:.0f}" for k, _ in scols]
             for D, S, m in sorted({k[:3] for k in u}, key=lambda k: (-k[0], k[1], k[2]))]
    bad = sum(not c["ok"] for c in rec["check"] + split["check"])
    return "\n".join([f"On {device_of(rec)} (`{name}`, commit {rec['commit'][:7]}, which held the variants as flags; "
                      f"d=64, {rec['heads']} q heads on {rec['kv_heads']} kv heads, bf16; TFLOP/s of the plain "
                      "backward, median of 7):", ""]
                     + table(["S"] + [f"{m}: {h}" for m, _, h in cols], body)
                     + ["", f"The ring step's `backward_into` onto float32 gradients (`{split_name}`, commit "
                        f"{split['commit'][:7]}; TFLOP/s, median of 5; cuDNN's time includes its three gradient adds; "
                        f"{len(rec['check']) + len(split['check'])} check cases of the two launches against float64, "
                        f"{bad} failed):", ""]
                     + table(["d", "S", "mask"] + [h for _, h in scols], sbody) + ["", _lost_variants(records)])


def _lost_variants(records) -> str:
    # probe_gluon_bwd_variants_h200.json: v1 (bf16 P for dS), v2 (own dQ) over the kernel as kept (v0)
    name = "probe_gluon_bwd_variants_h200.json"
    rec = record(records, name)
    t = {(r["D"], r["S"], r["mask"], r["method"]): med(r["times"]) for r in rec["rows"]}

    def ratios(v):
        xs = [t[k[:3] + ("ours v0", )] / x for k, x in t.items() if k[3] == f"ours v{v}"]
        return f"{min(xs):.2f}-{max(xs):.2f}×"

    return (f"Not kept (`{name}`, commit {rec['commit'][:7]}; the plain backward at d 64 and 128, 16K and 64K, time of "
            f"the kernel before LAG over the variant's): dS from bf16 P {ratios(1)}; each warpgroup's own dQ "
            f"{ratios(2)} (d=64 only).")


def block_bwd_power(records):
    """docs/kernels.md: what the d=128 full backward at 128K does with its clock and bytes."""
    pw, nc = record(records, "probe_bwd_power_h200.json"), record(records, "ncu_bwd_bytes_h200.json")
    p = {(r["S"], r["method"]): r for r in pw["rows"] if r["rep"] == 1}

    def byt(S, m):
        return _dram(next(x for x in nc["rows"] if (x["S"], x["method"]) == (S, m)))

    out = []
    for S in sorted({k[0] for k in p}):
        o, c = p[(S, "ours")], p[(S, "cudnn")]
        (ob, oh), (cb, ch) = byt(S, "ours"), byt(S, "cudnn")
        out.append(f"{S // 1024}K: ours {o['tflops']:.0f} TFLOP/s at {o['median_sm_mhz']:.0f} MHz and "
                   f"{o['joules_per_call']:.0f} J a call, cuDNN {c['tflops']:.0f} at {c['median_sm_mhz']:.0f} MHz and "
                   f"{c['joules_per_call']:.0f} J; DRAM bytes {ob:.0f} GB against {cb:.0f} GB, L2 hits {oh:.0f}% "
                   f"against {ch:.0f}%.")
    return (f"On {device_of(pw)}, d=128 full blocks, {pw['heads']} q / {pw['kv_heads']} kv heads, the plain backward "
            f"run back to back for 5 s each (`probe_bwd_power_h200.json`, the second of two alternating runs; both "
            f"kernels at the board's {p[(max(k[0] for k in p), 'ours')]['median_power_w']:.0f} W) and one call each "
            f"under Nsight Compute (`ncu_bwd_bytes_h200.json`): " + " ".join(out))


def block_bwd_chunks(records):
    """docs/kernels.md: the d=128 full backward at 128K, its DRAM bytes whole and in chunks of q
    tiles, and the chunk sizes timed."""
    def dram(name, method):
        gb, hit = _dram(next(x for x in record(records, name)["rows"]
                             if (x["S"], x["method"]) == (131072, method) and x["metrics"]))
        return f"{gb:,.0f} GB ({hit:.0f}% L2 hits)"

    l2, old, chunk = "ncu_bwd_l2_128k_h200.json", "ncu_bwd_bytes_h200.json", "ncu_bwd_chunk_128k_h200.json"
    ncu_line = (f"Nsight Compute, one call each at 128K (DRAM bytes read and written): ours walking whole blocks "
                f"{dram(old, 'ours')} in `{old}`, {dram(l2, 'ours')} in `{l2}`; the same without STAGGER "
                f"{dram(l2, 'ours-nostagger')}; one q head a program (`backward_into`) {dram(l2, 'ours-into')}; "
                f"in chunks of 256 q tiles {dram(chunk, 'ours-into')} (`{chunk}`); cuDNN {dram(old, 'cudnn')} and "
                f"{dram(l2, 'cudnn')}.")
    name = "probe_gluon_bwd_chunk_sweep_h200.json"
    rec = record(records, name)
    t = {(r["S"], r["mask"], r["chunk"]): r["tflops"] for r in rec["rows"] if r["D"] == 128}
    chunks = sorted({k[2] for k in t if k[2] is not None})
    body = [[f"{S // 1024}K", m, f"{t[(S, m, None)]:.0f}"] + [f"{t[(S, m, c)]:.0f}" for c in chunks]
            for S, m in sorted({k[:2] for k in t})]
    today = []
    for n in ("probe_gluon_bwd_chunk_into_h200.json", "probe_gluon_bwd_chunk_plain_h200.json"):
        r = record(records, n)
        u = {(x["D"], x["S"], x["mask"], x["chunk"]): med(x["times"]) for x in r["rows"]}
        for (D, S, m, c), x in u.items():
            if c and m == "full" and S == max(k[1] for k in u) and D == 128:
                whole = f", {u[(D, S, m, 0)] / x:.2f}× the unchunked kernel" if (D, S, m, 0) in u else ""
                today.append(f"`{n}` ({r['rows'][0]['call']}, commit {r['commit'][:7]}) "
                             f"{u[(D, S, m, None)] / x:.2f}× cuDNN{whole}")
    return "\n".join([ncu_line, "", f"On {device_of(rec)}, d=128, {rec['heads']} q / {rec['kv_heads']} kv heads, the "
                      f"ring step's `backward_into` onto float32 gradients (`{name}`, commit {rec['commit'][:7]}; "
                      f"TFLOP/s, median of 5; cuDNN's time includes its three gradient adds; causal blocks are not "
                      f"cut, so their columns time one kernel):", ""]
                     + table(["S", "mask", "cuDNN + adds"] + [f"chunk {c}" if c else "whole" for c in chunks], body)
                     + ["", "With today's chunks of 512, 128K full blocks: " + "; ".join(today) + "."])


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


def _probe_speeds(rec) -> dict:
    # benchmarks/probe_gluon.py's records: TFLOP/s by (S, method)
    return {(r["S"], r["method"]): r["tflops"] for r in rec["bench"] if "method" in r}


def _probe_worst(rec) -> float:
    # the largest error against float64 over the record's check cases
    return max(v for c in rec["check"] for v in c.values() if isinstance(v, float))


def block_gluon_variants(records):
    """docs/kernels.md: the Gluon variants measured and not kept, beside cuDNN, from one record."""
    name = "gluon_variants_h200.json"
    rec = record(records, name)
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
    rec, h100, tr = record(records, name), record(records, h100_name), record(records, tr_name)
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


def block_gluon_wide(records):
    """docs/kernels.md: the forward's wide kv tiles for full blocks, measured and not kept."""
    name = "gluon_wide_h200.json"
    rec = record(records, name)
    speed = _probe_speeds(rec)
    widths = rec["widths"]
    cols = [("cudnn", "cuDNN")] + [(f"gluon n={n}", f"ours, {n}-key tiles") for n in widths]
    body = [[f"{S // 1024}K"] + [f"{speed[(S, m)]:.0f}" for m, _ in cols]
            for S in sorted({S for S, m in speed if m == "cudnn"})]
    into = {m: t for (S, m), t in speed.items() if "into" in m or "merge" in m}
    into_S = next(S for S, m in speed if "into" in m)
    into_line = ", ".join(f"{m.replace('gluon into n=', 'ours at ')} {t:.0f}" for m, t in into.items())
    return "\n".join([f"On {device_of(rec)} (`{name}`, commit {rec['commit']}, which held the wide tiles; full "
                      "blocks, 32 q heads on 8 kv heads, d=128, bf16; TFLOP/s of the plain forward, median of 5-7; "
                      f"{len(rec['check'])} check cases within 2e-2 (out) and 1e-3 (lse) of float64, "
                      f"{rec['check_failures']} failed):", ""]
                     + table(["S"] + [h for _, h in cols], body)
                     + ["", f"The ring step's merge (`forward_into`) of one full {into_S // 1024}K block, TFLOP/s: "
                            f"{into_line}."])


def block_gluon_pipe(records):
    """docs/kernels.md: the forward with a PV left in flight under the next tile's softmax, built
    (ptxas) and timed, not kept."""
    name, ptx_name = "gluon_fwd_pipe_h200.json", "ptxas_gluon_fwd_pipe.json"
    rec, ptx = record(records, name), record(records, ptx_name)
    speed = _probe_speeds(rec)
    cols = [(f"{k} {m}", f"{m}: {h}") for m in ("causal", "full")
            for k, h in (("cudnn", "cuDNN"), ("gluon", "ours"), ("gluon pipe", "ours, PV in flight"))]
    body = [[f"{S // 1024}K"] + [f"{speed[(S, m)]:.0f}" for m, _ in cols] for S in sorted({S for S, _ in speed})]
    ks = ptx["builds"]["now"]["kernels"]
    spills = "; ".join(f"`{k}` {b['spill_store_bytes']:,} B stored / {b['spill_load_bytes']:,} B loaded, local loads "
                       f"a loop step {'/'.join(str(x['ldl']) for x in b['loops'])}"
                       for k, b in sorted(ks.items()) if k.endswith("pipe"))
    bad = sum(not c["ok"] for c in rec["check"])
    return "\n".join([f"On {device_of(rec)} (`{name}`, commit {rec['commit'][:7]}, which held the variant as a flag; "
                      "24 q heads on 8 kv heads, d=128, bf16; TFLOP/s of the plain forward, median of 7; "
                      f"{len(rec['check'])} check cases of both builds within 2e-2 (out) and 1e-3 (lse) of float64, "
                      f"{bad} failed):", ""]
                     + table(["S"] + [h for _, h in cols], body)
                     + ["", f"Built for sm_90a without a GPU (`{ptx_name}`, commit {ptx['commit'][:7]}): {spills}; "
                            "the kernel as kept spills nothing."])


def block_fwd_d256(records):
    """docs/kernels.md: the Gluon forward at d=256 beside cuDNN, plain and the ring step's
    forward_into, and its build."""
    return _block_fwd(records, 256)


def block_fwd_d96(records):
    """docs/kernels.md: the same at d=96 (the head dim in column pieces)."""
    return _block_fwd(records, 96)


def _block_fwd(records, d):
    name, ptx_name = f"gluon_fwd_d{d}_h200.json", f"ptxas_gluon_fwd_d{d}.json"
    rec, ptx = record(records, name), record(records, ptx_name)
    t = {(r["S"], r["method"]): med(r["times"]) for r in rec["bench"] if "method" in r}
    fl = {(r["S"], r["method"]): r["tflops"] for r in rec["bench"] if "method" in r}
    cols = [(f"{k} {m}", f"cudnn{k[5:]} {m}") for k in ("gluon", "gluon-into") for m in ("causal", "full")]
    body = [[f"{S // 1024}K"] + [f"{fl[(S, o)]:.0f} / {fl[(S, c)]:.0f} ({t[(S, c)] / t[(S, o)]:.2f}×)" for o, c in cols]
            for S in sorted({S for S, _ in t})]
    bad = sum(not c["ok"] for c in rec["check"])
    ks = ptx["builds"]["now"]["kernels"]
    built = "; ".join(f"`{k}` {b['spill_store_bytes']} B of spills, {b['shared_bytes'] // 1024} KB of shared memory"
                      for k, b in sorted(ks.items()) if k.endswith(f"d{d}"))
    return "\n".join([f"On {device_of(rec)} (`{name}`, commit {rec['commit'][:7]}; 24 q heads on 8 kv heads, d={d}, "
                      "bf16; TFLOP/s ours / cuDNN (cuDNN's forward_into is its forward and the torch merge), median of "
                      f"7; {len(rec['check'])} check cases within 2e-2 (out) and 1e-3 (lse) of float64, {bad} failed):",
                      ""]
                     + table(["S", "forward causal", "forward full", "forward_into causal", "forward_into full"], body)
                     + [f"Built for sm_90a without a GPU (`{ptx_name}`, commit {ptx['commit'][:7]}): {built}."])


def block_bwd_d256(records):
    """docs/kernels.md: the d=256 backward (bwd_wide.py) beside cuDNN: its first build, the split by
    kv columns with the dQ pieces pipelined (SDP off), SDP; plain and the ring step's backward_into."""
    first, sdp, into = (record(records, n) for n in ("probe_gluon_bwd_d256_h200.json",
                                                      "probe_gluon_bwd_d256_sdp_h200.json",
                                                      "probe_gluon_bwd_d256_into_h200.json"))

    def speeds(rec):
        # (S, mask, "cudnn" or the method's last word: its sdp=, chunk= or into) -> TFLOP/s
        return {(r["S"], r["mask"], r["method"] if r["method"] == "cudnn" else r["method"].split()[-1]): r["tflops"]
                for r in rec["rows"]}

    a, b, c = speeds(first), speeds(sdp), speeds(into)
    cell = lambda x, base: f"{x:.0f} ({x / base:.2f}×)"  # noqa: E731
    body = [[f"{S // 1024}K", mask, f"{b[(S, mask, 'cudnn')]:.0f}", cell(a[(S, mask, 'chunk=256')], a[(S, mask, 'cudnn')]),
             cell(b[(S, mask, 'sdp=0')], b[(S, mask, 'cudnn')]), cell(b[(S, mask, 'sdp=1')], b[(S, mask, 'cudnn')]),
             f"{c[(S, mask, 'cudnn')]:.0f}", cell(c[(S, mask, 'into')], c[(S, mask, 'cudnn')])]
            for S, mask in sorted({(S, m) for S, m, _ in b})]
    checks = sum(len(r["check"]) for r in (first, sdp, into))
    bad = sum(not e["ok"] for r in (first, sdp, into) for e in r["check"])
    return "\n".join([f"On {device_of(sdp)} (`probe_gluon_bwd_d256_h200.json` at {first['commit'][:7]}, "
                      f"`probe_gluon_bwd_d256_sdp_h200.json` and `probe_gluon_bwd_d256_into_h200.json` at "
                      f"{sdp['commit'][:7]}; {sdp['heads']} q heads on {sdp['kv_heads']} kv heads, d=256, bf16; "
                      "TFLOP/s, the backward counted as 2.5 forwards, × the same launch's cuDNN (in `backward_into`, "
                      f"cuDNN's backward and its three gradient adds); {checks} check cases against float64, "
                      f"{bad} failed):", ""]
                     + table(["S", "mask", "cuDNN", "first build", "kv split, dQ pipelined", "SDP (kept)",
                              "cuDNN + adds", "SDP backward_into"], body))


def _head_dim_rows(rec) -> list[list]:
    rows = {(r["D"], r.get("H", rec["heads"]), r["S"], r["mask"], r["method"]): r for r in rec["rows"]
            if "error" not in r}
    body = []
    for D, H, S, mask in sorted({k[:4] for k in rows}):
        o, c = rows.get((D, H, S, mask, "ours")), rows.get((D, H, S, mask, "cudnn"))
        if o and c:
            body.append([D, H, f"{S // 1024}K", mask, f"{o['fwd_tflops']:.0f} / {c['fwd_tflops']:.0f}",
                         f"{o['fwd_tflops'] / c['fwd_tflops']:.2f}×", f"{o['bwd_tflops']:.0f} / {c['bwd_tflops']:.0f}",
                         f"{o['bwd_tflops'] / c['bwd_tflops']:.2f}×",
                         f"{o['auto']['forward']} / {o['auto']['backward']}".replace("triton", "ours")])
    return body


def block_head_dims(records):
    """docs/kernels.md: our kernels beside cuDNN at each head dim, and what ``auto`` runs there;
    then d=128 at short lengths and d=64 at long ones, two head counts, in two more launches."""
    out = []
    for name, what in (("probe_head_dims_lag_h200.json", "median of 5"),
                       ("probe_head_dims_short_h200.json", "median of 11; d=128 alone, shorter blocks"),
                       ("probe_head_dims_d64_long_h200.json", "median of 5; d=64 alone, longer blocks"),
                       ("probe_head_dims_d256_h200.json", "median of 5; d=256 alone, both Gluon kernels")):
        rec = record(records, name)
        bad = sum(not c["ok"] for c in rec["check"])
        errs = [r for r in rec["rows"] if "error" in r]
        out += [f"On {device_of(rec)} (`{name}`, commit {rec['commit'][:7]}; q heads on {rec['kv_heads']} kv heads, "
                f"bf16, TFLOP/s, {what}, the backward counted as 2.5 forwards; {len(rec['check'])} check cases "
                f"against float64 at 1,152 tokens, {bad} failed" + (f"; {len(errs)} cells could not run" if errs else "")
                + "):", ""]
        out += table(["d", "q heads", "S", "mask", "forward: ours / cuDNN", "×", "backward: ours / cuDNN", "×",
                      "auto at the record's commit (fwd / bwd)"], _head_dim_rows(rec)) + [""]
    return "\n".join(out[:-1])


def probe_families(rec):
    head = [f"{rec['layers']} layers of each family's hub shape, {rec['seq']:,} tokens, random weights; "
            f"||x − ref|| / ||ref|| against transformers in float32 (eager attention), transformers "
            f"{rec['transformers']}.", ""]
    body = [[r["family"], r.get("model_type", "—"), num(r["ours_bf16_err"]), num(r["hf_bf16_err"]),
             f"{r['ours_bf16_argmax_agree']:.3f}", "yes" if r["pass"] else "NO"] if "error" not in r
            else [r["family"], "—", r["error"], "", "", "NO"] for r in rec["rows"]]
    return head + table(["family", "model_type", "ours bf16", "transformers bf16 (SDPA)", "same argmax",
                         "within 2× transformers'"], body)


def probe_nccl_graph(rec):
    return table(["ranks", "layers", "collectives per step", "eager ms", "graph ms", "µs per collective in the graph",
                  "graph = eager"],
                 [[rec["world"], rec["layers"], rec["collectives_per_step"], fixed(rec["eager_step_ms"], 2),
                   fixed(rec["graph_step_ms"], 2), fixed(rec["graph_us_per_collective"], 1),
                   "yes" if rec["graph_equals_eager"] else "NO"]])


SECTIONS = (
    Section("Every family on the GPU kernels", r"^probe_families", probe_families,
            "`python benchmarks/probe_families.py --seq 8192`: each model family's bf16 logits through the "
            "kernels a GPU picks, beside transformers' own bf16 error."),
    Section("NCCL collectives inside a CUDA graph", r"^probe_nccl_graph", probe_nccl_graph,
            "`torchrun --nproc_per_node 2 benchmarks/probe_nccl_graph.py`: a multi-rank decode step's all-gathers "
            "and all-reduces captured in one graph, against the same ops eager."),
    Section("Gluon kernel variants", r"^gluon_", gluon_variants,
            "`benchmarks/probe_gluon.py`: the Gluon kernels and variants of them built behind flags for one "
            "measurement (docs/kernels.md): causal forward and backward alone, beside cuDNN in the same launch."),
    Section("Kernel builds for sm_90a", r"^ptxas_", ptxas,
            "`benchmarks/ptxas_gluon_bwd.py`: a Gluon kernel built without a GPU; ptxas's spills and the local "
            "loads each wgmma loop runs per step."),
    Section("Kernel profiler counters", r"^ncu_gluon", ncu,
            "Nsight Compute on one kernel launch: issue rate, stalls, spills (the clock is locked while it "
            "measures)."),
    Section("The Gluon backward's variants", r"^probe_gluon_bwd", probe_gluon_bwd,
            "`python benchmarks/probe_gluon_bwd_variants.py SEQS D:VARIANTS ... [--into]`: variants of the Gluon "
            "backward behind flags, checked against float64 and timed beside cuDNN in one launch."),
    Section("DRAM and L2 traffic of the attention kernels", r"^ncu_(bwd|fwd)_", ncu_bwd_bytes,
            "`python benchmarks/ncu_bwd_bytes.py SEQS [METHODS]`: one backward of ours (plain, without STAGGER, or "
            "the ring step's `backward_into`) or plain forward (`-fwd`), and cuDNN's, under Nsight Compute (its "
            "clock locked)."),
    Section("Clock and power while the backward runs", r"^probe_bwd_power", probe_bwd_power,
            "`python benchmarks/probe_bwd_power.py SEQS SECONDS`: ours and cuDNN's plain backward back to back, "
            "nvidia-smi sampling every 100 ms."),
    Section("GPU clocks and power under load", r"^clocks_", clocks,
            "`python benchmarks/sample_clocks.py NAME -- COMMAND`: nvidia-smi's SM clock, power and throttle "
            "reasons every 250 ms around a run."),
    Section("Offloading activations to the host", r"^probe_offload", probe_offload,
            "`python benchmarks/probe_offload.py SEQ LAYERS`: the `offload` checkpointing policy beside "
            "`pointwise`, `none` and `sequence` on a few layers of the 3B model."),
    Section("Copies to host memory", r"^probe_host_copy", probe_host_copy,
            "`python benchmarks/probe_host_copy.py MIB`: whether a non-blocking copy from the device returns to "
            "the host at once, for the host memory `offload` uses and two others."),
)
BLOCKS = {"gluon-variants": block_gluon_variants, "gluon-bwd": block_gluon_bwd, "gluon-wide": block_gluon_wide,
          "gluon-pipe": block_gluon_pipe, "head-dims": block_head_dims, "gluon-bwd-d64": block_gluon_bwd_d64,
          "bwd-power": block_bwd_power, "bwd-chunks": block_bwd_chunks, "fwd-d256": block_fwd_d256, "fwd-d96": block_fwd_d96,
          "bwd-d256": block_bwd_d256}
