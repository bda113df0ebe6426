"""The Ulysses baseline of the benchmark computes exact attention (so its timings compare like
with like); checked on gloo with SDPA's math backend."""
import pytest

import peer_cases


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("hkv", [1, 2])
def test_ulysses_matches_dense(pool, world, causal, hkv):
    for rank, errs in enumerate(pool.run(peer_cases.ulysses_vs_dense, causal, hkv, world=world)):
        assert max(errs) < 1e-10, (rank, errs)
