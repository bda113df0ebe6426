"""Build kernels/gluon/bwd.py for sm_90a without a GPU and count its spills: ptxas -v (spill bytes)
and, per loop of the SASS that holds wgmmas, the local loads/stores (LDL/STL) it runs every step.

    python benchmarks/ptxas_gluon_bwd.py before=/path/to/old/checkout after=. [128 64 64/0 128/1/64 ...]

Each NAME=DIR is a checkout; the other arguments the builds of each: a head dim, or D/LAG,
D/LAG/Q_ROWS or D/LAG/Q_ROWS/into|split (gluon/bwd.py's LAG 0/1 and q rows a step at that head
dim, empty for the kernel's own; the plain backward's build, or the ring step's onto float32 dK,
dV with the group whole or split); default 128 and 64.  Each
checkout's kernels build in a fresh process (triton's active driver replaced by a stub
that reports sm_90; the launch stops after compiling).  Writes ptxas_gluon_bwd.json to $OUT or
./burst-results."""
import json
import os
import re
import subprocess
import sys
import tempfile

# the prelude of a build: triton's driver replaced by a stub that reports sm_90, kernel launches
# that stop after compiling; capture(name, thunk) writes the kernel thunk() launches to
# <argv[2]><name>.ptx / .cubin / .json (its shared memory)
PRELUDE = r'''
import json, os, sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction


class Stub:
    def get_current_target(self): return GPUTarget("cuda", 90, 32)
    def get_current_device(self): return 0
    def get_current_stream(self, d=None): return 0
    def get_active_torch_device(self): return torch.device("cpu")
    def get_device_interface(self): return torch.cuda
    def map_python_to_cpp_type(self, ty):
        from triton.backends.nvidia.driver import ty_to_cpp
        return ty_to_cpp(ty)


driver.set_active(Stub())
sys.path.insert(0, sys.argv[1])
got, run = {}, JITFunction.run
JITFunction.run = lambda self, *a, grid, warmup, **kw: got.setdefault("k", run(self, *a, grid=grid, warmup=True, **kw))


def capture(name, thunk):
    got.clear()
    thunk()
    open(sys.argv[2] + name + ".ptx", "w").write(got["k"].asm["ptx"])
    open(sys.argv[2] + name + ".cubin", "wb").write(got["k"].asm["cubin"])
    json.dump(dict(shared=got["k"].metadata.shared), open(sys.argv[2] + name + ".json", "w"))
'''

BUILD = PRELUDE + r'''
from burstengine.kernels.gluon import bwd as gb
try:
    from burstengine.kernels.gluon import grid as gg  # since 7f228ad; before, in bwd.py
except ImportError:
    gg = gb
try:
    from burstengine.kernels.gluon import bwd_wide  # d=256's kernel, since its commit
except ImportError:
    bwd_wide = None
B, S, H, HKV = 1, 1024, 24, 8  # the 3B model's heads; the build does not depend on S
defaults = dict(gb.LAG), dict(gg.Q_ROWS), gg.MAX_STEPS
for spec in sys.argv[3:] or ["128", "64"]:  # D[/LAG[/Q_ROWS[/into|split]]]: see the docstring
    D, lag, rows, dst = (spec.split("/") + ["", "", ""])[:4]
    D = int(D)
    gb.LAG.update(defaults[0]), gg.Q_ROWS.update(defaults[1])  # each spec from the kernel's own
    if D in gb.LAG:
        gb.LAG[D] = bool(int(lag)) if lag else gb.LAG[D]
    gg.Q_ROWS[D] = int(rows or gg.Q_ROWS[D])
    gg.MAX_STEPS = 1 if dst == "split" else defaults[2]
    name = f"d{D}" + (f"_lag{lag}" if lag else "") + (f"_m{rows}" if rows else "") + (f"_{dst}" if dst else "")
    q = torch.zeros(B, S, H, D, dtype=torch.bfloat16)
    k = torch.zeros(B, S, HKV, D, dtype=torch.bfloat16)
    # the plain backward's build (fresh bf16 dK, dV), or the ring step's onto float32 (into: the
    # group whole, read-add-store; split: one q head a program, atomic adds)
    acc = torch.float32 if dst else torch.bfloat16
    into = bwd_wide.backward_into if bwd_wide and D in bwd_wide.HEAD_DIMS else gb.backward_into
    capture(name, lambda: into(q, q, k, k, torch.zeros(B, H, S), torch.zeros(B, H, S), D ** -0.5, 0,
                                           torch.zeros(B, S, H, D), torch.zeros_like(k, dtype=acc),
                                           torch.zeros_like(k, dtype=acc), not dst))
'''


def loops(sass: str) -> list[dict]:
    """The SASS loops (a backward branch over 300-2600 lines) that issue wgmmas: their LDL/STL, and
    whether a loop is innermost (no other such loop inside it: a step loop, the hot code; the
    others count their inner loops' loads too)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, l in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", l))}
    out = []
    for i, l in enumerate(lines):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", l)
        if m and 300 < i - labels.get(m.group(1), i) < 2600:
            body = lines[labels[m.group(1)]:i]
            if any("HGMMA" in b for b in body):
                out.append(dict(label=m.group(1), start=labels[m.group(1)], instructions=len(body),
                                ldl=sum("LDL" in b for b in body), stl=sum("STL" in b for b in body)))
    for x in out:
        x["innermost"] = not any(y is not x and x["start"] <= y["start"] and y["start"] + y["instructions"]
                                 <= x["start"] + x["instructions"] for y in out)
    return out


def stats(base: str) -> dict:
    """ptxas -v of <base>.ptx for sm_90a (spill bytes, registers) and the SASS loops of <base>.cubin."""
    import triton
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = subprocess.run([os.path.join(bindir, "ptxas"), "-arch=sm_90a", "-v", base + ".ptx", "-o", base + ".o"],
                           capture_output=True, text=True, check=True).stderr
    sass = subprocess.run([os.path.join(bindir, "nvdisasm"), "-c", base + ".cubin"], capture_output=True, text=True,
                          check=True).stdout
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    regs = re.search(r"Used (\d+) registers", ptxas)
    return dict(spill_store_bytes=int(m.group(1)), spill_load_bytes=int(m.group(2)), registers=int(regs.group(1)),
                shared_bytes=json.load(open(base + ".json"))["shared"], loops=loops(sass),
                ptxas=ptxas.strip().splitlines())


def build_all(srcs, code: str, *args: str) -> dict:
    """{NAME: {commit, kernels: {kernel: stats}}} for each NAME=DIR of ``srcs``: ``code`` (PRELUDE
    plus capture calls; sys.argv[3:] = ``args``) run in a fresh process on DIR's checkout."""
    builds = {}
    for arg in srcs:
        name, _, src = arg.partition("=")
        with tempfile.TemporaryDirectory() as tmp:
            rev = subprocess.run(["git", "-C", src, "rev-parse", "--short", "HEAD"], capture_output=True,
                                 text=True).stdout.strip()
            base = os.path.join(tmp, "")
            subprocess.run([sys.executable, "-c", code, os.path.abspath(src), base, *args], check=True)
            names = sorted(f[:-4] for f in os.listdir(tmp) if f.endswith(".ptx"))
            builds[name] = dict(commit=rev, kernels={n: stats(base + n) for n in names})
    return builds


def main(argv) -> None:
    from burstengine.bench.records import write_record
    builds = build_all([a for a in argv if "=" in a], BUILD, *[a for a in argv if "=" not in a])
    for name, b in builds.items():
        for kname, k in b["kernels"].items():
            print(f"{name} {kname}: {k['registers']} registers, spills {k['spill_store_bytes']} B stored, "
                  f"{k['spill_load_bytes']} B loaded; per-loop LDL " + " ".join(str(x["ldl"]) for x in k["loops"])
                  + "; innermost loops (instructions/LDL) " + " ".join(f"{x['instructions']}/{x['ldl']}" for x in k["loops"]
                                                                       if x.get("innermost"))
                  + f"; shared {k['shared_bytes']} B", flush=True)
    out = os.environ.get("OUT") or os.environ.get("BURST_RESULTS") or "burst-results"
    print(write_record("ptxas_gluon_bwd", dict(target="sm_90a", builds=builds), out_dir=out))


if __name__ == "__main__":
    main(sys.argv[1:])
