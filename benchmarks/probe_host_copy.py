"""Probe: does a device-to-host ``copy_(..., non_blocking=True)`` return to the host at once, for the
kinds of host memory the ``offload`` policy could copy into?  A host that waits for each copy keeps
the device's compute queue short, and the device then idles while the copy runs (what
``bench profile`` saw in the forward of an offloading step).  For each kind: the host time of the
call while a long matmul is queued before it (a copy that waits for the matmul returns only after
it), the device time of the copy, and what ``is_pinned()`` says.

    python benchmarks/probe_host_copy.py [MIB]      # default 1024; record: probe_host_copy
"""
import sys
import time

import torch

from burstengine.model.offload import _HostBuffer
from burstengine.bench.records import write_record

mib = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
n = mib << 20
dev = torch.device("cuda")
src = torch.empty(n, dtype=torch.uint8, device=dev).fill_(7)
a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
side = torch.cuda.Stream()
kinds = {
    "registered (cudaHostRegister, as offload does)": lambda: _HostBuffer(n, True),
    "torch pinned (pin_memory=True)": lambda: torch.empty(n, dtype=torch.uint8, pin_memory=True),
    "pageable": lambda: torch.empty(n, dtype=torch.uint8),
}
rows = []
for name, make in kinds.items():
    keep = make()  # a registered buffer stays registered while its owner (the _HostBuffer) lives
    dst = keep.data if isinstance(keep, _HostBuffer) else keep
    for trial in range(3):
        torch.cuda.synchronize()
        for _ in range(20):  # ~20 ms of matmuls queued on the compute stream
            a @ a
        side.wait_stream(torch.cuda.current_stream())
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        with torch.cuda.stream(side):
            e0.record(side)
            dst.copy_(src, non_blocking=True)
            e1.record(side)
        host_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        row = dict(kind=name, trial=trial, mib=mib, host_call_s=host_s, device_copy_s=e0.elapsed_time(e1) / 1e3,
                   is_pinned=bool(dst.is_pinned()), correct=bool(dst[:: 1 << 20].eq(7).all()))
        rows.append(row)
        print(f"{name:<48} host call {host_s * 1e3:8.2f} ms, copy on the device {row['device_copy_s'] * 1e3:7.2f} ms, "
              f"is_pinned {row['is_pinned']}, bytes right {row['correct']}", flush=True)
    del dst, keep
print("record:", write_record("probe_host_copy", dict(mib=mib, rows=rows)))
