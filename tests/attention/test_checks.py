"""Bad calls to burst_attn_func fail fast and alike on every rank (after at most the one small
agreement collective, never inside the ring, so no rank is left waiting), and the kernel
choice honours kernel= and BURST_KERNEL (read by attention/planning.py, never by the kernels)."""
import pytest
import torch

import burstengine as be
import dist_cases
from burstengine import kernels
from burstengine.attention import planning
from burstengine.kernels.reference import ReferenceKernel

# case -> a word or phrase the ValueError message must contain (case-insensitive)
BAD = {
    "shape_mismatch": "local tokens",
    "kv_mismatch": "k and v shapes differ",
    "dtype_mismatch": "dtypes differ",
    "heads_not_divisible": "multiple of k/v heads",
    "zigzag_odd": "even number",
    "int_dtype": "floating-point",
    "not_4d": "4-D",
    "head_dim": "head dims differ",
    "bad_layout": "unknown layout",
    "bad_backward": "unknown backward",
    "bad_scale": "softmax_scale",
    "device_meta": "different devices",
    "gloo_with_meta": "gloo",
    "bad_group": "process group",
    "bad_kernel": "unknown kernel",
    "cuda_kernel_on_cpu": "cannot run on device",
    "causal_not_bool": "causal must be a bool",
    "batch_mismatch": "batch sizes differ",
    "empty": "empty input",
    "not_tensor": "torch.tensor",
    "nan_scale": "softmax_scale",
}
WORLDS = (2, 4)


def _check_messages(msgs, world, case):
    assert len(msgs) == world
    for rank, msg in enumerate(msgs):
        assert msg is not None, f"{case}: rank {rank} of {world} raised no ValueError"
        assert BAD[case].lower() in msg.lower(), f"{case}: rank {rank} of {world}: {msg!r}"
    assert len(set(msgs)) == 1, f"{case}: ranks disagree: {msgs}"


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("world", WORLDS)
def test_bad_call_raises_on_every_rank(pool, world, case):
    _check_messages(pool.run(dist_cases.bad_call_more, case, world=world), world, case)


@pytest.mark.parametrize("world", WORLDS)
def test_pool_in_step_after_bad_calls(pool, world):
    """Every bad call, then good calls on the same processes: a rank left inside a half-started
    ring would hang them (the pool times out) or mix up their messages (wrong results)."""
    for case in sorted(BAD):
        _check_messages(pool.run(dist_cases.bad_call_more, case, world=world), world, case)
    for backward in ("burst", "ring"):
        for rank, r in enumerate(pool.run(dist_cases.good_call, 5, backward=backward, world=world)):
            assert r["err"] <= 1e-4, (backward, rank, r)
            assert r["rank_sum"] == world * (world - 1) / 2
            assert (r["fwd_bytes"], r["bwd_bytes"]) == (r["want_fwd"], r["want_bwd"]), (backward, rank, r)


# --- kernel choice (single process, world 1: no process group) ---------------------------------

@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv("BURST_KERNEL", raising=False)
    return monkeypatch


class _Spy(ReferenceKernel):
    name = "spy"

    def __init__(self):
        self.calls = []

    def forward(self, *a, **kw):
        self.calls.append("forward")
        return super().forward(*a, **kw)

    def backward(self, *a, **kw):
        self.calls.append("backward")
        return super().backward(*a, **kw)


@pytest.fixture
def spy(no_env):
    s = _Spy()
    no_env.setitem(kernels.KERNELS, "spy", s)
    return s


def _qkv():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(1, 8, 2, 16, generator=g, requires_grad=True)
    v = torch.randn(1, 8, 2, 16, generator=g, requires_grad=True)
    return q, k, v


def test_auto_is_cpu_flash_on_cpu(no_env):
    # torch's CPU flash attention op (kernels/cpu_flash.py; float64 calls go on to the reference)
    assert planning.resolve_kernel(None, "cpu").name == "cpu_flash"
    assert planning.resolve_kernel("auto", "cpu").name == "cpu_flash"
    assert planning.resolve_kernel("reference", torch.device("cpu")).name == "reference"
    no_env.setenv("BURST_KERNEL", "auto")
    assert planning.resolve_kernel(None, "cpu").name == "cpu_flash"


@pytest.mark.parametrize("source", ["arg", "env"])
def test_unknown_kernel(no_env, source):
    if source == "env":
        no_env.setenv("BURST_KERNEL", "magic")
    with pytest.raises(ValueError, match="unknown kernel 'magic'"):
        planning.resolve_kernel("magic" if source == "arg" else None, "cpu")
    with pytest.raises(ValueError, match="unknown kernel 'magic'"):
        be.burst_attn_func(*_qkv(), kernel="magic" if source == "arg" else None)


@pytest.mark.parametrize("name", ["cudnn", "flash"])
@pytest.mark.parametrize("source", ["arg", "env"])
def test_gpu_kernel_on_cpu(no_env, name, source):
    if source == "env":
        no_env.setenv("BURST_KERNEL", name)
    with pytest.raises(ValueError, match=f"kernel '{name}' cannot run on device cpu"):
        planning.resolve_kernel(name if source == "arg" else None, "cpu")
    with pytest.raises(ValueError, match="cannot run on device"):
        be.burst_attn_func(*_qkv(), kernel=name if source == "arg" else None)


def test_kernels_read_no_environment(no_env):
    no_env.setenv("BURST_KERNEL", "magic")
    assert kernels.get_kernel(None, "cpu").name == "cpu_flash"
    assert planning.resolve_kernel("reference", "cpu").name == "reference"
    with pytest.raises(ValueError, match="unknown kernel 'magic'"):
        planning.resolve_kernel(None, "cpu")


def test_kernel_argument_is_used(spy):
    out = be.burst_attn_func(*_qkv(), kernel="spy", causal=True)
    out.sum().backward()
    assert spy.calls == ["forward", "backward"]


def test_env_is_used(spy, no_env):
    no_env.setenv("BURST_KERNEL", "spy")
    be.burst_attn_func(*_qkv()).sum().backward()
    assert spy.calls == ["forward", "backward"]


def test_argument_beats_env(spy, no_env):
    no_env.setenv("BURST_KERNEL", "spy")
    assert planning.resolve_kernel("reference", "cpu").name == "reference"
    be.burst_attn_func(*_qkv(), kernel="reference").sum().backward()
    assert spy.calls == []
    # and a bad env value does not matter when the argument names a kernel
    no_env.setenv("BURST_KERNEL", "magic")
    assert planning.resolve_kernel("reference", "cpu").name == "reference"


def test_once_scans_each_signature_once_on_one_rank(monkeypatch):
    """Level "once" on one rank (one-GPU training runs every layer on a one-rank ring): the NaN/inf
    scan, a host read, runs for the first call of each signature only, as on a group; "full"
    scans every call.  A scan in every layer of every step stalled the one-GPU step."""
    from burstengine.attention import agreement, checks

    scans = []
    real = checks.nonfinite_mask
    monkeypatch.setattr(checks, "nonfinite_mask", lambda *a: scans.append(1) or real(*a))
    monkeypatch.setattr(agreement, "_AGREED", {})
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=g) for _ in range(3))
    for level, calls, want in (("once", 3, 1), ("full", 3, 3)):
        scans.clear()
        with checks.arg_checks(level):
            for _ in range(calls):
                be.burst_attn_func(q, k, v, causal=True)
        assert len(scans) == want, (level, len(scans))
    with checks.arg_checks("once"):
        scans.clear()
        be.burst_attn_func(q[:, :8], k[:, :8], v[:, :8], causal=True)  # another shape: scanned
        assert len(scans) == 1
        bad = q[:, :4].clone()
        bad[0, 1, 0, 0] = float("nan")
        with pytest.raises(ValueError, match="q contains NaN or inf"):  # a new signature's NaN still raises
            be.burst_attn_func(bad, k[:, :4], v[:, :4], causal=True)
        with pytest.raises(ValueError, match="q contains NaN or inf"):  # and is not remembered as fine
            be.burst_attn_func(bad, k[:, :4], v[:, :4], causal=True)
