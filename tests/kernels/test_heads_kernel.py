"""The tensor-parallel decode step's heads kernel (burstengine/kernels/triton/heads.py) under
Triton's CPU interpreter against a float64 oracle (tests/heads_cases.py): 1-4 ranks, batches of
1-3, GQA shapes, head dims 16-128, fp16/bf16/fp32, RoPE with and without q/k norms (plain and
Gemma's 1 + weight) and heads that came roped; the new K/V rows land in the cache's slot and no
other slot is written."""
import pytest

import heads_cases
import interp_cases

# normwise: the output's rounding, plus the normed rows' rounding before RoPE (as the eager path)
TOL = {"bfloat16": 8e-3, "float16": 1.5e-3, "float32": 1e-6}


@pytest.fixture(scope="module")
def results():
    return interp_cases.run("heads_cases.py")


@pytest.mark.parametrize("case", heads_cases.CASE_IDS)
def test_heads_kernel_matches_float64(results, case):
    r = results[case]
    assert r["q_shape"] == r["want_q_shape"] and r["q_dtype"] == r["dtype"], r
    assert r["q_err"] <= TOL[r["dtype"]] and r["k_err"] <= TOL[r["dtype"]], r
    assert r["v_exact"], "a value head is written as it came"
    assert r["others_untouched"], "a slot other than the step's was written"


def test_heads_kernel_in_tensor_parallel_decode(results):
    # 2 ranks (gloo), float64 models of tests/tp_cases.py, a batch of two and single sequences (their
    # raw q, k normed and roped in the kernel), with and without q/k norms: every decode
    # step's heads go through the kernel (interpreted) instead of the eager unpack and cache
    # writes; the logits must be those up to float32 (the kernel's arithmetic), the tokens the same
    for name, r in results["tp_decode"].items():
        assert r["sliced"] and r["kernel_calls"] == 2 * 3 and r["raw"] == name.startswith("one"), (name, r)
        assert r["equal"] and r["logits_err"] < 1e-5, (name, r)


def test_heads_self_check(results):
    # what a GPU runs once per dtype and head dim before a step uses the kernel: the kernel passes
    # it; a kernel off by 10% in q fails it, with a warning (the step then runs the eager path)
    assert results["self_check"] == {"bfloat16": True, "float32": True}
    assert results["self_check_wrong"] is False and results["self_check_warned"]
