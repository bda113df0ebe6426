"""Fused LM head + cross-entropy (BurstEngine §3.3, Algorithm 3).

The naive LM head materialises N x V logits, a log-softmax of the same size, and their
gradient: at N = 128K tokens and a 128K vocabulary that is 32 GiB each in bf16.  Here the
tokens are cut into chunks of C rows; for each chunk

1. logits = H_c W^T  (C x V, one GEMM into a reused workspace),
2. one kernel sweeps the vocabulary in tiles with a running lse, writes each row's loss and
   overwrites the logits *in place* with d loss / d logits,
3. dH_c = G W and dW += G^T H_c  (two GEMMs, dW accumulated in float32).

So the gradients are finished in the forward (Algorithm 3): the backward only scales them by
the upstream gradient, and no N x V tensor is ever stored or recomputed.  The matrix products
go to cuBLAS (or the CPU BLAS); step 2 is a Triton kernel on CUDA (fused_ce_triton.py) and the
same arithmetic in chunked torch elsewhere.

reduction='none' cannot finish dW in the forward (the per-token upstream gradients are not
known yet), so it keeps H, W and the labels and redoes the chunk loop in the backward with the
upstream gradient folded into step 2: one GEMM more than the fused path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..attention.planning import ce_impl_from_env
from ..autograd import once_differentiable
from ..comm.dist import group_info
from ..kernels.base import acc_dtype
from .fused_ce_triton import ce_rows_triton, interpret_mode, triton_available

REDUCTIONS = ("mean", "sum", "none")
IMPLS = ("auto", "triton", "torch")
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# workspace for one chunk of logits.  Every chunk reads and writes the whole float32 dW
# accumulator (8 V d bytes) for 2 C V d FLOPs, so the chunk must be long for that traffic to
# hide behind the GEMMs: on an H200 at V = 128K and 128K tokens, 1 GiB (C = 4096) came within
# 2% of a bf16 accumulator, and an earlier build with 512 MiB was 4% slower than it
# (benchmarks/results/lce_bench.json, lce_bench_ws512m.json).  1/32 of the N x V logits there.
_CUDA_WORKSPACE = 1 << 30
_CPU_WORKSPACE = 32 << 20
# float32 temporaries of the torch path: at most this many elements per vocabulary tile
_TORCH_TILE = 1 << 22


def _cap(x, softcap):
    return x if softcap is None else softcap * torch.tanh(x / softcap)


def ce_rows_torch(buf, labels, loss_out, scale, *, ignore_index, softcap, z_loss, write_grad):
    """Cross-entropy of each row of the logits chunk ``buf`` (C, V), in place.

    Writes loss_i = lse_i - z_{i,y_i} + z_loss * lse_i^2 (0 for ignored rows) into ``loss_out``
    and, with ``write_grad``, overwrites ``buf`` with scale_i * d loss_i / d logits_i, where
    ``scale`` is one value or one per row.  z = softcap * tanh(logits / softcap) when softcap is
    set.  The vocabulary is swept in tiles with a running max and sum, so the float32 temporaries
    stay at C x tile."""
    C, V = buf.shape
    if C == 0:
        return
    acc = acc_dtype(buf)
    tile = max(1, min(V, _TORCH_TILE // C))
    valid = labels != ignore_index
    # a label outside [0, V) (only reaches here when the caller skipped the check) reads row 0
    # and makes its loss and gradient NaN
    bad = valid & ((labels < 0) | (labels >= V))
    safe = torch.where(valid & ~bad, labels, 0)
    m = torch.full((C,), float("-inf"), dtype=acc, device=buf.device)
    s = torch.zeros(C, dtype=acc, device=buf.device)
    for v0 in range(0, V, tile):
        x = _cap(buf[:, v0:v0 + tile].to(acc), softcap)
        m_new = torch.maximum(m, x.amax(1))
        s = s * torch.exp(m - m_new) + torch.exp(x - m_new[:, None]).sum(1)
        m = m_new
    lse = m + torch.log(s)
    xt = _cap(buf.gather(1, safe[:, None]).squeeze(1).to(acc), softcap)
    loss_out.copy_(torch.where(valid, torch.where(bad, float("nan"), lse - xt + z_loss * lse * lse), 0.0))
    if not write_grad:
        return
    coef = (1.0 + 2.0 * z_loss * lse)[:, None]
    rs = torch.where(valid, torch.where(bad, float("nan"), scale.to(acc).expand(C)), 0.0)[:, None]
    for v0 in range(0, V, tile):
        v1 = min(V, v0 + tile)
        x = _cap(buf[:, v0:v1].to(acc), softcap)
        g = torch.exp(x - lse[:, None]) * coef
        # minus one at each row's label in this tile, as a scatter (adding -0.0 elsewhere
        # changes nothing): a boolean-mask index would cost a host sync per tile
        hit = valid & (safe >= v0) & (safe < v1)
        g.scatter_add_(1, (safe - v0).clamp(0, v1 - v0 - 1)[:, None], -hit.to(acc)[:, None])
        if softcap is not None:
            g = g * (1.0 - (x / softcap) ** 2)
        buf[:, v0:v1] = g * rs


def _ce_rows(impl: str):
    return ce_rows_triton if impl == "triton" else ce_rows_torch


def _add_outer(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, accumulating in acc's dtype."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda and acc.dtype == torch.float32 and a.dtype in (torch.bfloat16, torch.float16):
        # cuBLAS reads bf16, accumulates and adds in float32: no float32 copy of the chunk
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _chunk_loop(h, w, labels, scale, opts, need_dh: bool, need_dw: bool):
    """The fused pass over all token chunks: per-row losses, and dH / dW when asked for."""
    N, d = h.shape
    V = w.shape[0]
    C = min(N, opts.chunk) if N else 1
    write_grad = need_dh or need_dw
    ce_rows = _ce_rows(opts.impl)
    loss_rows = torch.empty(N, dtype=acc_dtype(h), device=h.device)
    dh = torch.empty_like(h) if need_dh else None
    dw_acc = None
    if need_dw:
        dw_dtype = opts.accum_dtype or (torch.float32 if w.dtype in (torch.float16, torch.bfloat16) else w.dtype)
        dw_acc = torch.zeros(V, d, dtype=dw_dtype, device=w.device)
    ws = buf = hc = torch.empty(C, V, dtype=h.dtype, device=h.device)
    wt = w.t()
    for c0 in range(0, N, C):
        c1 = min(N, c0 + C)
        hc, buf = h[c0:c1], ws[:c1 - c0]
        torch.mm(hc, wt, out=buf)
        ce_rows(buf, labels[c0:c1], loss_rows[c0:c1], scale if scale.numel() == 1 else scale[c0:c1],
                ignore_index=opts.ignore_index, softcap=opts.softcap, z_loss=opts.z_loss, write_grad=write_grad)
        if need_dh:
            torch.mm(buf, w, out=dh[c0:c1])
        if need_dw:
            _add_outer(dw_acc, buf.t(), hc)
    # every view of the workspace, so that it is gone before dW is converted
    del ws, buf, hc
    dw = None
    if need_dw:
        dw = dw_acc if dw_acc.dtype == w.dtype else dw_acc.to(w.dtype)
        del dw_acc
    return loss_rows, dh, dw


@dataclass
class _Opts:
    ignore_index: int
    reduction: str
    softcap: float | None
    z_loss: float
    group: object
    total_tokens: object
    chunk: int
    accum_dtype: torch.dtype | None
    impl: str
    check_labels: bool


def _count_and_check(labels, V, opts, need_count: bool):
    """Number of counted tokens (over the group when given) as a 0-dim int64 device tensor, or
    None when neither it nor the label check is wanted.  With ``opts.check_labels``, raises
    ValueError on every rank when any rank has a label outside [0, V) that is not ignore_index:
    the one host sync of the forward (without the check, no sync: such labels make their loss
    and gradient NaN, see ce_rows_torch and the Triton kernel)."""
    if not (need_count or opts.check_labels):
        return None
    valid = labels != opts.ignore_index
    bad = (valid & ((labels < 0) | (labels >= V))).sum()
    counts = torch.stack([valid.sum(), bad])
    if opts.group is not None and dist.get_world_size(opts.group) > 1:
        # one collective carries both, so a bad label on one rank stops every rank here
        dist.all_reduce(counts, group=opts.group)
    if opts.check_labels:
        nbad = int(counts[1])
        if nbad:
            raise ValueError(f"{nbad} label(s) outside [0, {V}) that are not ignore_index={opts.ignore_index}"
                             + (" (summed over the group)" if opts.group is not None else ""))
    return counts[0]


class _FusedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, labels, opts: _Opts):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        counted = opts.reduction == "mean" and opts.total_tokens is None
        n = _count_and_check(labels, w.shape[0], opts, counted)
        grouped = opts.group is not None and dist.get_world_size(opts.group) > 1
        acc = acc_dtype(h)
        if opts.reduction == "none":
            one = torch.ones(1, dtype=acc, device=h.device)
            loss_rows, _, _ = _chunk_loop(h, w, labels, one, opts, False, False)
            ctx.save_for_backward(h, w, labels)
            ctx.opts = opts
            return loss_rows
        # gradients are finished here, so they need the normaliser now; an empty mean gets a
        # NaN loss (as F.cross_entropy) but zero gradients
        if counted:
            # the count stays on the device (no sync); 1 / n formed in float64 as Python would
            denom = n.to(acc)
            scale = torch.where(n > 0, 1.0 / n.double(), 0.0).to(acc).reshape(1)
        else:
            denom = float(opts.total_tokens) if opts.reduction == "mean" else 1.0
            scale = torch.full((1,), 1.0 / denom if denom > 0 else 0.0, dtype=acc, device=h.device)
        loss_rows, dh, dw = _chunk_loop(h, w, labels, scale, opts, need_dh, need_dw)
        total = loss_rows.sum()
        if grouped:
            dist.all_reduce(total, group=opts.group)
        # an empty count: total is 0 (no row counted on any rank), so total / 0 is the NaN
        loss = total / denom if counted or denom > 0 else total * float("nan")
        ctx.save_for_backward(dh, dw)
        ctx.anchors = (h, w)  # ties the gradients to the inputs, for the double-backward refusal
        ctx.opts = opts
        ctx.used = False
        return loss

    @staticmethod
    @once_differentiable("fused_linear_cross_entropy")
    def backward(ctx, g):
        opts = ctx.opts
        if opts.reduction == "none":
            h, w, labels = ctx.saved_tensors
            need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            _, dh, dw = _chunk_loop(h, w, labels, g.reshape(-1).to(acc_dtype(h)).contiguous(), opts, need_dh, need_dw)
            return dh, dw, None, None
        if ctx.used:
            raise RuntimeError("fused_linear_cross_entropy finishes its gradients in the forward and scales them in "
                               "place in the backward: it cannot be backpropagated through twice (retain_graph)")
        ctx.used = True
        dh, dw = ctx.saved_tensors
        # the gradients were made for an upstream gradient of 1: scale them in place, always
        # (exact when g is 1): asking whether g is 1 would be a host sync in the middle of the
        # backward, and a trainer's g (1 / its token count) is not 1 anyway
        if dh is not None:
            dh.mul_(g)
        if dw is not None:
            dw.mul_(g)
        return dh, dw, None, None


def _pick_impl(impl, device, dtype) -> str:
    impl = impl or ce_impl_from_env() or "auto"
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
    usable = triton_available() and (device.type == "cuda" or interpret_mode())
    if impl == "auto":
        return "triton" if usable and device.type == "cuda" and dtype != torch.float64 else "torch"
    if impl == "triton" and not usable:
        raise ValueError("impl='triton' needs the triton package and a CUDA device (or TRITON_INTERPRET=1 on CPU)")
    if impl == "triton" and dtype == torch.float64:
        raise ValueError("impl='triton' takes float16/bfloat16/float32 inputs; use impl='torch' for float64")
    return impl


def _check(hidden, weight, labels, ignore_index, reduction, softcap, z_loss, group, total_tokens, chunk_size,
           accum_dtype):
    for name, t in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() < 1 or hidden.dtype not in _FLOATS:
        raise ValueError(f"hidden must be a (..., hidden_dim) float16/bfloat16/float32/float64 tensor, "
                         f"got shape {tuple(hidden.shape)} {hidden.dtype}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (vocab, hidden_dim={hidden.shape[-1]}), got {tuple(weight.shape)}")
    if weight.shape[0] < 1:
        raise ValueError("weight has an empty vocabulary")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"hidden and weight dtypes differ: {hidden.dtype} vs {weight.dtype}")
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels shape {tuple(labels.shape)} must be hidden's without the last dim, "
                         f"{tuple(hidden.shape[:-1])}")
    if not (hidden.device == weight.device == labels.device):
        raise ValueError(f"hidden, weight, labels are on different devices: {hidden.device}, {weight.device}, "
                         f"{labels.device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"unknown reduction {reduction!r}; expected one of {REDUCTIONS}")
    if not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    if softcap is not None and not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be None or a positive finite number, got {softcap!r}")
    if not (isinstance(z_loss, (int, float)) and math.isfinite(z_loss) and z_loss >= 0):
        raise ValueError(f"z_loss must be a non-negative finite number, got {z_loss!r}")
    if total_tokens is not None:
        if reduction != "mean":
            raise ValueError(f"total_tokens is the normaliser of reduction='mean', not of {reduction!r}")
        if isinstance(total_tokens, torch.Tensor):
            total_tokens = total_tokens.item()  # a sync, once per call: pass a number to avoid it
        if not (isinstance(total_tokens, (int, float)) and math.isfinite(total_tokens) and total_tokens > 0):
            raise ValueError(f"total_tokens must be a positive number, got {total_tokens!r}")
    if chunk_size is not None and not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if accum_dtype is not None and accum_dtype not in _FLOATS:
        raise ValueError(f"accum_dtype must be a float dtype, got {accum_dtype!r}")
    if group is not None:
        if reduction == "none":
            raise ValueError("group applies to reduction='mean' or 'sum'; reduction='none' returns per-token losses")
        backend = group_info(group)[2] or ""
        if "nccl" in backend and hidden.device.type != "cuda":
            raise ValueError(f"the group uses NCCL but the tensors are on {hidden.device}")
        if backend == "gloo" and hidden.device.type != "cpu":
            raise ValueError(f"the group uses gloo but the tensors are on {hidden.device}")
    return total_tokens


def _auto_chunk(V: int, elem: int, device: torch.device) -> int:
    budget = _CUDA_WORKSPACE if device.type == "cuda" else _CPU_WORKSPACE
    c = max(1, budget // (V * elem))
    return c - c % 256 if c >= 512 else c


def fused_linear_cross_entropy(hidden, weight, labels, *, ignore_index=-100, reduction="mean", softcap=None,
                               z_loss=0.0, group=None, total_tokens=None, chunk_size=None, accum_dtype=None,
                               impl=None, check_labels=True):
    """Cross-entropy of ``hidden @ weight.T`` against ``labels`` without materialising the logits.

    Equals ``F.cross_entropy((hidden @ weight.T).flatten(0, -2), labels.flatten(), ...)`` plus
    the optional softcap and z-loss, with the gradients of ``hidden`` and ``weight`` computed in
    the forward pass (BurstEngine Algorithm 3).

    hidden: (..., hidden_dim); weight: (vocab, hidden_dim), same dtype; labels: integer, shape
    ``hidden.shape[:-1]``, already shifted for next-token prediction.  Labels equal to
    ``ignore_index`` count neither in the loss nor in the mean.

    reduction: 'mean' (over counted tokens), 'sum', or 'none' (float32 per-token losses of
    ``labels``' shape; this one recomputes the logits in the backward).  The loss is float32
    (float64 for float64 inputs).
    softcap: logits become ``softcap * tanh(logits / softcap)`` before the softmax (Gemma 2).
    z_loss: adds ``z_loss * lse**2`` per counted token (PaLM), averaged like the loss.

    Context parallelism: each rank passes its own tokens (any layout).  With ``group`` (the
    context-parallel group; None means this rank's tokens alone, no collective, so pass
    ``dist.group.WORLD`` to mean the default group) the token count and the loss are summed over
    the group, so every rank returns the global mean (or
    sum), and the gradients of this rank's ``hidden`` are exact; this rank's ``weight`` gradient
    is its tokens' share, to be summed over the group like any data-parallel gradient.
    ``total_tokens`` sets the mean's denominator instead of counting (no collective for it),
    e.g. the global token count of several micro-batches.

    chunk_size: tokens per chunk (default: a 1 GiB logits workspace on CUDA); accum_dtype:
    dtype of the weight-gradient accumulator (default float32 for 16-bit weights: bfloat16
    halves that buffer at the cost of one rounding per chunk).  impl: 'triton' (CUDA, or CPU
    under TRITON_INTERPRET=1), 'torch', or 'auto' (env BURST_CE_IMPL, else triton on CUDA).

    check_labels: raise ValueError (on every rank of ``group``) for a label outside [0, vocab)
    that is not ``ignore_index``.  It is the one host sync of a call; with ``check_labels=False``
    there is none (a training step's hot path: loss/model_loss.py), and such a label makes its
    token's loss and gradients NaN instead of reading out of bounds.  The token count of a
    mean stays on the device; a tensor ``total_tokens`` is read once (pass a number to avoid it).
    The backward scales the saved gradients in place, so a graph through this loss can be
    backpropagated once (no ``retain_graph`` reuse).
    """
    total_tokens = _check(hidden, weight, labels, ignore_index, reduction, softcap, z_loss, group, total_tokens,
                          chunk_size, accum_dtype)
    impl = _pick_impl(impl, hidden.device, hidden.dtype)
    d = hidden.shape[-1]
    h = hidden.reshape(-1, d)
    if not h.is_contiguous():
        h = h.contiguous()
    y = labels.reshape(-1).contiguous()
    w = weight if weight.is_contiguous() else weight.contiguous()
    opts = _Opts(ignore_index=ignore_index, reduction=reduction, softcap=None if softcap is None else float(softcap),
                 z_loss=float(z_loss), group=group, total_tokens=total_tokens,
                 chunk=chunk_size or _auto_chunk(w.shape[0], w.element_size(), w.device),
                 accum_dtype=accum_dtype, impl=impl, check_labels=bool(check_labels))
    loss = _FusedLinearCE.apply(h, w, y, opts)
    return loss.view(labels.shape) if reduction == "none" else loss
