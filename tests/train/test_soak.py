"""A short soak of the training loop (4 gloo ranks, dp 2 x cp 2, evaluations and checkpoints
included): resident memory must stay flat once warm.  The full 1,000-step soak is
`burstengine bench soak` (record benchmarks/results/soak_cpu.json)."""
from burstengine.bench.faults import soak

STEPS, FROM, EVERY = 150, 50, 50
# measured from step 50 to 150 (4 fresh ranks): +2.4 MiB clean, most of it the allocator settling;
# +13.3 MiB when every step's autograd graph is kept alive (a forward hook appending the output)
BOUND_MIB = 6.0


def test_short_soak_keeps_resident_memory_flat(pool, tmp_path):
    samples = pool.run(soak.soak_rank, STEPS, str(tmp_path / "run"), ["cp=2"], EVERY, world=4)
    for r, s in enumerate(samples):
        assert len(s) == STEPS
        g = soak.growth(s, FROM)
        assert g["growth_mib"] <= BOUND_MIB, (r, g)


def test_growth_reports_ends_and_slopes():
    mib = soak.MIB
    flat_then_leak = [100 * mib] * 10 + [100 * mib + i * 1024 for i in range(10)]
    g = soak.growth(flat_then_leak, 11)
    assert g["growth_mib"] == 9 / 1024 and abs(g["slope_kib_per_step"] - 1.0) < 1e-9
    g = soak.growth(flat_then_leak, 1)
    assert abs(g["late_slope_kib_per_step"] - 1.0) < 1e-9 and g["max_above_from_mib"] == 9 / 1024
