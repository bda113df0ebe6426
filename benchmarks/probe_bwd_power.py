"""Probe: the SM clock and board power while the plain backward runs, ours beside cuDNN's, at the
full-block lengths where ours falls behind (d=128, 32 q / 8 kv heads, bf16).  nvidia-smi samples
every 100 ms; each kernel runs back to back for a few seconds, the two alternating twice, and the
samples inside each run give its median clock and power.  Whether a kernel that loses only on long
runs is losing clock to the power limit (same work, more energy) or work per clock.

    python benchmarks/probe_bwd_power.py 65536,131072 [seconds per run]

Writes probe_bwd_power.json to $OUT (or /tmp)."""
import os
import statistics
import subprocess
import sys
import threading
import time

import torch

from burstengine.kernels.sdpa import CudnnKernel
from burstengine.kernels.triton.kernel import TritonKernel

H, HKV, D = 32, 8, 128
ours, cud = TritonKernel(), CudnnKernel()


def sampler(samples, stop):
    p = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                          "--format=csv,noheader,nounits", "-lms", "100", "-i", str(torch.cuda.current_device())],
                         stdout=subprocess.PIPE, text=True)
    for line in p.stdout:
        try:
            mhz, w, c = (float(x) for x in line.split(","))
        except ValueError:
            continue
        samples.append((time.time(), mhz, w, c))
        if stop.is_set():
            break
    p.terminate()


def run(fn, seconds):
    """Calls of fn back to back for about ``seconds``: (window, per-call seconds)."""
    torch.cuda.synchronize()
    t0, times = time.time(), []
    while time.time() - t0 < seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return (t0, time.time()), times


def main():
    seqs = [int(x) for x in sys.argv[1].split(",")]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 6.0
    samples, stop = [], threading.Event()
    threading.Thread(target=sampler, args=(samples, stop), daemon=True).start()
    time.sleep(1.0)
    rows = []
    for S in seqs:
        q, do = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(1, S, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        scale = D ** -0.5
        o, lse = cud.forward(q, k, v, scale, "full")
        delta = ours.delta(o, do)
        fns = {"cudnn": lambda: cud.backward(do, q, k, v, lse, delta, scale, "full", out=o),
               "ours": lambda: ours.backward(do, q, k, v, lse, delta, scale, "full")}
        for fn in fns.values():
            fn()
        fl = 2.5 * 4 * S * S * H * D
        for rep in range(2):
            for name, fn in fns.items():
                (t0, t1), times = run(fn, seconds)
                time.sleep(0.3)  # the last samples of the window
                inside = [s for s in samples if t0 + 0.5 <= s[0] <= t1]
                row = dict(S=S, method=name, rep=rep, times=times, window_s=t1 - t0, samples=len(inside),
                           tflops=fl / statistics.median(times) / 1e12,
                           median_sm_mhz=statistics.median(s[1] for s in inside) if inside else None,
                           median_power_w=statistics.median(s[2] for s in inside) if inside else None,
                           max_temp_c=max(s[3] for s in inside) if inside else None)
                if row["median_sm_mhz"]:
                    row["tflops_per_ghz"] = row["tflops"] / (row["median_sm_mhz"] / 1e3)
                    row["joules_per_call"] = row["median_power_w"] * statistics.median(times)
                rows.append(row)
                print(f"S={S:>6} {name:<5} rep {rep}: {row['tflops']:5.0f} TFLOP/s, {len(times)} calls, SM "
                      f"{row['median_sm_mhz']} MHz, {row['median_power_w']} W, "
                      f"{row.get('tflops_per_ghz', 0):.0f} TFLOP/s per GHz, {row.get('joules_per_call', 0):.1f} J "
                      f"a call", flush=True)
        del q, do, k, v, o, lse, delta
        torch.cuda.empty_cache()
    stop.set()
    from burstengine.bench.records import write_record
    print(write_record("probe_bwd_power", dict(device=torch.cuda.get_device_name(), heads=H, kv_heads=HKV,
                                               head_dim=D, mask="full", rows=rows),
                       out_dir=os.environ.get("OUT", "/tmp")))


if __name__ == "__main__":
    main()
