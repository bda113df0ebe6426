"""``Fp8Kernel`` ("fp8"): the attention forward in float8 e4m3 for prefill, off unless asked for
(``kernel="fp8"``, ``--kernel fp8``).  Forward only: there is no FP8 backward, so training refuses it.

Q, K and V are quantized per call with one scale per block of ``block`` rows (128) and head: the
block's largest magnitude maps to e4m3's largest finite value (448).  QKᵀ and PV both run as FP8
matrix products accumulating in float32; P is rounded to e4m3 too, after being multiplied by
256 × (V's block scale / the head's largest V block scale), which keeps it inside e4m3's range
(at most 256) and its small probabilities out of the subnormals, and folds V's per-block scale
into the product at no cost per element.  The running (O, lse) of a ring step stays float32, as
with every kernel, so the merge across ring steps is exact; only the block products are FP8.

On CUDA (compute capability 8.9 or newer, with Triton) and under Triton's interpreter the Triton
forward runs it (kernels/triton/fwd.py with ``FP8``); elsewhere :func:`emulate` computes the same
quantization in torch (P rounded against each row's final maximum rather than the running one),
so the CPU tests and a CPU run see FP8's error, not bf16's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..masks import visible_mask
from .base import Kernel, merge_
from .triton.kernel import Tiles, TritonKernel

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
P_SCALE = 256.0  # P <= 1 is stored times this (a power of two: exact) at most
V_FLOOR = 2.0 ** -24  # a V block's scale is at least this times its head's largest: exponent offsets >= -16
_TINY = 2.0 ** -100  # the scale of an all-zero block (anything positive: its values quantize to 0)
_CHUNK = 1 << 26  # elements per float32 temporary while quantizing

# Launch shape of the FP8 forward per head dim, plain and onto a running state (the ring step): 64 q
# rows x 128 keys on 4 warps, the fastest of five shapes at 32K tokens on one H100 (32 q / 8 kv heads,
# d=128: 11.4 / 22.1 ms causal / full against 13.5 / 25.7 for 128x128 on 8 warps; the "sweep" of
# benchmarks/results/fp8_h100.json).
TILES = {64: Tiles(64, 128, 4, 3, tma=True), 128: Tiles(64, 128, 4, 3, tma=True)}

_TRITON = TritonKernel()  # where Triton runs (its ``available``)

FORWARD_ONLY = ("kernel 'fp8' computes the attention forward only (prefill and generation); training needs a "
                "kernel with a backward ('auto', 'cudnn', 'triton')")


@dataclass
class Fp8Blocks:
    """Quantized q, k, v of one call and their scales: ``q8`` (B, Sq, H, D) and ``k8`` (B, Sk, Hkv, D)
    in e4m3 with ``qs`` (B, H, q blocks) and ``ks`` (B, Hkv, k blocks) float32; ``vt8`` V transposed,
    (B, Hkv * D, columns) with the keys zero-padded to a multiple of 128 and of ``block``; ``voff`` (B, Hkv, k blocks)
    log2(256 * block scale / head's largest) and ``vu`` (B, Hkv) the head's largest scale / 256."""

    q8: torch.Tensor
    qs: torch.Tensor
    k8: torch.Tensor
    ks: torch.Tensor
    vt8: torch.Tensor
    voff: torch.Tensor
    vu: torch.Tensor
    block: int


def _in_triton(x: torch.Tensor) -> bool:
    """Whether x's quantization runs in kernels/triton/quant.py (CUDA with Triton, or Triton's
    interpreter on CPU): heads side by side in contiguous rows, a power-of-two head dim."""
    D = x.shape[-1]
    return (x.dtype in (torch.bfloat16, torch.float16, torch.float32) and 16 <= D <= 256 and D & (D - 1) == 0
            and x.stride(-1) == 1 and x.stride(-2) == D and _TRITON.available(x.device))


def block_scales(x: torch.Tensor, block: int) -> torch.Tensor:
    """float32 (B, blocks, H): each block of ``block`` rows and head, its largest magnitude / 448."""
    B, S, H, D = x.shape
    nb = -(-S // block)
    if _in_triton(x):
        from .triton.quant import amax_kernel  # imports triton: only when a kernel runs

        amax = torch.empty(B, nb, H, device=x.device, dtype=torch.float32)
        amax_kernel[(nb, B * H)](x, amax, x.stride(0), x.stride(1), S, H, nb, HEAD_DIM=D, BLOCK=block, num_warps=4)
    else:
        amax = x.abs().amax(-1)
        amax = torch.nn.functional.pad(amax, (0, 0, 0, nb * block - S)).view(B, nb, block, H).amax(2).float()
    return amax.clamp_min(_TINY) / E4M3_MAX


def cast_blocks(x: torch.Tensor, scale: torch.Tensor, block: int, vt: torch.Tensor | None = None) -> torch.Tensor:
    """x (B, S, H, D) divided by its block's ``scale`` (B, blocks, H) and rounded to e4m3 (nearest,
    saturating); with ``vt`` written transposed into it, (B, H * D, columns >= S), and returned.  In
    torch a chunk of rows at a time, so the float32 temporary stays small."""
    B, S, H, D = x.shape
    if _in_triton(x):
        from .triton.quant import cast_kernel  # imports triton: only when a kernel runs

        out = torch.empty(x.shape, dtype=E4M3, device=x.device) if vt is None else vt
        cast_kernel[(-(-S // block), B * H)](x, scale, out, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
                                             S, H, scale.shape[1], HEAD_DIM=D, BLOCK=block, TRANS=vt is not None,
                                             num_warps=4)
        return out
    out = torch.empty(x.shape, dtype=E4M3, device=x.device)
    rows = max(block, _CHUNK // max(1, B * H * D) // block * block)
    inv = 1.0 / scale
    for r0 in range(0, S, rows):
        r1 = min(S, r0 + rows)
        f = inv[:, r0 // block:-(-r1 // block)].repeat_interleave(block, 1)[:, :r1 - r0]
        out[:, r0:r1] = (x[:, r0:r1].float() * f[..., None]).clamp_(-E4M3_MAX, E4M3_MAX)
    if vt is None:
        return out
    vt[:, :, :S] = out.view(B, S, H * D).transpose(1, 2)
    return vt


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: int = 128) -> Fp8Blocks:
    """The e4m3 operands of one call (see :class:`Fp8Blocks`)."""
    qs = block_scales(q, block)
    ks = block_scales(k, block)
    vs = block_scales(v, block)
    vmax = vs.amax(1, keepdim=True)
    # the Triton forward divides the running O by vu = vmax / 256: an all-zero V head (scale 2^-100 / 448)
    # made that overflow for |O| above ~2^11.  A floor of 2^-60 keeps it finite for any bf16 O; a head
    # whose V lies below ~2^-80 everywhere then rounds to 0 (a contribution no bf16 output can hold)
    vmax = vmax.clamp_min(2.0 ** -60)
    vs = torch.maximum(vs, vmax * V_FLOOR)
    B, Sk, Hkv, D = v.shape
    # the Triton forward reads V^T in tiles of up to ``block`` keys without a column bound: pad past them
    pad = max(128, block)
    cols = -(-Sk // pad) * pad
    vt8 = cast_blocks(v, vs, block, vt=torch.zeros(B, Hkv * D, cols, dtype=E4M3, device=v.device))
    voff = torch.log2(P_SCALE * vs / vmax)
    return Fp8Blocks(q8=cast_blocks(q, qs, block), qs=qs.transpose(1, 2).contiguous(), k8=cast_blocks(k, ks, block),
                     ks=ks.transpose(1, 2).contiguous(), vt8=vt8, voff=voff.transpose(1, 2).contiguous(),
                     vu=(vmax[:, 0] / P_SCALE).contiguous(), block=block)


def _rows(scale_bh: torch.Tensor, n: int, block: int) -> torch.Tensor:
    """(B, H, blocks) -> (B, H, n): each row's block value."""
    return scale_bh.repeat_interleave(block, -1)[..., :n]


def emulate(fp: Fp8Blocks, scale: float, mask, Sq: int, Sk: int):
    """The FP8 forward in torch (float32): e4m3 operands, P rounded to e4m3 as the kernel rounds it
    (against each row's final maximum).  -> (out float32 (B, Sq, H, D), lse float32 (B, H, Sq))."""
    B, _, H, D = fp.q8.shape
    Hkv = fp.k8.shape[2]
    g = H // Hkv
    bl = fp.block
    q = fp.q8.float().transpose(1, 2) * _rows(fp.qs, Sq, bl)[..., None]  # (B, H, Sq, D)
    k = (fp.k8.float().transpose(1, 2) * _rows(fp.ks, Sk, bl)[..., None]).repeat_interleave(g, 1)
    v8 = fp.vt8[:, :, :Sk].float().view(B, Hkv, D, Sk).transpose(-1, -2).repeat_interleave(g, 1)
    r = torch.exp2(_rows(fp.voff, Sk, bl)).repeat_interleave(g, 1)[:, :, None, :]  # (B, H, 1, Sk)
    u = fp.vu.repeat_interleave(g, 1)[:, :, None, None]
    vis = visible_mask(mask, Sq, Sk, q.device)
    out = torch.zeros(B, H, Sq, D, device=q.device)
    lse = torch.full((B, H, Sq), float("-inf"), device=q.device)
    step = max(1, min(Sq, (1 << 24) // max(1, B * H * Sk)))
    for r0 in range(0, Sq, step):
        r1 = min(Sq, r0 + step)
        s = torch.matmul(q[:, :, r0:r1], k.transpose(-1, -2)) * scale
        if vis is not None:
            s = s.masked_fill(~vis[r0:r1], float("-inf"))
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), 0.0, m)
        p = torch.exp(s - m)
        l = p.sum(-1, keepdim=True)
        p8 = (p * r).to(E4M3).float()
        seen = l > 0
        out[:, :, r0:r1] = torch.where(seen, torch.matmul(p8, v8) * u / torch.where(seen, l, 1.0), 0.0)
        lse[:, :, r0:r1] = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), float("-inf"))[..., 0]
    return out.transpose(1, 2), lse


class Fp8Kernel(Kernel):
    """Forward in e4m3 (module docstring); ``block``: rows per quantization scale, a multiple of
    the tiles' rows."""

    name = "fp8"
    forward_only = FORWARD_ONLY

    def __init__(self, block: int = 128, tiles: dict[int, Tiles] | None = None):
        self.block = block
        self.tiles = dict(TILES if tiles is None else tiles)
        self._triton = _TRITON

    def available(self, device) -> bool:
        device = torch.device(device)
        if device.type != "cuda":
            return True  # the torch emulation (or Triton's interpreter)
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9) and \
            self._triton.available(device)

    def runs_triton(self, q, k, v, mask, *more) -> bool:
        """Whether this call runs the Triton FP8 forward (else the torch emulation)."""
        D = q.shape[-1]
        if D not in self.tiles or not self._triton.supports(q, k, v, mask, *more):
            return False
        t = self.tiles[D]
        return self.block % t.block_m == 0 and self.block % t.block_n == 0 and \
            (q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) >= (8, 9))

    def quantize(self, q, k, v) -> Fp8Blocks:
        return quantize(q, k, v, self.block)

    def forward(self, q, k, v, scale, mask):
        B, Sq, H, D = q.shape
        if k.shape[1] == 0 or Sq == 0:
            return q.new_zeros(q.shape), torch.full((B, H, Sq), float("-inf"), device=q.device)
        fp = self.quantize(q, k, v)
        if not self.runs_triton(q, k, v, mask):
            o, lse = emulate(fp, scale, mask, Sq, k.shape[1])
            return o.to(q.dtype), lse
        out = torch.empty_like(q)
        lse = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)
        self._triton.launch_forward(fp.q8, fp.k8, fp.vt8, scale, mask, out, lse, True, self.tiles[D], fp)
        return out, lse

    def forward_into(self, q, k, v, scale, mask, out, lse) -> None:
        if q.shape[1] == 0 or k.shape[1] == 0:
            return
        fp = self.quantize(q, k, v)
        if not self.runs_triton(q, k, v, mask, out):
            o, l = emulate(fp, scale, mask, q.shape[1], k.shape[1])
            merge_(out, lse, o, l)
            return
        self._triton.launch_forward(fp.q8, fp.k8, fp.vt8, scale, mask, out, lse, False, self.tiles[q.shape[-1]], fp)

    def backward(self, *args, **kw):
        raise ValueError(FORWARD_ONLY)

    def backward_into(self, *args, **kw):
        raise ValueError(FORWARD_ONLY)


__all__ = ["E4M3", "Fp8Blocks", "Fp8Kernel", "FORWARD_ONLY", "emulate", "quantize"]
