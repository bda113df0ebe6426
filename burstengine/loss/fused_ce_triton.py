"""Triton kernel for the cross-entropy step of the fused LM head + loss (see fused_ce.py).

One program per token row of a chunk of logits: a first sweep over the vocabulary in tiles
of BLOCK_V keeps a running (max, sum of exp) and gives the row's lse, its loss and z-loss; a
second sweep overwrites the logits in place with the gradient of the (scaled) loss with
respect to them.  The logits tile never leaves registers between the exp and the store, and
no other C x V buffer is touched, so the step costs two reads and one write of the chunk.

The kernel is built on first use rather than at import, so that TRITON_INTERPRET=1 set by a
test (CPU, no GPU) before the first call still selects Triton's interpreter.
"""
from __future__ import annotations

import functools

import torch


def interpret_mode() -> bool:
    """Triton's own interpreter switch (TRITON_INTERPRET), read through Triton's knobs; call
    only where Triton is installed."""
    import triton  # optional heavy dependency: imported only when the Triton path is asked about

    return bool(triton.knobs.runtime.interpret)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401  (optional dependency: the torch path runs without it)
    except Exception:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _build(interpret: bool):
    # interpret is part of the cache key: triton.jit decides between the compiler and the
    # interpreter when it decorates, from TRITON_INTERPRET at that moment
    import triton  # optional heavy dependency: imported when the kernel is first built
    import triton.language as tl  # optional heavy dependency: as above

    @triton.jit
    def ce_rows_kernel(logits_ptr, row_stride, labels_ptr, loss_ptr, scale_ptr, scale_stride, ignore_index,
                       cap, z_coef, V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, WRITE_GRAD: tl.constexpr,
                       BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        label = tl.load(labels_ptr + row).to(tl.int64)
        valid = label != ignore_index
        # a label outside [0, V) (only when the caller skipped the check) reads column 0 and
        # makes the row's loss and gradient NaN
        bad = valid & ((label < 0) | (label >= V))
        cols = tl.arange(0, BLOCK_V)

        # sweep 1: running max / sum of exp over vocabulary tiles (online softmax)
        m = tl.full((), -float("inf"), tl.float32)
        s = tl.full((), 0.0, tl.float32)
        for v0 in range(0, V, BLOCK_V):
            inb = v0 + cols < V
            x = tl.load(base + v0 + cols, mask=inb, other=0.0).to(tl.float32)
            if HAS_SOFTCAP:
                # cap * tanh(x / cap), with tanh(y) = 1 - 2 / (exp(2y) + 1): saturates cleanly at +-1
                x = cap * (1.0 - 2.0 / (tl.exp(2.0 * x / cap) + 1.0))
            x = tl.where(inb, x, -float("inf"))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
        lse = m + tl.log(s)

        safe = tl.where(valid & ~bad, label, 0)
        xt = tl.load(base + safe).to(tl.float32)
        if HAS_SOFTCAP:
            xt = cap * (1.0 - 2.0 / (tl.exp(2.0 * xt / cap) + 1.0))
        loss = lse - xt + z_coef * lse * lse
        tl.store(loss_ptr + row, tl.where(valid, tl.where(bad, float("nan"), loss), 0.0))

        if WRITE_GRAD:
            # d loss / d z_j = p_j (1 + 2 z lse) - [j == label]; times the softcap derivative,
            # times this row's scale (1/tokens for a mean, the upstream grad for 'none')
            rs = tl.where(valid, tl.load(scale_ptr + row * scale_stride).to(tl.float32), 0.0)
            rs = tl.where(bad, float("nan"), rs)
            coef = 1.0 + 2.0 * z_coef * lse
            for v0 in range(0, V, BLOCK_V):
                idx = v0 + cols
                inb = idx < V
                x = tl.load(base + idx, mask=inb, other=0.0).to(tl.float32)
                if HAS_SOFTCAP:
                    t = 1.0 - 2.0 / (tl.exp(2.0 * x / cap) + 1.0)
                    x = cap * t
                g = tl.exp(x - lse) * coef - tl.where(idx == safe, 1.0, 0.0)
                if HAS_SOFTCAP:
                    g = g * (1.0 - t * t)
                tl.store(base + idx, (g * rs).to(logits_ptr.dtype.element_ty), mask=inb)

    return ce_rows_kernel


def ce_rows_triton(buf, labels, loss_out, scale, *, ignore_index, softcap, z_loss, write_grad):
    """Same contract as fused_ce.ce_rows_torch: per-row loss into ``loss_out`` (float32) and,
    with ``write_grad``, ``buf`` (C, V, row-major) overwritten by scale_i * d loss_i / d logits."""
    import triton  # optional heavy dependency: imported only when this path runs

    C, V = buf.shape
    if C == 0:
        return
    if buf.stride(1) != 1:
        raise ValueError("logits chunk must be row-major")
    kernel = _build(interpret_mode())
    if interpret_mode():
        block_v, warps = min(triton.next_power_of_2(V), 128), 1
    else:
        # 32K columns per tile over 32 warps (32 elements per thread per sweep), as Liger's CE
        # kernel: few programs per SM, so the rows being swept (about 132 x 256 KB at V = 128K)
        # can stay in the 50-60 MB L2 between the two sweeps (not measured on its own)
        block_v = min(triton.next_power_of_2(V), 32768)
        warps = 32 if block_v >= 16384 else (16 if block_v >= 4096 else 4)
    scale = scale.to(torch.float32)
    scale_stride = 0 if scale.numel() == 1 else scale.stride(0)
    # V is a compile-time constant: one build per vocabulary size, and loops over it that
    # Triton's interpreter can run (it cannot take range() of a runtime scalar with numpy 2)
    kernel[(C,)](buf, buf.stride(0), labels, loss_out, scale, scale_stride, ignore_index,
                 float(softcap) if softcap is not None else 1.0, float(z_loss), V=V,
                 HAS_SOFTCAP=softcap is not None, WRITE_GRAD=bool(write_grad), BLOCK_V=block_v, num_warps=warps)
