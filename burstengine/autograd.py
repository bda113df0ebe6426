"""Refusing double backward with a message that names the function.

The library's autograd Functions (the ring attention, sequence checkpointing, the hybrid's
all-to-all, the fused LM-head loss) compute their backward with communication and
hand-written kernels that are not themselves differentiable.  ``torch.autograd.grad(...,
create_graph=True)`` would otherwise return first-order gradients whose graph silently misses
terms, so that differentiating them again gives wrong values.  :func:`once_differentiable`
is torch's ``once_differentiable`` with our own message, and with the gradients tied to the
Function's inputs so that the second differentiation does reach the refusal (torch's
version ties them to nothing, which ends in "appears to not have been used in the graph"):
first-order gradients, also under ``create_graph=True``, are unchanged and exact; differentiating
them again raises RuntimeError naming the function.
"""
from __future__ import annotations

import functools

import torch


def double_backward_message(name: str) -> str:
    return (f"{name} does not support double backward (second-order gradients): its backward is not "
            f"differentiable. First-order gradients are exact; differentiating them again (torch.autograd.grad(..., "
            f"create_graph=True) followed by another backward) is refused")


class _Refuse(torch.autograd.Function):
    """Identity on ``outs``; its backward (a second-order one) raises.  ``anchors``: tensors
    of the first-order graph (the Function's inputs) that tie ``outs`` to it."""

    @staticmethod
    def forward(ctx, msg, n, *tensors):
        ctx.msg = msg
        return tuple(t.detach().clone() if i < n else None for i, t in enumerate(tensors[:n]))

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(ctx.msg)


class _SavedOnce:
    """``ctx`` for the wrapped backward, unpacking its saved tensors once for the backward and
    the refusal both (a second unpack fails under torch.utils.checkpoint)."""

    def __init__(self, ctx):
        object.__setattr__(self, "_ctx", ctx)
        object.__setattr__(self, "_saved", None)

    @property
    def saved_tensors(self):
        if self._saved is None:
            object.__setattr__(self, "_saved", self._ctx.saved_tensors)
        return self._saved

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def __setattr__(self, name, value):
        setattr(self._ctx, name, value)


def once_differentiable(name: str):
    """Decorator for an autograd Function's ``backward``: run it under no_grad, and when the
    caller asked for a graph (create_graph=True), return gradients whose own backward raises
    RuntimeError(:func:`double_backward_message`) instead of silently wrong second derivatives.
    The gradients are tied to the incoming gradients, the saved tensors and ``ctx.anchors``
    (a Function whose saved tensors are not its inputs sets it in forward)."""
    msg = double_backward_message(name)

    def wrap(fn):
        @functools.wraps(fn)
        def backward(ctx, *grads):
            if not torch.is_grad_enabled():  # create_graph=False: nothing can differentiate the gradients
                with torch.no_grad():
                    return fn(ctx, *grads)
            once = _SavedOnce(ctx)  # saved tensors may be unpacked only once (activation checkpointing)
            with torch.no_grad():
                outputs = fn(once, *grads)
            anchors = [t for t in (*grads, *once.saved_tensors, *getattr(ctx, "anchors", ()))
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if not anchors:
                return outputs
            single = not isinstance(outputs, tuple)
            outs = (outputs,) if single else outputs
            live = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor)]
            marked = _Refuse.apply(msg, len(live), *[outs[i] for i in live], *anchors)
            res = list(outs)
            for i, m in zip(live, marked):
                res[i] = m
            return res[0] if single else tuple(res)
        return backward
    return wrap
