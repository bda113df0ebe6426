"""The flash-decoding kernel (burstengine/kernels/triton/decode.py) under Triton's CPU interpreter
against a float64 oracle (tests/decode_cases.py): GQA ratios 1/2/4/8, head dims 64/128,
fp16/bf16/fp32, lengths that divide no tile (1, 7, 997), visibility masks, sliding windows over
shuffled slot positions, empty sequences and fully hidden ones, one and several splits, slots
past the valid count poisoned with NaN (never read); the same over an FP8 cache against the
oracle over its dequantized rows; and inside generation, on the cache's own
buffers, giving the math path's greedy tokens."""
import sys

import pytest

import interp_cases
import decode_cases

TOL = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 1e-5}  # normwise: P rounded to the cache dtype


@pytest.fixture(scope="module")
def results():
    return interp_cases.run("decode_cases.py")


@pytest.mark.parametrize("case", decode_cases.CASE_IDS + [c + "-fp8" + w for c in decode_cases.FP8_IDS
                                                           for w in decode_cases.WIDEN.values()]
                         + [c + "-fp8-small-v" + w for c in decode_cases.FP8_SMALL_V for w in decode_cases.WIDEN.values()]
                         + [f"{c}-fp8-{n}{decode_cases.WIDEN[w]}" for n, (c, ws) in decode_cases.FP8_HOSTILE.items()
                            for w in ws])
def test_decode_kernel_matches_float64(results, case):
    # "-fp8": over an FP8 cache, against the float64 oracle over its dequantized rows; "-small-v":
    # V's rows 1e-3 of K's, whose scales P must not be multiplied by in fp16 (underflow); "-f16":
    # the tiles widened to fp16 (q scaled, P times the V scales over the tile's largest);
    # FP8_HOSTILE: hidden slots with huge V rows, zero queries and zero V rows
    r = results[case]
    assert not r["nan"], "a NaN past the valid slots (or from an empty row) reached the output"
    assert r["out_dtype"] == r["lse_dtype"] == "float32"
    assert r["packed"], "out and lse must be views of one (B, H, D + 1) buffer (the merge sends it whole)"
    assert r["out_err"] <= TOL[r["dtype"]], r
    assert r["lse_err"] <= 1e-4, r
    assert r["unseen_exact"], "a query that sees nothing must give out = 0, lse = -inf"


def test_decode_kernel_cases_cover_empty_rows(results):
    # the cases that must have rows seeing nothing do (else unseen_exact would test nothing)
    assert results["g2-d64-bf16-empty"]["unseen"] == 4   # sequence 0: valid 0, 4 heads
    assert results["g4-d64-fp16-hidden"]["unseen"] == 4  # sequence 1: every slot hidden


def test_split_plan(results):
    # (splits, chunk) for (capacity, programs, SMs): chunks are whole tiles of 64 that cover the
    # capacity with none empty; the target is 4 programs per SM, at most 64 splits, at least a
    # tile each, and the chunk is the shortest that reaches the capacity in that many splits
    caps = ((131073, 8, 132), (32769, 64, 132), (100, 8, 132), (1, 1, 132), (524289, 8, 132), (4097, 1024, 132))
    for (cap, progs, sms), (splits, chunk) in zip(caps, results["plan"]):
        target = min(-(-4 * sms // progs), 64, -(-cap // 64))
        assert chunk % 64 == 0 and splits * chunk >= cap > (splits - 1) * chunk
        assert splits <= target and (chunk - 64) * target < cap, (cap, progs, splits, chunk)
    assert [s for s, _ in results["plan"]] == [63, 9, 2, 1, 64, 1]


def test_decode_kernel_in_generation(results):
    # 4 decode steps x 2 layers, each through the kernel
    assert set(results["generate"]) == {"llama", "mistral", "mistral-fp8"}
    for arch, r in results["generate"].items():
        assert r["kernel_calls"] == 8 and r["equal"] and r["logits_err"] < 1e-5, (arch, r)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("kind", ["agrees", "off_by_one", "raises"])
def test_decode_kernel_self_check(monkeypatch, kind, fp8):
    """Before the decode kernel serves a (device, dtype, head dim[, over an FP8 cache]), it is
    compared with the math path on one small masked case: one that disagrees or fails to build is
    never used (a warning says why, the math path answers). A stand-in kernel: no triton or GPU
    needed."""
    import types
    import warnings

    import torch

    from burstengine.inference import kvcache

    def agrees(*a, **kw):
        assert (kw.get("k_scale") is not None) == fp8 and a[1].dtype == (torch.float8_e4m3fn if fp8 else torch.float32)
        return kvcache._math(*a, **kw)

    def off_by_one(*a, **kw):
        out, lse = kvcache._math(*a, **kw)
        return out + 1, lse

    def raises(*a, **kw):
        raise RuntimeError("PassManager::run failed")

    fake = types.ModuleType("burstengine.kernels.triton")
    fake.decode = types.SimpleNamespace(decode_attention={"agrees": agrees, "off_by_one": off_by_one,
                                                          "raises": raises}[kind])
    monkeypatch.setitem(sys.modules, "burstengine.kernels.triton", fake)
    monkeypatch.setattr(kvcache, "_CHECKED", {})
    monkeypatch.setattr(kvcache, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = kvcache._self_checked(torch.device("cpu"), torch.float32, 64, fp8)
        again = kvcache._self_checked(torch.device("cpu"), torch.float32, 64, fp8)  # once per key
    msgs = [str(w.message) for w in caught]
    assert ok == again == (kind == "agrees")
    if kind == "agrees":
        assert not msgs
    else:
        assert len(msgs) == 1 and "failed its self-check" in msgs[0] and "math path" in msgs[0], msgs
        assert ("differs from the math path" in msgs[0]) == (kind == "off_by_one"), msgs
        assert ("over an FP8 cache" in msgs[0]) == fp8, msgs
