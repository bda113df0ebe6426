"""The decoder's elementwise work (RMSNorm, RoPE, the MLP's gate) as one kernel each on GPUs.

Written out in torch, each of these is a chain of elementwise kernels with float32 temporaries
that the backward keeps: at 128K tokens a 3B model spends ~7% of a training step in them and
~3.5% more in the copies around them (benchmarks/results/profile_*). Compiled with
torch.compile (inductor writes one Triton kernel per function and direction), they read and
write each tensor once.  Same arithmetic as the eager versions (float32 inside, the input's
dtype out); eager where compiling does not pay (CPU: the tests' float64 reference model, tiny
shapes) or is switched off (``set_compiled(False)``, the ``fused_ops`` config knob).
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ..kernels import acc_dtype

_enabled = {"on": True}


def set_compiled(on: bool) -> None:
    """Use the compiled kernels on CUDA (default) or the eager code everywhere."""
    _enabled["on"] = bool(on)


def rms_norm_eager(x, weight, eps: float, plus_one: bool = False):
    """x / rms(x) times ``weight`` (``plus_one``: times 1 + weight, Gemma's), in float32 (float64
    for float64), cast to x's dtype at the end."""
    xf = x.to(acc_dtype(x))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.to(xf.dtype)
    if plus_one:
        w = 1.0 + w
    return (y * w).to(x.dtype)


def rope_eager(x, cos, sin):
    """x (B, n, H, D) rotated by half-split pairs (the HF LLaMA convention); cos/sin (n, D)."""
    xf = x.to(acc_dtype(x))
    h = xf.shape[-1] // 2
    rot = torch.cat([-xf[..., h:], xf[..., :h]], dim=-1)
    c, s = cos[None, :, None, :].to(xf.dtype), sin[None, :, None, :].to(xf.dtype)
    return (xf * c + rot * s).to(x.dtype)


def swiglu_eager(gate, up):
    return F.silu(gate) * up


def geglu_eager(gate, up):
    """GELU's tanh approximation of the gate times up (Gemma's gelu_pytorch_tanh MLP)."""
    return F.gelu(gate, approximate="tanh") * up


_compiled: dict = {}
_BACKEND = "inductor"  # torch.compile's backend (the tests count compiles with their own)
_any_length = [0]  # open any_length() blocks


@contextmanager
def any_length():
    """Within the block, the compiled kernels take any batch, token and head count from their
    first compile: every dim of an input but its last (the batch, tokens and heads of a (B, n,
    ...) tensor, the tokens of a (n, D) RoPE table) is marked dynamic before the call.  A prefill
    sees a new prompt length at nearly every call; without this the first length is specialised
    and the second compiles again (seconds on a GPU: the first-call penalty of a new length).
    Training, which runs one shape, keeps its specialised kernels."""
    _any_length[0] += 1
    try:
        yield
    finally:
        _any_length[0] -= 1


def _mark_lengths(args) -> None:
    for a in args:
        if isinstance(a, torch.Tensor) and a.dim() >= 2:
            for d in range(a.dim() - 1):
                torch._dynamo.maybe_mark_dynamic(a, d)


# dynamo's default of 8 compiled variants per function is too few for these ops: sizes 0/1 are
# always specialised, so one model meets (batch 1 | more) x (one token | more) x (grad | no grad)
# x layouts, and a process may run several models (the decode bench's check, then an 8B one)
_RECOMPILE_LIMIT = 64


def _run_compiled(fn, *args):
    """``fn(*args)`` through its compiled kernel.  Past dynamo's recompile limit (a hard error
    under fullgraph=True) the function's later calls run under a limit of 64 (~16 us more per call
    on the host); past that, eager with one warning: the same arithmetic, more kernels."""
    k = _compiled.get(fn)
    if k is None:
        # dynamic=None: the first shape is specialised, a second one compiles a dynamic kernel
        # (sequence-level checkpointing runs the front of the shard at another length)
        k = _compiled[fn] = (torch.compile(fn, fullgraph=True, dynamic=None, backend=_BACKEND), False)
    kernel, raised = k
    if kernel is fn:
        return fn(*args)
    if _any_length[0]:
        _mark_lengths(args)
    try:
        if not raised:
            return kernel(*args)
        with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
            return kernel(*args)
    except Exception as e:  # raised while compiling, before anything ran
        if type(e).__name__ != "FailOnRecompileLimitHit":
            raise
    if not raised:
        _compiled[fn] = (kernel, True)
        return _run_compiled(fn, *args)
    warnings.warn(f"{fn.__name__}: torch.compile made {_RECOMPILE_LIMIT} variants of it in this process; it "
                  f"runs eager from now on: the same arithmetic, more kernels", stacklevel=3)
    _compiled[fn] = (fn, True)
    return fn(*args)


def _use_compiled(x: torch.Tensor) -> bool:
    return _enabled["on"] and x.is_cuda and x.dtype != torch.float64 and not torch.compiler.is_compiling()


def run(fn, *args):
    """``fn(*args)`` compiled as the ops here are, where they are (CUDA, not float64, switched on):
    for a chain of small elementwise steps elsewhere (a decode step's merge over ranks), a kernel
    or two instead of one per step.  ``fn`` must be a module-level function (its compiled form is
    kept per function)."""
    return _run_compiled(fn, *args) if _use_compiled(args[0]) else fn(*args)


def rms_norm(x, weight, eps: float, plus_one: bool = False):
    if _use_compiled(x):
        return _run_compiled(rms_norm_eager, x, weight, eps, plus_one)
    return rms_norm_eager(x, weight, eps, plus_one)


def rope(x, cos, sin):
    return _run_compiled(rope_eager, x, cos, sin) if _use_compiled(x) else rope_eager(x, cos, sin)


def swiglu(gate, up):
    return _run_compiled(swiglu_eager, gate, up) if _use_compiled(gate) else swiglu_eager(gate, up)


def geglu(gate, up):
    return _run_compiled(geglu_eager, gate, up) if _use_compiled(gate) else geglu_eager(gate, up)


GATES = {"silu": swiglu, "gelu_tanh": geglu}  # ModelArgs.activation -> the MLP's gate(gate, up)
