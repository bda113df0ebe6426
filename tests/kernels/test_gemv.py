"""The GEMV kernel of the decode step's projections (burstengine/kernels/triton/gemv.py) under
Triton's CPU interpreter against float64 (tests/gemv_cases.py), and its tile choice by N."""
import pytest

import gemv_cases
import interp_cases


@pytest.fixture(scope="module")
def results():
    return interp_cases.run("gemv_cases.py")


@pytest.mark.parametrize("case", gemv_cases.CASE_IDS)
def test_gemv_matches_float64(results, case):
    r = results[case]
    assert r["dtype"] == r["want_dtype"] and r["shape"] == r["want_shape"], r
    assert r["err"] < (5e-3 if r["dtype"] == "bfloat16" else 1e-3), r  # the output's rounding


def test_gemv_tiles_follow_the_weight_rows(results):
    narrow, wide = [32, 512, 4, 3], [64, 128, 4, 3]
    assert results["configs"] == {"1536": narrow, "4096": narrow, "12287": narrow, "12288": wide, "128256": wide}
