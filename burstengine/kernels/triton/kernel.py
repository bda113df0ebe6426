"""``TritonKernel``: our LAO kernels (fwd.py, bwd.py here) behind the Kernel interface.

``forward_into`` merges a block into the running (O, lse) inside the kernel and
``backward_into`` adds into the caller's dQ/dK/dV from the global lse and D; the plain
``forward``/``backward`` start from an empty state.  Every mask kind and any MaskSpec
(positions, windows, documents, block masks) is computed in the kernel, and tiles that see
nothing are skipped unloaded.  On Hopper, full/causal/strict blocks with lengths multiples of
128 run the Gluon kernels instead (kernels/gluon: fwd.py at d 64, 128 and 256; bwd.py at d 64 and
128, bwd_wide.py at 256), unless the kernel was made with ``gluon=False`` (attention/planning.py does so for
BURST_GLUON=0).

What the kernels don't take goes to a fallback, so callers never need to check: CPU tensors,
dtypes other than bf16/fp16, head dims other than 64/128 (but the Gluon kernels' 256), inner
dims that are not contiguous (cuDNN for mask kinds on CUDA, the torch reference otherwise).  Triton itself is imported
only when a kernel runs, so the package works without it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from ...masks import CAUSAL, FULL, STRICT, MaskSpec, as_spec, derived
from ..base import Kernel
from ..reference import ReferenceKernel
from ..sdpa import CudnnKernel


@dataclass(frozen=True)
class Tiles:
    """Launch shape of one kernel: tile rows of q (block_m) and k (block_n), warps, pipeline
    stages, TMA descriptor loads (Hopper), automatic warp specialisation of the main loop, and
    a register cap per thread (``maxnreg``: e.g. 128 lets two 8-warp programs share an SM)."""

    block_m: int
    block_n: int
    warps: int
    stages: int
    tma: bool = False
    ws: bool = False
    maxnreg: int | None = None

    def launch(self, has_block: bool = False) -> dict:
        # block-mask programs visit their listed tiles one at a time: nothing to pipeline, and
        # the stages of the two per-tile loops (full, masked) would not fit in shared memory
        kw = dict(num_warps=self.warps, num_stages=1 if has_block else self.stages)
        if self.maxnreg is not None:
            kw["maxnreg"] = self.maxnreg
        return kw


@dataclass(frozen=True)
class TileConfig:
    """Tiles per kernel; ``dq=None`` sends dQ out of the dK/dV kernel with float32 atomics;
    ``fwd_into`` (default ``fwd``): the forward onto a running state (the ring step)."""

    fwd: Tiles
    kv: Tiles
    dq: Tiles | None = None
    fwd_into: Tiles | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_dict(d: dict) -> "TileConfig":
        opt = {n: Tiles(**d[n]) if d.get(n) else None for n in ("dq", "fwd_into")}
        return TileConfig(fwd=Tiles(**d["fwd"]), kv=Tiles(**d["kv"]), **opt)


# Chosen per head dim by the tile sweep of burstengine bench lao-bench (H200, bf16, 32 heads, full +
# causal at 16K and the best three again at 64K; benchmarks/results/lao_bench.json, "sweep").
# d=128: forward 128x128 tiles, 8 warps (512/471 TFLOP/s at 16K, 506/487 at 64K; 64x64 gets
# 517/448 and 457/485); the forward onto a running state (ring step, float32 O) keeps 64x64
# tiles, 4 warps, two programs per SM (0.75-1.16x cuDNN + merge, against 0.71-1.06x for
# 128x128); dK/dV 64x128/8 warps/3 stages and the separate dQ kernel 128x64 (dQ by TMA
# reduce-add from the dK/dV program spilled and ran at 252-319).
CONFIGS = {
    64: TileConfig(fwd=Tiles(64, 64, 4, 3, tma=True), kv=Tiles(64, 64, 4, 2, tma=True), dq=Tiles(64, 64, 4, 2, tma=True)),
    128: TileConfig(fwd=Tiles(128, 128, 8, 3, tma=True), kv=Tiles(64, 128, 8, 3, tma=True),
                dq=Tiles(128, 64, 8, 3, tma=True), fwd_into=Tiles(64, 64, 4, 3, tma=True)),
}

_POS_LIMIT = 1 << 29


def _interpreting() -> bool:
    """Triton's own interpreter switch (TRITON_INTERPRET), read through Triton's knobs; call
    only where Triton is imported."""
    import triton  # optional heavy dependency: imported only where a kernel may run

    return bool(triton.knobs.runtime.interpret)


def _dims(x):
    """(batch, row) strides of a (B, S, H, D) view whose heads lie side by side in a row."""
    return x.stride(0), x.stride(1)


def _tma_ok(*ts) -> bool:
    """TMA needs Hopper (the interpreter emulates it), 16-byte aligned bases and strides, and
    contiguous rows."""
    dev = ts[0].device
    if dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] < 9:
        return False
    return all(t.stride(-1) == 1 and t.data_ptr() % 16 == 0
               and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1]) for t in ts)


def _rows_buffer(B: int, H: int, S: int, device) -> torch.Tensor:
    """An empty float32 (B, H, S) tensor whose rows TMA can read: contiguous, each padded to a
    multiple of 4 (16 bytes)."""
    return torch.empty(B, H, -(-S // 4) * 4, device=device, dtype=torch.float32)[..., :S]


def bwd_rows(lse: torch.Tensor, delta: torch.Tensor):
    """What the backward kernels read per query row: lse in base 2 with +inf where a row saw
    nothing (P = 0 there, not exp(+inf)), and D, both in TMA-readable buffers (D copied only
    when it is not one already).  A few MB at most, once per call."""
    lse2 = _rows_buffer(*lse.shape, lse.device)
    torch.mul(lse, _LOG2E, out=lse2)
    lse2.masked_fill_(lse == float("-inf"), float("inf"))
    if not _tma_ok(delta) or delta.dtype != torch.float32:
        buf = _rows_buffer(*delta.shape, delta.device)
        buf.copy_(delta)
        delta = buf
    return lse2, delta


class TritonKernel(Kernel):
    name = "triton"

    def __init__(self, config: dict[int, TileConfig] | None = None, gluon: bool = True):
        self.config = dict(CONFIGS if config is None else config)
        self.gluon = gluon  # full/causal/strict blocks Gluon takes run there (False: BURST_GLUON=0)
        self._dummy = {}

    # --- what runs here ---------------------------------------------------------------------

    def available(self, device) -> bool:
        device = torch.device(device)
        try:
            import triton  # noqa: F401  (optional dependency: the package works without it)
        except ImportError:
            return False
        if device.type == "cpu":
            return _interpreting()
        return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 8

    def supports(self, q, k, v, mask, *more) -> bool:
        """Whether these tensors and this mask run in the Triton kernels (else: fallback)."""
        D = q.shape[-1]
        if D not in self.config or v.shape[-1] != D or k.shape[-1] != D:
            return False
        if q.dtype not in (torch.bfloat16, torch.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
            return False
        if not self.available(q.device):
            return False
        # the kernels read a batch as one (rows, heads * D) matrix: heads side by side in a row
        if any(t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] for t in (q, k, v, *more)):
            return False
        spec = as_spec(mask)
        if spec.q_step < 1 or spec.k_step < 1:
            return False
        lim = max(abs(spec.q_start) + q.shape[1] * spec.q_step, abs(spec.k_start) + k.shape[1] * spec.k_step)
        return lim < _POS_LIMIT and (spec.window is None or abs(spec.window) < _POS_LIMIT)

    def fallback(self, q, mask) -> Kernel:
        if q.is_cuda and not isinstance(mask, MaskSpec):
            return _CUDNN
        return _REFERENCE

    # --- the interface ----------------------------------------------------------------------

    def forward(self, q, k, v, scale, mask):
        # Gluon first: it takes a head dim (256) the Triton kernels do not
        fast = _gluon_forward(q, k, v, scale, mask, self.gluon)
        if fast is not None:
            return fast
        if not self.supports(q, k, v, mask):
            return self.fallback(q, mask).forward(q, k, v, scale, mask)
        B, Sq, H, D = q.shape
        # the kernel keeps O in float32 registers and stores it in out's dtype: no float32 round
        # trip; it writes every row (fresh: no running state to read)
        out = torch.empty(B, Sq, H, D, device=q.device, dtype=q.dtype)
        lse = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)
        if k.shape[1] == 0:
            out.zero_()
            lse.fill_(float("-inf"))
            return out, lse
        self._forward(q, k, v, scale, mask, out, lse, fresh=True)
        return out, lse

    def forward_into(self, q, k, v, scale, mask, out, lse) -> None:
        if gluon_forward_into(q, k, v, scale, mask, out, lse, gluon=self.gluon):
            return
        if not self.supports(q, k, v, mask, out):
            return self.fallback(q, mask).forward_into(q, k, v, scale, mask, out, lse)
        self._forward(q, k, v, scale, mask, out, lse)

    def backward(self, dout, q, k, v, lse, delta, scale, mask, out=None):
        # dK/dV are summed in registers and stored (every row, fresh: nothing to add to), dQ too
        # unless it is added up across programs (Triton's atomics, Gluon's TMA reduce-add), which
        # needs a zeroed float32 buffer.  dK/dV contiguous, whatever k's strides: the rows the
        # Gluon kernels write, decided here once with them
        empty = q.shape[1] == 0 or k.shape[1] == 0
        dk, dv = ((torch.zeros if empty else torch.empty)(t.shape, dtype=t.dtype, device=t.device) for t in (k, v))
        # Gluon's takes a head dim (256) the Triton kernels do not
        gluon = gluon_bwd_takes(q, k, v, mask, dout, None, dk, dv, gluon=self.gluon)
        if not (gluon or self.supports(q, k, v, mask, dout)):
            return self.fallback(q, mask).backward(dout, q, k, v, lse, delta, scale, mask, out=out)
        summed = gluon or self.config[q.shape[-1]].dq is None
        dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if summed or empty else torch.empty_like(q)
        self._backward(dout, q, k, v, lse, delta, scale, mask, dq, dk, dv, fresh=True)
        return dq.to(q.dtype), dk, dv

    def delta(self, out, dout, dtype=torch.float32):
        """D = rowsum(dO * O) in one kernel (the torch expression writes float32 copies of both),
        into rows the backward's TMA loads can read."""
        B, S, H, D = out.shape
        if (dtype != torch.float32 or dout.shape != out.shape or S == 0 or D & (D - 1) or D > 256
                or not self.available(out.device) or any(t.stride(-1) != 1 or t.stride(-2) != D for t in (out, dout))):
            return super().delta(out, dout, dtype)
        from .bwd import delta_kernel  # imports triton: only when a kernel runs

        dl = _rows_buffer(B, H, S, out.device)
        block = 64
        delta_kernel[(triton_cdiv(S, block), B * H)](out, dout, dl, *_dims(out), *_dims(dout), dl.stride(0),
                                                      dl.stride(1), S, H, HEAD_DIM=D, BLOCK=block, num_warps=4)
        return dl

    def backward_into(self, dout, q, k, v, lse, delta, scale, mask, dq, dk, dv, out=None) -> None:
        if not (self.supports(q, k, v, mask, dout, dq, dk, dv)
                or gluon_bwd_takes(q, k, v, mask, dout, dq, dk, dv, gluon=self.gluon)):
            return self.fallback(q, mask).backward_into(dout, q, k, v, lse, delta, scale, mask, dq, dk, dv, out=out)
        self._backward(dout, q, k, v, lse, delta, scale, mask, dq, dk, dv)

    # --- launches ---------------------------------------------------------------------------

    def _dummy_of(self, device):
        key = str(device)
        if key not in self._dummy:
            self._dummy[key] = torch.zeros(1, dtype=torch.int32, device=device)
        return self._dummy[key]

    def _mask_args(self, spec: MaskSpec, Sq, Sk, tile, walk, q_side: bool, device):
        """Kernel arguments for the mask: (QDOC, KDOC, BOUNDS, BMASK, bs, nbk, CNT, IDX, FULL) and
        the two constexpr flags.  ``tile``/``walk``: rows per tile of the side a program owns and
        of the side it walks; ``q_side``: the program owns q tiles.

        Built once per spec and shape (masks.derived): building copies the spec's CPU document
        ids to the device, which from pageable memory waits for the stream; at every launch that
        left a 3B model's GPU idle 30% of a 64K step with packed documents
        (profile_3b_64k_docmask_true).  Masks without tensors need nothing built."""
        if spec.q_doc is None and spec.block_mask is None:
            return self._build_mask_args(spec, Sq, Sk, tile, walk, q_side, device)
        return derived(spec, ("triton-args", Sq, Sk, tile, walk, q_side, str(device)),
                       lambda: self._build_mask_args(spec, Sq, Sk, tile, walk, q_side, device))

    def _build_mask_args(self, spec: MaskSpec, Sq, Sk, tile, walk, q_side: bool, device):
        from .tiles import doc_bounds, tile_classes, tile_lists  # imports triton: only when a kernel runs

        dummy = self._dummy_of(device)
        has_doc = spec.q_doc is not None
        has_block = spec.block_mask is not None
        qdoc = kdoc = bounds = bmask = cnt = idx = full = dummy
        bs = nbk = 1
        if has_doc:
            qd = spec.q_doc.to(device=device, dtype=torch.int64)
            kd = spec.k_doc.to(device=device, dtype=torch.int64)
            if qd.numel() != Sq or kd.numel() != Sk:
                raise ValueError(f"MaskSpec documents have {qd.numel()} q / {kd.numel()} k rows, block is {Sq} x {Sk}")
            qdoc, kdoc = qd.to(torch.int32), kd.to(torch.int32)
            if not has_block:
                bounds = doc_bounds(qd, kd, tile) if q_side else doc_bounds(kd, qd, tile)
        if has_block:
            bs = spec.block_size
            bm = spec.block_mask
            nbq, nbk = -(-Sq // bs), -(-Sk // bs)
            if bs < 1 or tuple(bm.shape) != (nbq, nbk):
                raise ValueError(f"MaskSpec block_mask {tuple(bm.shape)} with block_size {bs} does not cover {Sq} x {Sk}")
            bmask = bm.to(device=device, dtype=torch.int8).contiguous()
            if q_side:
                any_, all_ = tile_classes(spec, Sq, Sk, tile, walk, device)
            else:
                any_, all_ = tile_classes(spec, Sq, Sk, walk, tile, device)
                any_, all_ = any_.t(), all_.t()
            cnt, idx, full = tile_lists(any_, all_)
        return (qdoc, kdoc, bounds, bmask, bs, nbk, cnt, idx, full), has_doc, has_block

    @staticmethod
    def _positions(spec: MaskSpec):
        from .tiles import bounds_of  # imports triton: only when a kernel runs

        lo, hi = bounds_of(spec)
        # with a lower bound (causal), the last q tiles do the most work
        return (spec.q_start, spec.q_step, spec.k_start, spec.k_step, lo, hi), int(spec.causal)

    def _forward(self, q, k, v, scale, mask, out, lse, fresh=False):
        cfg = self.config[q.shape[-1]]
        self.launch_forward(q, k, v, scale, mask, out, lse, fresh, cfg.fwd if fresh or cfg.fwd_into is None
                            else cfg.fwd_into)

    def launch_forward(self, q, k, v, scale, mask, out, lse, fresh: bool, t: Tiles, fp8=None):
        """fwd_kernel on tiles ``t``; with ``fp8`` (kernels/fp8.Fp8Blocks) q, k are its e4m3 q8, k8
        and v its transposed vt8."""
        from .fwd import fwd_kernel  # imports triton: only when a kernel runs

        B, Sq, H, D = q.shape
        Sk, Hkv = k.shape[1], k.shape[2]
        if Sq == 0 or Sk == 0:
            return
        spec = as_spec(mask)
        margs, has_doc, has_block = self._mask_args(spec, Sq, Sk, t.block_m, t.block_n, True, q.device)
        pos, reverse = self._positions(spec)
        tma = t.tma and _tma_ok(q, k, v, out)
        if fp8 is None:
            dummy = self._dummy_of(q.device)
            scales = (dummy,) * 4 + (1, 1, 1)
        else:
            scales = (fp8.qs, fp8.ks, fp8.voff, fp8.vu, fp8.qs.shape[-1], fp8.ks.shape[-1], v.shape[-1])
        _prepare()
        grid = (triton_cdiv(Sq, t.block_m), B * H)
        fwd_kernel[grid](q, k, v, out, lse, *_dims(q), *_dims(k), *_dims(v), *_dims(out), *lse.stride(),
                         Sq, Sk, H, H // Hkv, scale * _LOG2E, *pos, *margs, reverse, *scales,
                         HEAD_DIM=D, BLOCK_M=t.block_m, BLOCK_N=t.block_n, HAS_DOC=has_doc, HAS_BLOCK=has_block,
                         USE_TMA=tma, WS=t.ws, FRESH=fresh, FP8=fp8 is not None,
                         QB=128 if fp8 is None else fp8.block, **t.launch(has_block))

    def _backward(self, dout, q, k, v, lse, delta, scale, mask, dq, dk, dv, fresh=False):
        """``fresh``: dQ/dK/dV hold nothing yet (the plain backward): stored, not added to."""
        if q.shape[1] == 0 or k.shape[1] == 0:
            return
        gluon = gluon_bwd_takes(q, k, v, mask, dout, dq, dk, dv, gluon=self.gluon)
        if not gluon and q.shape[-1] not in self.config:  # neither Gluon nor Triton: the fallback's, added
            if fresh:
                for t in (dq, dk, dv):
                    t.zero_()
            self.fallback(q, mask).backward_into(dout, q, k, v, lse, delta, scale, mask, dq, dk, dv)
            return
        lse2, delta = bwd_rows(lse, delta)
        if gluon:
            if q.shape[-1] == 256:
                from ..gluon.bwd_wide import backward_into  # Gluon: only on Hopper, when it runs; at its head dim
            else:
                from ..gluon.bwd import backward_into  # imports triton's Gluon: only on Hopper, when it runs
            backward_into(dout, q, k, v, lse2, delta, scale, _MASK_LO[mask], dq, dk, dv, fresh)
            return
        cfg = self.config[q.shape[-1]]
        atomic = cfg.dq is None and dq.dtype == torch.float32
        self._launch_kv(cfg.kv, atomic, dout, q, k, v, lse2, delta, scale, mask, dq, dk, dv, fresh)
        if not atomic:
            self._launch_dq(cfg.dq or cfg.fwd, dout, q, k, v, lse2, delta, scale, mask, dq, fresh)

    def _launch_kv(self, t: Tiles, atomic, dout, q, k, v, lse2, delta, scale, mask, dq, dk, dv, fresh=False):
        """dK, dV (and dQ by atomics when ``atomic``): one program per (k tile, batch x kv head);
        ``lse2``, ``delta`` from :func:`bwd_rows`."""
        from .bwd import kv_kernel  # imports triton: only when a kernel runs

        B, Sq, H, D = q.shape
        Sk, Hkv = k.shape[1], k.shape[2]
        spec = as_spec(mask)
        pos, _ = self._positions(spec)
        margs, has_doc, has_block = self._mask_args(spec, Sq, Sk, t.block_n, t.block_m, False, q.device)
        tma = t.tma and _tma_ok(q, k, v, dout, dq, dk, dv)
        _prepare()
        grid = (triton_cdiv(Sk, t.block_n), B * Hkv)
        kv_kernel[grid](q, k, v, dout, lse2, delta, dq, dk, dv,
                        *_dims(q), *_dims(k), *_dims(v), *_dims(dout), *lse2.stride(), *delta.stride(),
                        *_dims(dq), *_dims(dk), *_dims(dv),
                        Sq, Sk, Hkv, H // Hkv, scale * _LOG2E, scale, *pos, *margs,
                        HEAD_DIM=D, BLOCK_M=t.block_m, BLOCK_N=t.block_n, HAS_DOC=has_doc, HAS_BLOCK=has_block,
                        USE_TMA=tma, ATOMIC_DQ=atomic, WS=t.ws, VEC_TMA=tma and _tma_ok(lse2, delta),
                        FRESH=fresh, **t.launch(has_block))

    def _launch_dq(self, t: Tiles, dout, q, k, v, lse2, delta, scale, mask, dq, fresh=False):
        """dQ without atomics: one program per (q tile, batch x q head), P and dP recomputed."""
        from .bwd import dq_kernel  # imports triton: only when a kernel runs

        B, Sq, H, D = q.shape
        Sk, Hkv = k.shape[1], k.shape[2]
        spec = as_spec(mask)
        pos, reverse = self._positions(spec)
        margs, has_doc, has_block = self._mask_args(spec, Sq, Sk, t.block_m, t.block_n, True, q.device)
        tma = t.tma and _tma_ok(q, k, v, dout, dq)
        _prepare()
        grid = (triton_cdiv(Sq, t.block_m), B * H)
        dq_kernel[grid](q, k, v, dout, lse2, delta, dq,
                        *_dims(q), *_dims(k), *_dims(v), *_dims(dout), *lse2.stride(), *delta.stride(), *_dims(dq),
                        Sq, Sk, H, H // Hkv, scale * _LOG2E, scale, *pos, *margs, reverse,
                        HEAD_DIM=D, BLOCK_M=t.block_m, BLOCK_N=t.block_n, HAS_DOC=has_doc, HAS_BLOCK=has_block,
                        USE_TMA=tma, WS=t.ws, FRESH=fresh, **t.launch(has_block))


_LOG2E = math.log2(math.e)
_CUDNN = CudnnKernel()
_REFERENCE = ReferenceKernel()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _prepare(tma: bool = True) -> None:
    """Device-side TMA descriptors live in a scratch buffer that Triton asks its allocator for.
    Set it before every launch, TMA or not: Triton keeps the allocator in a context variable,
    so one set in the main thread is not seen by autograd's backward thread (seen on H200: the
    dK/dV launch of the sparse benchmark's backward failed without it), and a kernel compiled
    without TMA loads can still ask for scratch."""
    if not _interpreting():
        import triton  # optional heavy dependency: only when a kernel runs

        triton.set_allocator(_scratch)


def _scratch(size: int, align: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def gluon_takes(q, k, v, mask=FULL, *state, gluon: bool = True) -> bool:
    """Whether this full/causal/strict block runs in kernels/gluon/fwd.py (Hopper, a Triton with
    Gluon, shapes it supports, ``gluon`` on): the plain forward, or with ``state`` = (out, lse)
    the ring step's merge into the running float32 state."""
    if not _gluon_on(q, mask, gluon) or (mask == STRICT and not state):
        return False
    try:
        from ..gluon import fwd as gluon_fwd  # imports triton's Gluon: only on Hopper, when it runs
    except ImportError:  # a Triton without Gluon's Hopper API
        return False
    return gluon_fwd.supported(q, k, v, mask != FULL, *state)


_MASK_LO = {FULL: None, CAUSAL: 0, STRICT: 1}  # gluon_fwd: visible iff q index - k index >= mask_lo


def _gluon_on(q, mask, gluon: bool) -> bool:
    """What both Gluon kernels ask first: a mask kind they compute, a CUDA tensor, Gluon allowed
    (``gluon``: False where BURST_GLUON=0, decided by attention/planning.py)."""
    return gluon and mask in (FULL, CAUSAL, STRICT) and q.is_cuda


def _gluon_forward(q, k, v, scale, mask, gluon: bool = True):
    """The plain full/causal forward through kernels/gluon/fwd.py (FlashAttention-3's shape:
    warp-specialised, QK^T of the next tile under this tile's softmax), or None where it does not
    apply."""
    if not gluon_takes(q, k, v, mask, gluon=gluon):
        return None
    from ..gluon import fwd as gluon_fwd  # imports triton's Gluon: only on Hopper, when it runs

    return gluon_fwd.forward(q, k, v, scale, mask == CAUSAL)


def gluon_forward_into(q, k, v, scale, mask, out, lse, gluon: bool = True) -> bool:
    """The ring step's merge into the running (out, lse) through kernels/gluon/fwd.py where it
    takes the block (1.01-1.38x cuDNN + the torch merge, benchmarks/results/lao_bench.json);
    False, with nothing done, where it does not."""
    if not gluon_takes(q, k, v, mask, out, lse, gluon=gluon):
        return False
    from ..gluon import fwd as gluon_fwd  # imports triton's Gluon: only on Hopper, when it runs

    gluon_fwd.forward_into(q, k, v, scale, _MASK_LO[mask], out, lse)
    return True


def gluon_bwd_takes(q, k, v, mask, dout, dq=None, dk=None, dv=None, gluon: bool = True) -> bool:
    """Whether this full/causal/strict block's backward runs in kernels/gluon/bwd.py (Hopper,
    d 64 or 128; bwd_wide.py at 256; shapes gluon/fwd.py takes, ``gluon`` on), writing into ``dq`` (float32; None: a
    zeroed one made for it), ``dk``, ``dv``."""
    if not _gluon_on(q, mask, gluon):
        return False
    try:
        from ..gluon import bwd as gluon_bwd  # imports triton's Gluon: only on Hopper, when it runs
    except ImportError:
        return False
    return gluon_bwd.supported(q, k, v, mask != FULL, dout, dq, dk, dv)
