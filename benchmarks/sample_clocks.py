"""Run a command while nvidia-smi samples the GPUs' SM clock, power and throttle reasons every
250 ms; record the samples and a summary of the loaded ones (power above half the limit).

    python benchmarks/sample_clocks.py NAME -- python -m burstengine bench train ...

Why: an attention kernel at ~600 TFLOP/s draws the board's whole power limit, so how fast it runs
depends on the clock the limit leaves it, which a kernel timing alone does not show.  Writes
NAME.json to $OUT (or ./burst-results); the command's own output and records are untouched."""
import os
import statistics
import subprocess
import sys
import time

FIELDS = "timestamp,index,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,clocks_throttle_reasons.active"
REASONS = {0x4: "sw power cap", 0x20: "sw thermal", 0x40: "hw thermal", 0x80: "hw power brake", 0x8: "hw slowdown"}


def parse(lines):
    rows = []
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 8:
            continue
        try:
            rows.append(dict(t=parts[0], gpu=int(parts[1]), sm_mhz=float(parts[2]), max_sm_mhz=float(parts[3]),
                             power_w=float(parts[4]), limit_w=float(parts[5]), temp_c=float(parts[6]),
                             throttle=int(parts[7], 16)))
        except ValueError:
            continue
    return rows


def summary(rows):
    loaded = [r for r in rows if r["power_w"] > 0.5 * r["limit_w"]]
    if not loaded:
        return dict(loaded_samples=0)
    reasons = {name: sum(bool(r["throttle"] & bit) for r in loaded) / len(loaded) for bit, name in REASONS.items()}
    return dict(loaded_samples=len(loaded), median_sm_mhz=statistics.median(r["sm_mhz"] for r in loaded),
                max_sm_mhz=loaded[0]["max_sm_mhz"], median_power_w=statistics.median(r["power_w"] for r in loaded),
                limit_w=loaded[0]["limit_w"], max_temp_c=max(r["temp_c"] for r in loaded),
                share_of_loaded_samples_throttled_by=reasons)


def main(argv):
    name, sep, cmd = argv[0], argv[1], argv[2:]
    if sep != "--" or not cmd:
        raise SystemExit("usage: sample_clocks.py NAME -- COMMAND ...")
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits", "-lms", "250"],
                           stdout=subprocess.PIPE, text=True)
    t0 = time.time()
    rc = subprocess.call(cmd)
    smi.terminate()
    rows = parse(smi.communicate()[0].splitlines())
    from burstengine.bench.records import write_record
    s = summary(rows)
    print(f"{name}: {s}", flush=True)
    out = os.environ.get("OUT") or os.environ.get("BURST_RESULTS") or "burst-results"
    print(write_record(name, dict(sampled=" ".join(cmd), returncode=rc, seconds=time.time() - t0, summary=s,
                                  samples=rows), out_dir=out))
    sys.exit(rc)


if __name__ == "__main__":
    main(sys.argv[1:])
