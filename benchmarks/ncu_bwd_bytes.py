"""One backward (or plain forward: the -fwd methods) of ours or cuDNN's on full blocks (d=128,
32 q / 8 kv heads, bf16) after a warm-up, for Nsight Compute to count its DRAM and L2 traffic;
then the counts as a record.

    python benchmarks/ncu_bwd_bytes.py 65536,131072 [ours,ours-nostagger,ours-into,cudnn,ours-fwd,cudnn-fwd]

Why: at 128K ours runs at a lower SM clock than cuDNN's under the same power limit, with more
energy a call, while at 64K the two match (probe_bwd_power_h200.json); whether that energy is
memory traffic.  Writes ncu_bwd_bytes.json to $OUT (or /tmp)."""
import csv
import io
import os
import subprocess
import sys

METRICS = ["gpu__time_duration.sum", "dram__bytes_read.sum", "dram__bytes_write.sum", "lts__t_sector_hit_rate.pct",
           "lts__t_sectors_op_red.sum", "lts__t_sectors_op_read.sum"]
# ours-into: the ring step's backward_into onto float32 gradients; *-fwd: the plain forward instead
KERNELS = {"ours": "bwd_kernel", "ours-nostagger": "bwd_kernel", "ours-into": "bwd_kernel", "cudnn": "flash_bprop",
           "ours-fwd": "fwd_kernel", "cudnn-fwd": "flash_fprop"}


def once(S: int, which: str) -> None:
    import torch
    from burstengine.kernels.sdpa import CudnnKernel
    from burstengine.kernels.triton.kernel import TritonKernel
    from burstengine.kernels.gluon import grid
    grid.STAGGER = which != "ours-nostagger"
    ours, cud = TritonKernel(), CudnnKernel()
    q, do = (torch.randn(1, S, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(1, S, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    o, lse = cud.forward(q, k, v, 128 ** -0.5, "full")
    delta = ours.delta(o, do)
    acc = [torch.zeros(t.shape, device="cuda") for t in (q, k, v)] if which == "ours-into" else None
    for _ in range(2):  # the first compiles / plans; ncu skips it (cudnn-fwd: the forward above)
        if which.endswith("-fwd"):
            (ours if which == "ours-fwd" else cud).forward(q, k, v, 128 ** -0.5, "full")
        elif acc:
            ours.backward_into(do, q, k, v, lse, delta, 128 ** -0.5, "full", *acc)
        elif which != "cudnn":
            ours.backward(do, q, k, v, lse, delta, 128 ** -0.5, "full")
        else:
            cud.backward(do, q, k, v, lse, delta, 128 ** -0.5, "full", out=o)
    torch.cuda.synchronize()


def main():
    if sys.argv[1] == "--once":
        return once(int(sys.argv[2]), sys.argv[3])
    rows, methods = [], (sys.argv[2] if len(sys.argv) > 2 else "ours,cudnn").split(",")
    for S in (int(x) for x in sys.argv[1].split(",")):
        for which in methods:
            regex = KERNELS[which]
            cmd = ["ncu", "--target-processes", "all", "-k", f"regex:{regex}", "--launch-skip", "1", "--launch-count",
                   "1", "--metrics", ",".join(METRICS), "--csv", sys.executable, __file__, "--once", str(S), which]
            p = subprocess.run(cmd, capture_output=True, text=True)
            text = p.stdout[p.stdout.find('"ID"'):]
            got = {r["Metric Name"]: (r["Metric Value"], r["Metric Unit"]) for r in csv.DictReader(io.StringIO(text))}
            kernel = next(csv.DictReader(io.StringIO(text)), {}).get("Kernel Name", "")
            rows.append(dict(S=S, method=which, kernel=kernel[:80], metrics=got, rc=p.returncode,
                             tail=p.stderr[-400:] if not got else ""))
            print(S, which, kernel[:50], got or p.stderr[-400:], flush=True)
    from burstengine.bench.records import write_record
    print(write_record(os.environ.get("NAME", "ncu_bwd_bytes"), dict(rows=rows, metrics=METRICS, clock="ncu's default (locked to base)"),
                       out_dir=os.environ.get("OUT", "/tmp")))


if __name__ == "__main__":
    main()
