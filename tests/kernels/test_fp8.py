"""The FP8 forward (kernels/fp8.py): its quantization, its torch emulation (what runs on CPU)
against float64, the Triton kernel under Triton's interpreter against both, the refusals, and a
prefill that uses it (tests/inference/test_prefill.py has the model-level case)."""
import pytest
import torch

import fp8_cases
import interp_cases
from burstengine.bench.usage import kernel_error
from burstengine.kernels import KERNELS, get_kernel
from burstengine.kernels.fp8 import E4M3_MAX, FORWARD_ONLY, Fp8Kernel, quantize
from burstengine.kernels.reference import ReferenceKernel
from burstengine.kernels.registry import AUTO_TABLE
from burstengine.kernels.verify import run_forward_case
from burstengine.masks import CAUSAL, MaskSpec
from burstengine.testing import fro_err

MASKS = fp8_cases.MASKS
# e4m3 keeps 3 mantissa bits: Q, K, V and P each rounded to ~3.6% (rms) give ~3-6% normwise on
# these random blocks; bf16 gives ~0.2-0.4%
FP8_TOL = 0.08


def _qkv(B, S, H, Hkv, D, seed, dtype=torch.bfloat16, Sk=None):
    g = torch.Generator().manual_seed(seed)
    Sk = Sk or S
    return tuple(torch.randn(B, s, h, D, generator=g).to(dtype) for s, h in ((S, H), (Sk, Hkv), (Sk, Hkv)))


def test_quantize_blocks_scales_and_layout():
    q, k, v = _qkv(2, 300, 4, 2, 64, 0)
    k[:, 128:256] = 0  # an all-zero block: scale stays positive, values 0, no NaN
    v[0, :, 1] *= 1e-9  # one head's V tiny next to... itself: offsets still bounded
    fp = quantize(q, k, v, block=128)
    assert fp.q8.dtype == torch.float8_e4m3fn and fp.qs.shape == (2, 4, 3) and fp.ks.shape == (2, 2, 3)
    assert fp.vt8.shape == (2, 2 * 64, 384) and fp.voff.shape == (2, 2, 3) and fp.vu.shape == (2, 2)
    for x, x8, s in ((q, fp.q8, fp.qs), (k, fp.k8, fp.ks)):
        se = s.transpose(1, 2).repeat_interleave(128, 1)[:, :300, :, None]
        err = (x8.float() * se - x.float()).abs()
        # nearest e4m3: within half a step, 2^-4 relative, or half the subnormals' step 2^-9
        assert bool((err <= x.float().abs() * 2 ** -4 + se * 2 ** -10).all())
        assert x8.float().abs().amax() == E4M3_MAX  # the largest of some block maps to 448
    assert bool((fp.k8[:, 128:256].float() == 0).all()) and torch.isfinite(fp.ks).all()
    vdeq = fp.vt8[:, :, :300].float().view(2, 2, 64, 300).permute(0, 3, 1, 2) \
        * (torch.exp2(fp.voff) * fp.vu[..., None]).transpose(1, 2).repeat_interleave(128, 1)[:, :300, :, None]
    assert fro_err(vdeq, v.float()) < 0.05
    assert bool((fp.vt8[:, :, 300:].float() == 0).all())  # padded keys are zeros
    assert float(fp.voff.max()) <= 8.0 + 1e-6 and float(fp.voff.min()) >= -16.0 - 1e-6
    # tiles of 256 keys (block=256) read V^T's columns in 256s: no tile may pass its end
    assert quantize(q, k, v, block=256).vt8.shape[-1] == 512


@pytest.mark.parametrize("name", sorted(MASKS))
def test_emulation_against_float64(name):
    mask = MASKS[name]
    # the emulation merges in torch, which needs the running state's empty rows 0 (not poisoned)
    r = run_forward_case(Fp8Kernel(block=16), 2, 37, 37, 4, 2, 64, torch.bfloat16, mask, "cpu", seed=3,
                         poison_out=False)
    bf = run_forward_case(KERNELS["reference"], 2, 37, 37, 4, 2, 64, torch.bfloat16, mask, "cpu", seed=3,
                          poison_out=False)
    assert not r["nan"] and r["out"] <= FP8_TOL and r["lse"] <= 0.02, r
    # the quantization is really there: many times the error of the same inputs in bf16
    assert r["out"] > 5 * bf["out"], (r, bf)


def test_emulation_rows_that_see_nothing_and_gqa_plain_forward(monkeypatch):
    # the torch emulation (an interpreter some other test left on in this process would take the call)
    monkeypatch.setattr(Fp8Kernel, "runs_triton", lambda *a: False)
    q, k, v = _qkv(1, 37, 4, 1, 64, 5)
    spec = MaskSpec(causal=True, k_start=20)
    o, lse = get_kernel("fp8", "cpu").forward(q, k, v, 0.125, spec)
    ro, rl = ReferenceKernel().forward(q.double(), k.double(), v.double(), 0.125, spec)
    seen = torch.isfinite(rl)
    assert o.dtype == torch.bfloat16 and fro_err(o, ro) <= FP8_TOL
    assert bool((lse[~seen] == -torch.inf).all() and (o.transpose(1, 2)[~seen] == 0).all()) and int((~seen).sum()) > 0


def test_fp8_is_forward_only_and_never_chosen_by_auto():
    q, k, v = _qkv(1, 8, 2, 2, 16, 1)
    kern = get_kernel("fp8", "cpu")
    with pytest.raises(ValueError, match="forward only"):
        kern.backward(q, q, k, v, None, None, 0.25, CAUSAL)
    with pytest.raises(ValueError, match="forward only"):
        kern.backward_into(q, q, k, v, None, None, 0.25, CAUSAL, q, k, v)
    assert kernel_error("fp8", "cpu") is None
    assert kernel_error("fp8", "cpu", backward=True) == f"--kernel: {FORWARD_ONLY}"
    assert all(n != "fp8" for rows in AUTO_TABLE.values() for _, n in rows)
    # training's refusal (exit 2, one line): tests/cli/test_cli.py


# --- the Triton FP8 forward in the interpreter ----------------------------------------------------


@pytest.fixture(scope="module")
def fp8_results():
    return interp_cases.run("fp8_cases.py")


@pytest.mark.parametrize("case", fp8_cases.CASE_IDS)
def test_triton_fp8_matches_float64_and_its_emulation(fp8_results, case):
    r = fp8_results[case]
    assert r["ran_triton"] and not r["nan"], r
    assert r["out"] <= FP8_TOL and r["lse"] <= 0.02, r
    # the same scores exactly; P rounded against the running maximum (which the running state
    # raises) rather than the final one: within FP8's own error of the emulation
    assert r["lse_oracle"] <= 1e-5 and r["out_oracle"] <= 0.03, r
    if r["tiles"] == "one":  # one tile, no running state: P rounds as in the emulation
        assert r["fresh_lse_oracle"] <= 1e-5, r
        assert r["fresh_oracle"] <= (6e-3 if "bfloat16" in case else 1e-3), r


def test_triton_fp8_plain_forward(fp8_results):
    r = fp8_results["plain"]
    assert r["dtype"] == "bfloat16" and r["unseen_exact"] and r["unseen"] > 0
    assert r["out"] <= FP8_TOL and r["lse"] <= 0.02, r


def test_triton_fp8_zero_v_head_onto_a_large_state(fp8_results):
    r = fp8_results["zero_v_head"]
    assert r["finite"] and r["out"] <= FP8_TOL and r["lse"] <= 0.02, r


def test_a_named_kernel_reaches_a_prefill_outside_a_job():
    """Outside a process group a prefill ran plain SDPA and dropped ``kernel``; a named kernel now
    runs as a one-rank ring, so kernel="fp8" changes the logits (by FP8's error) and "reference"
    does not (beyond float32's)."""
    import copy

    from burstengine.inference import prefill
    from burstengine.inference.models import OurLlama, random_llama
    from burstengine.model import PRESETS
    from burstengine.testing import rel_err

    args = copy.deepcopy(PRESETS["tiny"])
    args.n_layers = 2
    model = OurLlama(random_llama(args, "cpu", torch.float32, 0), "tiny")
    ids = torch.randint(0, args.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    sdpa = prefill(model, ids).logits
    assert rel_err(prefill(model, ids, kernel="reference").logits, sdpa) < 1e-5
    assert 1e-3 < rel_err(prefill(model, ids, kernel="fp8").logits, sdpa) < 0.1


@pytest.mark.parametrize("i", range(3))
def test_triton_quantization_equals_torchs(fp8_results, i):
    r = fp8_results[f"quant-{i}"]
    assert r["triton"] and all(r["same"].values()), r
