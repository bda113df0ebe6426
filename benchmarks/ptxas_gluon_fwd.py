"""Build kernels/gluon/fwd.py for sm_90a without a GPU (as ptxas_gluon_bwd.py does the backward):
spill bytes, registers and shared memory from ptxas -v / the compiler, and the LDL/STL in the
SASS loops that issue wgmmas, for the plain forward and forward_into (ACC) in each variant: base
(the default build), pipe (two kv tiles a loop step, a PV under the next softmax; commit dd07c74
holds it, ptxas_gluon_fwd_pipe.json its build: ~2 KB of spills, dropped after).

    python benchmarks/ptxas_gluon_fwd.py base,pipe,base@256 now=. main=/work/main

A name@D builds head dim D (default 128).

Each NAME=DIR builds DIR's kernels in a fresh process (default now=.).  Commit 443989c's version
of this script built the wide kv tiles (128,144,160,192).  Needs a Triton with Gluon (PYTHONPATH).  Writes
ptxas_gluon_fwd.json to $OUT or ./burst-results."""
import os
import sys

from ptxas_gluon_bwd import PRELUDE, build_all

BUILD = PRELUDE + r'''
from burstengine.kernels.gluon import fwd as gf
B, S, H, HKV = 1, 1024, 32, 8  # the 8B model's heads; the build does not depend on S
for spec in sys.argv[3].split(","):
    name, _, d = spec.partition("@")  # "base@256": the build at head dim 256
    D = int(d or 128)
    if name != "base" and not hasattr(gf, "PIPE") or D not in gf.STAGES:
        continue  # a variant or head dim this checkout's kernel does not hold (pipe: commit dd07c74)
    kw = {} if name == "base" else dict(pipe=name == "pipe")
    q = torch.zeros(B, S, H, D, dtype=torch.bfloat16)
    k = torch.zeros(B, S, HKV, D, dtype=torch.bfloat16)
    tag = spec.replace("@", "_d")
    capture(f"fwd_{tag}", lambda: gf.forward(q, k, k, 0.088, False, **kw))
    capture(f"fwd_into_{tag}", lambda: gf.forward_into(q, k, k, 0.088, None, torch.zeros(B, S, H, D),
                                                      torch.zeros(B, H, S), **kw))
'''


def main(argv) -> None:
    from burstengine.bench.records import write_record
    widths = argv[0] if argv and "=" not in argv[0] else "base"
    builds = build_all([a for a in argv if "=" in a] or ["now=."], BUILD, widths)
    for name, bs in builds.items():
        for kname, b in bs["kernels"].items():
            print(f"{name} {kname:<14} spills {b['spill_store_bytes']:>5} B stored {b['spill_load_bytes']:>5} B loaded; "
                  f"{b['registers']} registers at launch; shared {b['shared_bytes']} B; per-loop LDL/STL "
                  + " ".join(f"{x['ldl']}/{x['stl']}" for x in b["loops"]), flush=True)
            for w in b["ptxas"]:
                if "warning" in w.lower():  # C7514 / C7511: ptxas serialised the wgmmas
                    print("   ", w, flush=True)
    out = os.environ.get("OUT") or os.environ.get("BURST_RESULTS") or "burst-results"
    print(write_record("ptxas_gluon_fwd", dict(target="sm_90a", widths=widths, builds=builds), out_dir=out))


if __name__ == "__main__":
    main(sys.argv[1:])
