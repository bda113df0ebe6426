"""The benchmarks of `burstengine bench NAME`, grouped by purpose, and what every command shares.

* ``peers/``: BurstEngine timed beside the methods a user would pick instead (one method
  registry, :mod:`.peers.methods`, for the attention, prefill and train benches);
* ``checks/``: correctness on the device against float64 (and the checks' own cost);
* ``faults/``: lost ranks, damaged files and long runs (soak);
* ``probes/``: where time and memory go (profiles, kernels, one-off measurements).

Each bench module provides ``main(argv) -> int`` (the ones that run on ranks build it with
:func:`.harness.ranked_bench`) and, for the records it writes, ``SECTIONS`` (its tables in
docs/results.md) and sometimes ``BLOCKS`` (figures quoted in the docs), which ``burstengine
report`` collects.  Beside them, the runtime the commands of burstengine/cli/ share too:
:mod:`.launch` (starting the ranks), :mod:`.records` (JSON records), :mod:`.usage` (argument
checks before any rank starts), :mod:`.harness` (the ranked-bench skeleton), :mod:`.tables`
(the report's Markdown).

Nothing outside burstengine/cli/ and burstengine/bench/ imports this package (tests/test_layering.py).
"""

# name -> module, by purpose; every module here has main(argv)
BENCHES = {
    # peers
    "attention": "burstengine.bench.peers.attention",
    "sparse": "burstengine.bench.peers.sparse",
    "prefill": "burstengine.bench.peers.prefill",
    "train": "burstengine.bench.peers.train",
    "decode": "burstengine.bench.peers.decode",
    "topo": "burstengine.bench.peers.topo",
    "finetune": "burstengine.bench.peers.finetune",
    # checks
    "gpu-correctness": "burstengine.bench.checks.gpu_correctness",
    "lao-check": "burstengine.bench.checks.lao_check",
    "delta-error": "burstengine.bench.checks.delta_error",
    "check-cost": "burstengine.bench.checks.check_cost",
    "seqckpt-memory": "burstengine.bench.checks.seqckpt_memory",
    # faults
    "faults": "burstengine.bench.faults.phases",
    "soak": "burstengine.bench.faults.soak",
    "fault-times": "burstengine.bench.faults.fault_times",
    "faults-files": "burstengine.bench.faults.files",
    # probes
    "profile": "burstengine.bench.probes.profile",
    "lao-bench": "burstengine.bench.probes.lao_bench",
    "fp8": "burstengine.bench.probes.fp8",
    "gemv": "burstengine.bench.probes.gemv",
    "cpu-kernels": "burstengine.bench.probes.cpu_kernels",
    "lce": "burstengine.bench.probes.lce",
    "longest": "burstengine.bench.probes.longest",
    "probe-speed": "burstengine.bench.probes.probe_speed",
    "suite-time": "burstengine.bench.probes.suite_time",
}

# modules that are no bench but render records (benchmarks/*.py scripts write them; vs_cudnn reads
# several benches' records for docs/kernels.md's table of what auto runs)
RENDERERS = ("burstengine.bench.probes.scripts", "burstengine.bench.probes.vs_cudnn")
