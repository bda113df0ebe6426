"""burst_attn_func as a torch.library custom op, so that torch.compile traces through it.

Dynamo cannot trace the call itself (its argument check reads a verdict back to the host, the
ring waits on messages), and a graph break per layer is what users who compile their models do
not accept.  So under torch.compile :func:`~burstengine.attention.api.burst_attn_func` calls
``burstengine::burst_attn`` instead: an op opaque to the compiler, described to it by a fake
implementation (the shapes and dtypes of out and lse) and an autograd formula.  Its real
implementation is the eager call unchanged, run as one extern kernel inside the compiled graph:
checks (agreement included), plan, forward ring.

Its backward is a second op, ``burstengine::burst_attn_backward``: the forward's Python plan
(the RingRun) cannot cross from the forward graph to the backward one, so the backward rebuilds
it from the same call (attention/prepare.py: replan_call, no collective) and runs the same
backward loops as the eager autograd Function (attention/loops.py).

Only tensors, ints, floats, bools and strings cross an op's schema, so the call
(attention/call.py: AttnCall) crosses it encoded once, at trace time (:func:`encode`): its
scalar fields as one string, a constant of the graph, and its two tensor-valued mask
arguments (cu_seqlens, block_mask) as tensors beside it.  In the string the group is its name
(``ProcessGroup.group_name``; :data:`LOCAL_NAME` for ``comm.dist.LOCAL``; None for the default
group), a Topology its "NxM" string; a cu_seqlens list becomes an int64 tensor.  A DeviceMesh
topology has no such form: under compile it raises, asking for "auto", "single" or "NxM".  Both
ops decode the same string (:func:`decode`).  Eager calls never come here (api.py): they keep
the autograd Function and its zero dispatch overhead.
"""
from __future__ import annotations

import ast
import functools
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.dist import LOCAL
from ..kernels import acc_dtype
from ..schedule import Topology
from .call import AttnCall, MaskArgs
from .loops import attention_backward, attention_forward
from .prepare import prepare_call, replan_call

LOCAL_NAME = "burstengine:local"  # group name standing for comm.dist.LOCAL (no process group is named so)
# the call's scalar fields in the encoding, in this order (group and topology as names, the
# mask's under their own names): one "name=repr(value)" line each
_FIELDS = ("group", "layout", "softmax_scale", "backward", "kernel", "topology", "causal", "window", "block_size")


def _bad(name, value, want):
    return ValueError(f"burst_attn_func under torch.compile: {name} must be {want}, got {value!r}")


def _int_or_none(name, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise _bad(name, value, "an int or None")
    return value


def encode(call: AttnCall) -> tuple[str, Optional[Tensor], Optional[Tensor]]:
    """``call`` as the ops take it: (the scalar fields' string, cu_seqlens, block_mask).  Runs
    under dynamo, so plain Python only: it folds to constants of the graph.  Values of the
    right kind but wrong content (a negative window, an unknown layout) pass through to the op's
    checks, which raise as the eager call does; values of a kind no schema carries raise here."""
    group, mask, softmax_scale, topology = call.group, call.mask, call.softmax_scale, call.topology
    if group is None:
        group_name = None
    elif group is LOCAL:
        group_name = LOCAL_NAME
    elif isinstance(group, dist.ProcessGroup):
        group_name = group.group_name
    else:
        raise _bad("group", group, "a ProcessGroup, None or burstengine.comm.dist.LOCAL")
    if not isinstance(mask.causal, bool):
        raise _bad("causal", mask.causal, "a bool")
    for name, value in (("layout", call.layout), ("backward", call.backward)):
        if not isinstance(value, str):
            raise _bad(name, value, "a str")
    if call.kernel is not None and not isinstance(call.kernel, str):
        raise _bad("kernel", call.kernel, "a kernel name or None")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise _bad("softmax_scale", softmax_scale, "a positive finite number or None")
        softmax_scale = float(softmax_scale)
    window, block_size = _int_or_none("window", mask.window), _int_or_none("block_size", mask.block_size)
    if isinstance(topology, Topology):
        topology = f"{topology.nodes}x{topology.gpus_per_node}"  # what Topology.parse reads back
    elif topology is not None and not isinstance(topology, str):
        # (no repr: dynamo shows a DeviceMesh as a FakeScriptObject)
        raise ValueError('burst_attn_func under torch.compile: topology must be "auto", "single", "NxM", a Topology '
                         'or None; a DeviceMesh cannot cross the custom op (pass its shape as "NxM")')
    cu_seqlens, block_mask = mask.cu_seqlens, mask.block_mask
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        if not isinstance(cu_seqlens, (list, tuple)) or any(isinstance(c, bool) or not isinstance(c, int)
                                                            for c in cu_seqlens):
            raise _bad("cu_seqlens", cu_seqlens, "a 1-D integer tensor or a sequence of ints")
        cu_seqlens = torch.tensor(cu_seqlens, dtype=torch.int64)
    if block_mask is not None and not isinstance(block_mask, torch.Tensor):
        raise _bad("block_mask", block_mask, "a bool tensor or None")
    values = (group_name, call.layout, softmax_scale, call.backward, call.kernel, topology, mask.causal, window,
              block_size)
    # repr: a str's never holds a raw newline, a float's reads back exactly (inf and nan too)
    return "\n".join(f"{name}={value!r}" for name, value in zip(_FIELDS, values)), cu_seqlens, block_mask


@functools.lru_cache(maxsize=256)
def _fields(text: str) -> dict:
    out = {}
    for line in text.split("\n"):
        name, _, value = line.partition("=")
        # a float's repr may be "inf" or "nan", which literal_eval does not read
        out[name] = None if value == "None" else float(value) if name == "softmax_scale" else ast.literal_eval(value)
    return out


def decode(text: str, cu_seqlens: Optional[Tensor], block_mask: Optional[Tensor]) -> AttnCall:
    """The AttnCall :func:`encode` made ``text`` and the two tensors from."""
    f = _fields(text)
    name = f["group"]
    group = None if name is None else LOCAL if name == LOCAL_NAME else dist.distributed_c10d._resolve_process_group(name)
    return AttnCall(group=group, layout=f["layout"], softmax_scale=f["softmax_scale"], backward=f["backward"],
                    kernel=f["kernel"], topology=f["topology"],
                    mask=MaskArgs(causal=f["causal"], window=f["window"], cu_seqlens=cu_seqlens, block_mask=block_mask,
                                  block_size=f["block_size"]))


# the op's schema is inferred from these annotations (typing.Optional: what torch.library's
# inference reads from the string annotations ``from __future__ import annotations`` makes)
@torch.library.custom_op("burstengine::burst_attn", mutates_args=())
def burst_attn_op(q: Tensor, k: Tensor, v: Tensor, call: str, cu_seqlens: Optional[Tensor],
                  block_mask: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(out, lse) of burst_attn_func: the eager call's checks, plan and forward ring."""
    run = prepare_call(q, k, v, decode(call, cu_seqlens, block_mask))
    return attention_forward(q, k.contiguous(), v.contiguous(), run)


@burst_attn_op.register_fake
def _(q, k, v, call, cu_seqlens, block_mask):
    B, n, H, _ = q.shape
    return q.new_empty(B, n, H, v.shape[-1]), q.new_empty(B, H, n, dtype=acc_dtype(q))


@torch.library.custom_op("burstengine::burst_attn_backward", mutates_args=())
def burst_attn_backward_op(dout: Optional[Tensor], dlse: Optional[Tensor], q: Tensor, k: Tensor, v: Tensor,
                           out: Tensor, lse: Tensor, call: str, cu_seqlens: Optional[Tensor],
                           block_mask: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of burst_attn_op's call, its plan rebuilt with no collective."""
    k, v = k.contiguous(), v.contiguous()
    run = replan_call(q, k, decode(call, cu_seqlens, block_mask))
    return attention_backward(dout, dlse, q, k, v, out, lse, run)


@burst_attn_backward_op.register_fake
def _(dout, dlse, q, k, v, out, lse, call, cu_seqlens, block_mask):
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


def _setup_context(ctx, inputs, output):
    q, k, v, call, cu_seqlens, block_mask = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, block_mask)
    ctx.call = call
    ctx.set_materialize_grads(False)  # no gradient into lse stays None, as in the eager Function


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_seqlens, block_mask = ctx.saved_tensors
    dq, dk, dv = burst_attn_backward_op(dout, dlse, q, k, v, out, lse, ctx.call, cu_seqlens, block_mask)
    return dq, dk, dv, None, None, None


burst_attn_op.register_autograd(_backward, setup_context=_setup_context)


def compiled_call(q, k, v, call: AttnCall):
    """burst_attn_func's (out, lse) through the custom op (under torch.compile)."""
    return burst_attn_op(q, k, v, *encode(call))
