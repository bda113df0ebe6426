"""A KV cache that stays sharded over the ranks of a context-parallel group.

After a sharded prefill every rank keeps its own prompt tokens' keys and values, for every
layer; nothing is gathered.  A decode step's query attends to each rank's shard there (a
partial output and its log-sum-exp), and :func:`merge` combines the partials exactly: the
online-softmax merge of BurstAttention's ring, over ranks instead of ring steps.  The new
token's K/V go to one rank only, the one :func:`next_owner` names.

Balance.  Every rank knows every shard's length (the prefill's shards follow from the layout
and the prompt lengths, and each step's owner from the lengths), so the owner costs no
communication.  The owner is the rank with the shortest shard, the lowest such rank on ties.
With d the longest minus the shortest shard: a step never makes d larger than max(d, 1), and
while d > 1 every step shortens the gap of the rank it fills, so d reaches 1 after at most the
shards' total deficit (sum over ranks of longest - length) steps and stays <= 1 from then on.
The prefill's shards differ only by the padded slots dropped (below), fewer than 2 x world.

Layout of a layer's buffers: (batch, kv_heads, capacity + 1, head_dim), so the keys a step
reads are one strided view with contiguous rows (an attention kernel reads them in place).
Capacity is the prefill's slots plus exactly the appends this rank will receive in
``max_new_tokens`` steps, so an append never reallocates; the one slot past it is scratch, where
a rank that does not own a step's token writes it (a static decode step writes every step,
at an index it reads from the device: :mod:`.step`), and that no query ever sees.  Per slot and
sequence the cache keeps the token's global position (for a sliding window) and whether it is a
real token of that sequence: a batch of prompts of different lengths is padded at the end to
one length, and slots past a sequence's own length hold pad tokens that it must never see.
Slots that are padding for every sequence are dropped at prefill.

An FP8 cache (``kv_dtype="fp8"``) keeps K and V as float8_e4m3fn with one float32 scale per
slot and kv head (the row's largest magnitude over 448, e4m3's largest value): about half the
bytes a decode step reads at long context, for the rounding of a 3-bit mantissa (a few percent
of an attention output, where bf16's is a few tenths of one: tests/inference/test_generate.py).  Rows are quantized as they are written, by the prefill and
by each step, so no scale is ever revised.

Attention over a shard (:func:`shard_attention`) reads the number of valid slots, the
visibility and the positions from device tensors: on CUDA in the flash-decoding kernel
(kernels/triton/decode.py), which reads only the valid slots, once per kv head; elsewhere (CPU,
float64) in an exact masked math path over the whole buffer.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from ..model import fused, tensor_parallel

# torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns there)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def next_owner(lengths: list[int]) -> int:
    """The rank whose shard is shortest (the lowest such rank on ties)."""
    return min(range(len(lengths)), key=lambda r: (lengths[r], r))


def appends(lengths: list[int], steps: int) -> list[int]:
    """How many of ``steps`` appends each rank receives, starting from shard ``lengths``."""
    n = list(lengths)
    got = [0] * len(n)
    for _ in range(steps):
        r = next_owner(n)
        n[r] += 1
        got[r] += 1
    return got


class ShardedKVCache:
    """This rank's shard of every layer's keys and values, and its slots' positions and
    visibility.  ``lengths`` is every rank's shard length (the same list on every rank)."""

    def __init__(self, n_layers: int, batch: int, kv_heads: int, head_dim: int, capacity: int, lengths: list[int],
                 rank: int, dtype, device, kv_dtype: str | None = None):
        msg = kv_dtype_error(kv_dtype, device)
        if msg:
            raise ValueError(msg)
        self.rank, self.lengths = rank, list(lengths)
        self.capacity = capacity
        self.scratch = capacity  # the slot a non-owner writes a step's token into; never valid
        rows = capacity + 1
        self.fp8 = kv_dtype == "fp8"
        store = torch.float8_e4m3fn if self.fp8 else dtype
        # zeros, not empty: the math path (CPU, float64) reads every slot and masks the scores,
        # and a NaN left in a slot never written would still reach p @ v as 0 x NaN
        self.k = [torch.zeros(batch, kv_heads, rows, head_dim, dtype=store, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.k_scale = self.v_scale = None
        if self.fp8:
            self.k_scale = [torch.zeros(batch, kv_heads, rows, dtype=torch.float32, device=device)
                            for _ in range(n_layers)]
            self.v_scale = [torch.zeros_like(t) for t in self.k_scale]
        self.pos = torch.zeros(batch, rows, dtype=torch.int64, device=device)
        self.visible = torch.zeros(batch, rows, dtype=torch.bool, device=device)
        self.all_visible = True   # no slot is hidden from any sequence (attention needs no visibility mask)

    @property
    def n(self) -> int:
        return self.lengths[self.rank]

    def fill(self, layer: int, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None) -> None:
        """The prefill's (B, n, kv_heads, head_dim) K/V of this rank's tokens, the slots
        ``keep`` (a row index, None: all) only."""
        if keep is not None:
            k, v = k[:, keep], v[:, keep]
        m = k.shape[1]
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.fp8:
            k, ks, v, vs = fused.run(quantize_kv, k, v)
            self.k_scale[layer][:, :, :m].copy_(ks)
            self.v_scale[layer][:, :, :m].copy_(vs)
        _bytes(self.k[layer][:, :, :m]).copy_(_bytes(k))
        _bytes(self.v[layer][:, :, :m]).copy_(_bytes(v))

    def set_slots(self, pos: torch.Tensor, visible: torch.Tensor, all_visible: bool) -> None:
        """Positions (B, n) and visibility (B, n) of the prefill's kept slots."""
        m = pos.shape[1]
        self.pos[:, :m] = pos
        self.visible[:, :m] = visible
        self.all_visible = all_visible

    # --- a decode step: host bookkeeping gives the indices, device tensors carry them ---------

    def slot(self, owner: int) -> int:
        """Where this rank writes the token of a step that ``owner`` stores."""
        return self.n if owner == self.rank else self.scratch

    def valid(self, owner: int) -> int:
        """Slots this rank's shard attends to during that step (the owner's new one counts)."""
        return self.n + (owner == self.rank)

    def advance(self, owner: int) -> None:
        """The step is over: ``owner``'s shard holds one more token."""
        self.lengths[owner] += 1

    def write_slot(self, slot: torch.Tensor, qpos: torch.Tensor, window: bool) -> None:
        """The step's token (positions ``qpos`` (B,)) into slot ``slot`` (a (1,) device index):
        visible to every sequence, at its position (read by a ``window`` only)."""
        if not self.all_visible:
            self.visible.index_fill_(1, slot, True)
        if window:
            self.pos.index_copy_(1, slot, qpos[:, None])

    def write(self, layer: int, slot: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The step's (B, kv_heads, head_dim) K/V of ``layer`` into slot ``slot`` (device index)."""
        if self.fp8:
            k, ks, v, vs = fused.run(quantize_kv, k, v)
            self.k_scale[layer].index_copy_(2, slot, ks[:, :, None])
            self.v_scale[layer].index_copy_(2, slot, vs[:, :, None])
        _bytes(self.k[layer]).index_copy_(2, slot, _bytes(k)[:, :, None])
        _bytes(self.v[layer]).index_copy_(2, slot, _bytes(v)[:, :, None])

    def writes_heads(self, every: torch.Tensor, head_dim: int, rope) -> bool:
        """Whether :meth:`write_heads` runs here: a CUDA cache of the gathered heads' dtype (not
        FP8), a power-of-two head dim, RoPE tables of whole rows, and the kernel passed its
        self-check on this device (:func:`_heads_checked`)."""
        B, D = every.shape[1], head_dim
        return (not self.fp8 and every.is_cuda and every.dtype in (torch.float16, torch.bfloat16, torch.float32)
                and self.k[0].dtype == every.dtype and D >= 16 and D & (D - 1) == 0
                and (rope is None or all(tuple(t.shape) == (B, head_dim) and t.stride(-1) == 1 for t in rope))
                and _heads_checked(every.device, every.dtype, head_dim))

    def write_heads(self, layer: int, every: torch.Tensor, heads: tuple[int, int, int], slot: torch.Tensor, rope=None,
                    norms=None) -> torch.Tensor:
        """A tensor-parallel step's gathered heads ``every`` (W, B, (hq + hk + hv) D), in one
        kernel: q (1, B, W hq, D) returned, the key (roped) and value heads written to ``slot``
        of ``layer`` (kernels/triton/heads.py; what ``tensor_parallel.unpack_heads`` and
        :meth:`write` do in five)."""
        from ..kernels.triton import heads as kernel  # imports triton: only when the kernel runs
        return kernel.unpack_write(every, *heads, self.k[layer], self.v[layer], slot, rope, norms)

    def attend(self, layer: int, q: torch.Tensor, valid: torch.Tensor, qpos: torch.Tensor, window: int | None,
               scale: float):
        """(out (B, H, D), lse (B, H)), float32 (float64 for float64 queries), of the queries (B, H, D) at positions
        ``qpos`` (B,) over this rank's first ``valid`` (B,) slots; lse = -inf (and out 0) where
        none is visible."""
        return shard_attention(q, self.k[layer], self.v[layer], scale, valid=valid,
                               visible=None if self.all_visible else self.visible, window=window, qpos=qpos,
                               kpos=self.pos, k_scale=self.k_scale and self.k_scale[layer],
                               v_scale=self.v_scale and self.v_scale[layer])


KV_DTYPES = (None, "fp8")
KV_CACHES = {"model": None, "fp8": "fp8"}  # the command lines' --kv-cache words -> kv_dtype
E4M3_MAX = 448.0
# a scale's floor: an all-zero row quantizes to zeros, not to 0 / 0.  float32's smallest normal, so
# that every row float32 holds keeps its 3-bit mantissa (a floor of 2^-60 flushed rows below
# ~1e-16 to zeros); a row's largest over it is <= 448 all the same
_TINY = torch.finfo(torch.float32).tiny


def kv_dtype_error(kv_dtype, device) -> str | None:
    """Why a cache of ``kv_dtype`` cannot be kept on ``device``, else None: a value not in
    :data:`KV_DTYPES`, or FP8 on a GPU before compute capability 8.9 (no float8 conversions there:
    its compiled write would fail obscurely)."""
    if kv_dtype not in KV_DTYPES:
        return f"kv_dtype {kv_dtype!r}: one of {', '.join(map(str, KV_DTYPES))} (None: the model's dtype)"
    device = torch.device(device)
    if kv_dtype == "fp8" and device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < (8, 9):
            return (f"kv_dtype 'fp8' needs a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
                    f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}")
    return None


def quantize_rows(x: torch.Tensor):
    """(float8_e4m3fn rows, float32 scales (x.shape[:-1])) with ``x ~= scale[..., None] * rows``:
    one scale per row of the last dim, its largest magnitude over e4m3's largest value."""
    xf = x.float()
    scale = (xf.abs().amax(-1) / E4M3_MAX).clamp_min(_TINY)
    return (xf / scale[..., None]).to(torch.float8_e4m3fn), scale


def quantize_kv(k, v):
    """:func:`quantize_rows` of K and of V (one compiled kernel on GPUs)."""
    return (*quantize_rows(k), *quantize_rows(v))


def dequantize(rows: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    return rows.to(dtype) * scale[..., None].to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor as uint8 (copy and index_copy_ of float8 are not implemented everywhere),
    any other as it is."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


_warned = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        import warnings

        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _kernel_takes(q, k) -> bool:
    """Whether the Triton decode kernel runs this call: CUDA, fp16 / bf16 (and fp32) queries over
    a cache of their dtype or FP8, a power-of-two head dim, and the kernel passed its self-check
    on this device for these dtypes and head dim.  Elsewhere (CPU, float64) the exact math path does."""
    D = q.shape[-1]
    fp8 = k.dtype == torch.float8_e4m3fn
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16, torch.float32) and (k.dtype == q.dtype or fp8)
            and 16 <= D <= 256 and D & (D - 1) == 0 and _self_checked(q.device, q.dtype, D, fp8))


_CHECKED: dict = {}  # (what, device, dtype, head dim[, fp8]) -> whether the kernel passed


def _checked_once(key: tuple, check, failed: str) -> bool:
    """Whether a kernel passed ``check()`` -> (ok, why) on its first use here: run once per
    ``key`` (whose second item is the device) and process.  A kernel that disagrees with its
    eager path (a Triton or driver difference the interpreter tests cannot see), or cannot
    compile here, is never used: ``failed`` is warned once ("{why}" in it replaced by why) and
    the eager path answers.
    Never run inside a CUDA graph capture (the step's warm-up runs it first)."""
    if key in _CHECKED:
        return _CHECKED[key]
    if torch.device(key[1]).type == "cuda" and torch.cuda.is_current_stream_capturing():
        return True  # the warm-up before the capture has checked it (or this is not ours to check)
    try:
        ok, why = check()
    except Exception as e:  # noqa: BLE001 (a kernel that cannot compile here: the eager path)
        ok, why = False, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    if not ok:
        _warn_once(failed.replace("{why}", why))
    _CHECKED[key] = ok
    return ok


def _self_checked(device, dtype, D: int, fp8: bool = False) -> bool:
    """The decode kernel against the math path on one small case (GQA, a ragged batch, hidden
    slots, a window; :func:`_checked_once`)."""
    def check():
        try:
            from ..kernels.triton import decode  # imports triton: only when the kernel could run
        except ImportError:
            return True, ""  # the caller finds triton missing and warns
        g = torch.Generator(device="cpu").manual_seed(0)
        B, Hkv, grp, n = 2, 2, 2, 300
        q, k, v = (torch.randn(*shape, generator=g).to(device, dtype)
                   for shape in ((B, Hkv * grp, D), (B, Hkv, n, D), (B, Hkv, n, D)))
        valid = torch.tensor([n, 137], device=device)
        visible = (torch.rand(B, n, generator=g) > 0.2).to(device)
        qpos = torch.tensor([n + 5, 140], device=device)
        kpos = torch.arange(n, device=device).expand(B, n).contiguous()
        scales = {}
        if fp8:
            k, ks, v, vs = quantize_kv(k, v)
            scales = dict(k_scale=ks, v_scale=vs)
        out, lse = decode.decode_attention(q, k, v, D ** -0.5, valid, visible, 100, qpos, kpos, **scales)
        ref_out, ref_lse = _math(q, k, v, D ** -0.5, valid, visible, 100, qpos, kpos, **scales)
        err = max(float((out - ref_out).abs().max()), float((lse - ref_lse).abs().max()))
        return err <= (1e-3 if dtype == torch.float32 else 3e-2), f"it differs from the math path by {err:.3g}"

    return _checked_once(("decode", str(device), dtype, D, fp8), check,
                         f"decode attention: the Triton decode kernel failed its self-check on {device} ({dtype}"
                         f"{' over an FP8 cache' if fp8 else ''}, head dim {D}): {{why}}; using the math path (exact, "
                         "slower)")


def _heads_checked(device, dtype, D: int) -> bool:
    """The heads kernel against the eager unpack, norms, RoPE and cache write on one small case
    (2 ranks' heads, 2 sequences, q/k norms; :func:`_checked_once`)."""
    def check():
        from ..kernels.triton import heads as kernel  # imports triton: only when the kernel could run
        g = torch.Generator(device="cpu").manual_seed(0)
        W, B, hq, hk = 2, 2, 2, 1
        every = torch.randn(W, B, (hq + 2 * hk) * D, generator=g).to(device, dtype)
        norms = tuple(SimpleNamespace(weight=(torch.rand(D, generator=g) + 0.5).to(device, dtype), eps=1e-6,
                                      plus_one=False) for _ in range(2))
        ang = torch.rand(B, D, generator=g, dtype=torch.float64) * 10
        rope = (ang.cos().float().to(device), ang.sin().float().to(device))
        slot = torch.tensor([3], device=device)
        kc, vc = (torch.zeros(B, W * hk, 5, D, dtype=dtype, device=device) for _ in range(2))
        q = kernel.unpack_write(every, hq, hk, hk, kc, vc, slot, rope, norms)
        rq, rk, rv = tensor_parallel.unpack_heads(every, (hq, hk, hk), rope, norms)
        err = max(float((q.float() - rq.float()).abs().max()), float((kc[:, :, 3] - rk[0].float()).abs().max()),
                  float((vc[:, :, 3].float() - rv[0].float()).abs().max()))
        kc[:, :, 3] = vc[:, :, 3] = 0  # the other slots must still be the zeros they were
        ok = err <= (1e-4 if dtype == torch.float32 else 5e-2) and not (kc.any() or vc.any())
        return ok, f"it differs from the eager path by {err:.3g}"

    return _checked_once(("heads", str(device), dtype, D), check,
                         f"decode step: the Triton heads kernel failed its self-check on {device} ({dtype}, head dim "
                         f"{D}): {{why}}; unpacking the heads and writing the cache op by op")


def shard_attention(q, k, v, scale, valid=None, visible=None, window=None, qpos=None, kpos=None, k_scale=None,
                    v_scale=None):
    """Attention of one query per sequence and head, q (B, H, D), over the slots of k, v
    (B, Hkv, n, D) (grouped-query: query head h reads kv head h // (H / Hkv)).  Slot j counts
    for sequence b when ``j < valid[b]`` (all n slots without ``valid``), ``visible[b, j]``
    (a (B, n) bool, when given) and, with a ``window``, ``qpos[b] - kpos[b, j] < window``.
    Every one of these is a device tensor, read on the device.  Returns (out (B, H, D), lse (B,
    H)) in float32 (float64 for float64 queries: the tests' oracle keeps its precision through
    the merge), views of one (B, H, D + 1) buffer (:func:`packed`); lse = -inf and out = 0 where
    no slot counts.  The kernel never reads a slot
    past ``valid``; the math path reads every slot (weighing those 0), so they must hold finite
    values, as the cache's zero-filled ones do.  ``k_scale``, ``v_scale`` (B, Hkv, n): k and v are an
    FP8 cache, slot j's row ``scale[..., j] * row``."""
    B, H, D = q.shape
    Hkv, n = k.shape[1], k.shape[2]
    if n and _kernel_takes(q, k):
        if valid is None:
            valid = torch.full((B,), n, dtype=torch.int64, device=q.device)
        try:
            from ..kernels.triton import decode  # imports triton: only when the kernel runs
        except ImportError as e:  # no triton here: the exact math path, slower
            _warn_once(f"decode attention: the Triton kernel is unavailable ({e}); using the math path")
        else:
            return decode.decode_attention(q, k, v, scale, valid, visible, window, qpos, kpos, k_scale=k_scale,
                                           v_scale=v_scale)
    elif q.is_cuda and q.dtype != torch.float64:
        _warn_once(f"decode attention: head dim {D} / {q.dtype} runs the math path (float32 copies of the shard); "
                   f"the Triton decode kernel takes power-of-two head dims in [16, 256]")
    return _math(q, k, v, scale, valid, visible, window, qpos, kpos, k_scale, v_scale)


def _math(q, k, v, scale, valid, visible, window, qpos, kpos, k_scale=None, v_scale=None):
    """The math path: exact, in float32 (float64 for float64), over all n slots with a mask
    (an FP8 cache's rows times their scales, in that precision)."""
    B, H, D = q.shape
    Hkv, n = k.shape[1], k.shape[2]
    g = H // Hkv
    qg = q.reshape(B, Hkv, g, D)  # the g query heads sharing a kv head: the cache is never expanded
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if k_scale is not None:
        k, v = dequantize(k, k_scale, acc), dequantize(v, v_scale, acc)
    s = torch.matmul(qg.to(acc), k.to(acc).transpose(-1, -2)) * scale  # (B, Hkv, g, n)
    sees = None
    if valid is not None:
        sees = torch.arange(n, device=q.device)[None, :] < valid[:, None]
    if visible is not None:
        sees = visible if sees is None else sees & visible
    if window is not None:
        near = qpos[:, None] - kpos < window
        sees = near if sees is None else sees & near
    if sees is not None:
        s = s.masked_fill(~sees[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    ol = torch.empty(B, H, D + 1, dtype=acc, device=q.device)  # out and lse packed, as the kernel returns them
    ol[..., :D] = torch.matmul(p, v.to(acc)).reshape(B, H, D)
    ol[..., D] = lse.reshape(B, H)
    return ol[..., :D], ol[..., D]


def merge(parts: torch.Tensor):
    """Exact merge of per-rank partial attentions packed as (W, B, H, D + 1) float32 (or float64): out in
    [..., :D], lse in [..., D].  Returns (out (B, H, D), lse (B, H)).  Deterministic: the same
    operations in rank order on every rank, so every rank gets the same bits."""
    out, lse = parts[..., :-1], parts[..., -1]
    m = lse.max(dim=0).values
    m = torch.where(torch.isfinite(m), m, 0.0)
    w = torch.exp(lse - m)                    # (W, B, H); a rank that sees nothing weighs 0
    den = w.sum(dim=0)
    o = (w[..., None] * out).sum(dim=0) / den[..., None]
    return o, m + torch.log(den)


def packed(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor | None:
    """The (B, H, D + 1) buffer whose views ``out`` ([..., :D]) and ``lse`` ([..., D]) are, as
    :func:`shard_attention` returns them (so the merge's all-gather sends it without a copy), or
    None when they are not."""
    base = out._base
    B, H, D = out.shape
    if base is None or base is not lse._base or tuple(base.shape) != (B, H, D + 1) or not base.is_contiguous():
        return None
    if out.data_ptr() != base.data_ptr() or lse.data_ptr() != base[..., D].data_ptr():
        return None
    return base


def gather_parts(out: torch.Tensor, lse: torch.Tensor, group=None) -> torch.Tensor | None:
    """Every rank's (out, lse) packed as :func:`merge` reads them, (W, B, H, D + 1): one
    all-gather; None with one rank."""
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    if world == 1:
        return None
    mine = packed(out, lse)
    if mine is None:
        mine = torch.cat([out, lse[..., None]], dim=-1).contiguous()
    parts = mine.new_empty((world * mine.shape[0],) + tuple(mine.shape[1:]))
    _all_gather(parts, mine, group=group)
    return parts.view((world,) + tuple(mine.shape))


def merged_heads(out: torch.Tensor, lse: torch.Tensor, group, lo: int, hi: int, dtype) -> torch.Tensor:
    """Heads [lo, hi) of the exact attention over every rank's shard, (B, hi - lo, D) in
    ``dtype``: what a decode step reads (the merge of only the heads it keeps, and the cast, one
    compiled kernel on GPUs)."""
    parts = gather_parts(out, lse, group)
    if parts is None:
        return out[:, lo:hi].to(dtype)
    return fused.run(_merge_heads, parts, lo, hi, dtype)


def _merge_heads(parts, lo: int, hi: int, dtype):
    return merge(parts[:, :, lo:hi])[0].to(dtype)
