"""Cases for tests/kernels/test_decode_kernel.py: the flash-decoding kernel (kernels/triton/decode.py)
against a float64 oracle.  Run as a script, it runs the kernel under Triton's CPU interpreter on
every case and prints one JSON line {case id: result}.

The interpreter runs each program in Python, so the cases are tiny; tiles of 16 rows and forced
split counts make them cross tile and chunk edges all the same."""
import json
import sys

import torch

# (id, batch, heads, kv heads, head dim, capacity, valid per sequence, dtype, mask, splits)
# mask: "" none, "vis" a random visibility, "win" a sliding window over shuffled slot positions,
# "vis+win" both, "hidden" a sequence whose slots are all hidden
CASES = [
    ("g1-d64-bf16-n7-1", 2, 2, 2, 64, 9, (7, 1), torch.bfloat16, "", 2),
    ("g4-d128-fp16-n997", 1, 4, 1, 128, 997, (997,), torch.float16, "", 5),
    ("g8-d64-bf16-vis", 2, 8, 1, 64, 40, (37, 20), torch.bfloat16, "vis", 3),
    ("g4-d64-fp32-win", 2, 8, 2, 64, 50, (50, 33), torch.float32, "win", 4),
    ("g4-d128-bf16-vis-win", 2, 4, 1, 128, 30, (30, 29), torch.bfloat16, "vis+win", 2),
    ("g1-d128-fp16-split1", 1, 2, 2, 128, 21, (21,), torch.float16, "", 1),
    ("g2-d64-bf16-empty", 2, 4, 2, 64, 20, (0, 5), torch.bfloat16, "", 2),
    ("g4-d64-fp16-hidden", 2, 4, 1, 64, 18, (18, 18), torch.float16, "hidden", 3),
    ("g8-d64-fp32-planned", 1, 8, 1, 64, 70, (61,), torch.float32, "vis", None),
]
CASE_IDS = [c[0] for c in CASES]
# the same cases over an FP8 cache (k, v quantized per slot and kv head; the NaN tails make NaN
# rows and scales, never to be read): against the oracle over the dequantized rows
FP8_IDS = ["g1-d64-bf16-n7-1", "g4-d128-fp16-n997", "g4-d64-fp32-win", "g4-d128-bf16-vis-win", "g2-d64-bf16-empty"]
# and again with V's values 1e-3 of the rest's (a model's V rows are often small): their scales
# are ~1e-5, so P times them (not V times them) would sink below fp16's normal range
WIDEN = {"q": "", "f16": "-f16"}  # decode_attention(widen=) -> the case id's suffix
FP8_SMALL_V = ["g4-d128-fp16-n997", "g4-d64-fp16-hidden", "g4-d128-bf16-vis-win"]
# hostile FP8 inputs (case id -> the case they change): hidden slots whose V rows are 1e8 times
# the visible ones' (they weigh 0, so their values must not matter); half the query heads zero,
# a whole tile of zero V rows (scales 0) and one more zero row; a query element 3e38 (above 2^127,
# near bf16's largest) over keys 1e-36 of the rest's: widened to fp16 only (widened to bf16, q
# times the raw FP8 values, up to 448, passes float32's range before the scales bring it back)
FP8_HOSTILE = {"hidden-huge-v": ("g8-d64-bf16-vis", tuple(WIDEN)), "zero-q-v": ("g8-d64-bf16-vis", tuple(WIDEN)),
               "q-near-max": ("g1-d64-bf16-n7-1", ("f16",))}
WINDOW = 7


def make(case, seed=0):
    """q, k, v (k, v strided views with a NaN-poisoned tail past every valid slot), valid,
    visible, qpos, kpos, window for a case."""
    _, B, H, Hkv, D, cap, valid, dtype, mask, _ = case
    g = torch.Generator().manual_seed(seed + cap + D)
    q = torch.randn(B, H, D, generator=g).to(dtype)
    # the cache with one scratch slot past capacity (as ShardedKVCache keeps it), so k is a view
    # whose batch stride is not its size
    buf_k = torch.randn(B, Hkv, cap + 1, D, generator=g).to(dtype)
    buf_v = torch.randn(B, Hkv, cap + 1, D, generator=g).to(dtype)
    for b, n in enumerate(valid):  # past valid[b]: never to be read
        buf_k[b, :, n:] = float("nan")
        buf_v[b, :, n:] = float("nan")
    k, v = buf_k[:, :, :cap], buf_v[:, :, :cap]
    visible = window = qpos = kpos = None
    if "vis" in mask:
        visible = torch.rand(B, cap, generator=g) < 0.6
    if mask == "hidden":
        visible = torch.ones(B, cap, dtype=torch.bool)
        visible[1] = False
    if "win" in mask:
        window = WINDOW
        # slot positions out of order (a zigzag shard's are), queries after them all
        kpos = torch.stack([torch.randperm(cap, generator=g) for _ in range(B)])
        qpos = torch.full((B,), cap - 1, dtype=torch.int64) - torch.arange(B)
    return q, k, v, torch.tensor(valid, dtype=torch.int64), visible, window, qpos, kpos


def oracle(q, k, v, scale, valid, visible, window, qpos, kpos):
    """float64 (out, lse) one sequence and head at a time, from the definition."""
    B, H, D = q.shape
    Hkv, cap = k.shape[1], k.shape[2]
    out = torch.zeros(B, H, D, dtype=torch.float64)
    lse = torch.full((B, H), float("-inf"), dtype=torch.float64)
    for b in range(B):
        sees = torch.arange(cap) < valid[b]
        if visible is not None:
            sees &= visible[b]
        if window is not None:
            sees &= qpos[b] - kpos[b] < window
        idx = torch.nonzero(sees).flatten()
        if len(idx) == 0:
            continue
        for h in range(H):
            kk = k[b, h // (H // Hkv), idx].double()
            vv = v[b, h // (H // Hkv), idx].double()
            s = kk @ q[b, h].double() * scale
            lse[b, h] = torch.logsumexp(s, 0)
            out[b, h] = torch.softmax(s, 0) @ vv
    return out, lse



# aten ops whose result depends on a device value read on the host (a sync on CUDA, and a
# capture error in a CUDA graph): item() / int() / bool() / tolist(), data-dependent shapes
SYNCING = {"_local_scalar_dense", "item", "is_nonzero", "equal", "allclose", "nonzero", "nonzero_static",
           "masked_select", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim"}


def watched(forward, ops: set, bad: list):
    """``forward`` (a decode step's method) such that every op it runs (at the aten level,
    collectives included) lands in ``ops``, and each one that reads a device value on the host,
    or indexes with a boolean mask (a data-dependent shape), in ``bad``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            ops.add(name)
            if name in SYNCING:
                bad.append(name)
            if name.startswith("index") and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                for a in args if isinstance(a, (list, tuple)) for i in a):
                bad.append(f"{name} with a boolean mask")
            return func(*args, **(kwargs or {}))

    def run(self):
        with Watch():
            return forward(self)

    return run

def in_generation():
    """The kernel inside generation: tiny Llama (two prompt lengths: a visibility mask) and
    Mistral (a sliding window; also over an FP8 cache) checkpoints decode with shard_attention sent to the kernel
    (interpreted, on CPU float32) instead of the math path; every decode step's logits must be
    the math path's up to float32 rounding, and the greedy tokens the same.  This runs the
    kernel on the cache's own buffers (the scratch slot, the valid counts of the step's device
    state, the visibility and positions) as the GPU does."""
    import tempfile

    import generate_cases as gc
    from burstengine.inference import kvcache

    out = {}
    real = kvcache._kernel_takes
    with tempfile.TemporaryDirectory() as d:
        for arch, kv in (("llama", None), ("mistral", None), ("mistral", "fp8")):
            path = gc.save_tiny(f"{d}/{arch}", arch, seed=1)
            want, want_logits = gc.run_generate_logits(None, path, (97, 40), 5, kv_dtype=kv)
            calls = []

            def takes(q, k, calls=calls):
                calls.append(q.shape)
                return q.dtype == torch.float32

            kvcache._kernel_takes = takes
            try:
                got, logits = gc.run_generate_logits(None, path, (97, 40), 5, kv_dtype=kv)
            finally:
                kvcache._kernel_takes = real
            err = float((logits - want_logits).abs().max() / want_logits.abs().max())
            out[arch + ("-" + kv if kv else "")] = dict(equal=got == want, logits_err=err, kernel_calls=len(calls))
    return out


def _result(case, out, lse, ref):
    """What the test reads of one kernel call against the oracle's (out, lse)."""
    from burstengine.inference.kvcache import packed
    ro, rl = ref
    seen = torch.isfinite(rl)
    return dict(
        dtype=str(case[7])[6:], out_dtype=str(out.dtype)[6:], lse_dtype=str(lse.dtype)[6:],
        packed=packed(out, lse) is not None,
        nan=bool(torch.isnan(out).any() or torch.isnan(lse).any()),
        out_err=float((out.double() - ro).norm() / ro.norm().clamp_min(1e-30)) if seen.any() else 0.0,
        lse_err=float((lse.double() - rl)[seen].abs().max()) if seen.any() else 0.0,
        unseen=int((~seen).sum()),
        unseen_exact=bool((out[~seen] == 0).all() and (lse[~seen] == float("-inf")).all()))


def main():
    import triton_interp  # noqa: F401  (before the first triton import)
    from burstengine.kernels.triton.decode import decode_attention, plan_splits

    torch.set_num_threads(1)
    res = {}
    for case in CASES:
        q, k, v, valid, visible, window, qpos, kpos = make(case)
        scale = case[4] ** -0.5
        out, lse = decode_attention(q, k, v, scale, valid, visible, window, qpos, kpos, splits=case[9], bn=16)
        res[case[0]] = _result(case, out, lse, oracle(q, k, v, scale, valid, visible, window, qpos, kpos))
    from burstengine.inference.kvcache import dequantize, quantize_kv
    for case in CASES:
        for small_v in (False, True):
            if case[0] not in (FP8_SMALL_V if small_v else FP8_IDS):
                continue
            q, k, v, valid, visible, window, qpos, kpos = make(case)
            k, ks, v, vs = quantize_kv(k, v * 1e-3 if small_v else v)
            scale = case[4] ** -0.5
            ref = oracle(q, dequantize(k, ks, torch.float64), dequantize(v, vs, torch.float64), scale, valid,
                         visible, window, qpos, kpos)
            for widen in WIDEN:
                out, lse = decode_attention(q, k, v, scale, valid, visible, window, qpos, kpos, splits=case[9],
                                            bn=16, k_scale=ks, v_scale=vs, widen=widen)
                res[case[0] + ("-fp8-small-v" if small_v else "-fp8") + WIDEN[widen]] = _result(case, out, lse, ref)
    for name, (base, widens) in FP8_HOSTILE.items():
        case = next(c for c in CASES if c[0] == base)
        q, k, v, valid, visible, window, qpos, kpos = make(case)
        v = v.clone()
        if name == "hidden-huge-v":
            v[~visible[:, None, :, None].expand_as(v)] *= 1e8
        elif name == "q-near-max":
            q[0, 0, 0] = 3e38
            k = k * 1e-36
        else:
            q[:, ::2] = 0
            v[:, :, 16:32] = 0
            v[:, :, 3] = 0
        k, ks, v, vs = quantize_kv(k, v)
        scale = case[4] ** -0.5
        ref = oracle(q, dequantize(k, ks, torch.float64), dequantize(v, vs, torch.float64), scale, valid, visible,
                     window, qpos, kpos)
        for widen in widens:
            out, lse = decode_attention(q, k, v, scale, valid, visible, window, qpos, kpos, splits=case[9], bn=16,
                                        k_scale=ks, v_scale=vs, widen=widen)
            res[f"{base}-fp8-{name}{WIDEN[widen]}"] = _result(case, out, lse, ref)
    res["plan"] = [list(plan_splits(cap, progs, sms, 64)) for cap, progs, sms in
                   ((131073, 8, 132), (32769, 64, 132), (100, 8, 132), (1, 1, 132), (524289, 8, 132),
                    (4097, 1024, 132))]
    res["generate"] = in_generation()
    print(json.dumps(res))


if __name__ == "__main__":
    sys.exit(main())
