"""Cases for tests/kernels/test_heads_kernel.py: the tensor-parallel decode step's heads kernel
(kernels/triton/heads.py) against a float64 oracle of what it replaces (unpack the gathered heads,
q/k norms, RoPE, the K/V rows into the cache's slot).  Run as a script, it runs the kernel under
Triton's CPU interpreter on every case and prints one JSON line {case id: result}."""
import json
import sys
from types import SimpleNamespace

import torch

# (id, ranks W, sequences B, heads per rank (hq, hk), head dim, dtype, rope, norms (None, "w", "plus_one"))
CASES = [
    ("w2-b1-bf16-rope", 2, 1, (4, 1), 64, torch.bfloat16, True, None),
    ("w2-b1-bf16-norm", 2, 1, (4, 1), 64, torch.bfloat16, True, "w"),
    ("w3-b2-fp16-plus1", 3, 2, (2, 2), 32, torch.float16, True, "plus_one"),
    ("w1-b1-fp32-rope", 1, 1, (8, 2), 128, torch.float32, True, None),
    ("w2-b3-bf16-roped", 2, 3, (2, 1), 16, torch.bfloat16, False, None),  # a batch: q, k came roped
    ("w4-b1-fp16-norm", 4, 1, (1, 1), 64, torch.float16, True, "w"),
]
CASE_IDS = [c[0] for c in CASES]
CAP, SLOT = 7, 5


def oracle(every, hq, hk, rope, norms):
    """q, k, v (B, heads, D) float64, rank-major heads: what tensor_parallel's unpack computes."""
    W, B, width = every.shape
    D = width // (hq + 2 * hk)
    x = every.double().view(W, B, hq + 2 * hk, D)
    parts = [x[:, :, a:z].transpose(0, 1).reshape(B, W * (z - a), D) for a, z in
             ((0, hq), (hq, hq + hk), (hq + hk, hq + 2 * hk))]
    q, k, v = parts
    if norms is not None:
        def norm(t, n):
            w = n.weight.double() + (1.0 if n.plus_one else 0.0)
            return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + n.eps) * w
        q, k = norm(q, norms[0]), norm(k, norms[1])
    if rope is not None:
        cos, sin = (t.double()[:, None, :] for t in rope)
        h = D // 2
        rot = lambda t: torch.cat([-t[..., h:], t[..., :h]], dim=-1)  # noqa: E731
        q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
    return q, k, v


def _tp_worker(rank, world, path, out):
    """One rank of a 2-rank tensor-parallel decode (tests/tp_cases.py's float64 models, gloo): the
    step's heads through the kernel (interpreted) beside the eager unpack and cache writes."""
    import os

    import triton_interp  # noqa: F401  (this process's first triton import)
    import torch.distributed as dist

    import tp_cases as tc
    from burstengine.inference.kvcache import ShardedKVCache

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    res = {}
    real = ShardedKVCache.writes_heads
    # a batch (q, k roped by the layer) and single sequences (raw q, k: normed and roped in the kernel)
    for name, over, lengths in (("batch", None, tc.LENGTHS), ("one", None, (53,)),
                                ("one-qk-norm", dict(qk_norm=True), (61,))):
        want_tok, want, _ = tc.run_decode(None, "sliced", True, new=4, overrides=over, lengths=lengths)
        calls = []

        def takes(self, every, head_dim, rope, calls=calls):
            calls.append(rope is not None)
            return True
        ShardedKVCache.writes_heads = takes
        try:
            got_tok, got, sliced = tc.run_decode(None, "sliced", True, new=4, overrides=over, lengths=lengths)
        finally:
            ShardedKVCache.writes_heads = real
        res[name] = dict(equal=got_tok == want_tok, sliced=sliced, kernel_calls=len(calls), raw=all(calls) if calls else None,
                         # the logits reach rank 0 only
                         logits_err=None if want is None else float((got - want).abs().max() / want.abs().max()))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()
    os._exit(0)


def in_tp_decode():
    import os
    import tempfile

    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "out.json")
        mp.spawn(_tp_worker, args=(2, os.path.join(d, "store"), out), nprocs=2)
        with open(out) as f:
            return json.load(f)


def main():
    import triton_interp  # noqa: F401  (before the first triton import)
    from burstengine.kernels.triton.heads import unpack_write

    torch.set_num_threads(1)
    res = {}
    for cid, W, B, (hq, hk), D, dt, rope_on, norm_kind in CASES:
        g = torch.Generator().manual_seed(len(cid))
        every = torch.randn(W, B, (hq + 2 * hk) * D, generator=g).to(dt)
        norms = rope = None
        if norm_kind:
            norms = tuple(SimpleNamespace(weight=(torch.randn(D, generator=g) * 0.3 + (0 if norm_kind == "plus_one"
                                                                                         else 1)).to(dt),
                                          eps=1e-6, plus_one=norm_kind == "plus_one") for _ in range(2))
        if rope_on:
            ang = torch.rand(B, D // 2, generator=g, dtype=torch.float64) * 50
            ang = torch.cat([ang, ang], dim=-1)
            rope = (ang.cos().float(), ang.sin().float())
        # the cache poisoned with NaN: the kernel must write the slot's rows and nothing else
        kc = torch.full((B, W * hk, CAP, D), float("nan"), dtype=dt)
        vc = torch.full((B, W * hk, CAP, D), float("nan"), dtype=dt)
        q = unpack_write(every, hq, hk, hk, kc, vc, torch.tensor([SLOT]), rope=rope, norms=norms)
        rq, rk, rv = oracle(every, hq, hk, rope, norms)
        others = torch.ones(CAP, dtype=torch.bool)
        others[SLOT] = False

        def err(a, b):
            return float((a.double() - b).norm() / b.norm())
        res[cid] = dict(dtype=str(dt)[6:], q_shape=list(q.shape), want_q_shape=[1, B, W * hq, D],
                        q_dtype=str(q.dtype)[6:], q_err=err(q[0], rq), k_err=err(kc[:, :, SLOT], rk),
                        v_exact=bool(torch.equal(vc[:, :, SLOT].double(), rv)),
                        others_untouched=bool(kc[:, :, others].isnan().all() and vc[:, :, others].isnan().all()))
    # the self-check a GPU runs before the step uses the kernel: passes, and fails on a wrong kernel
    import warnings

    from burstengine.inference import kvcache
    from burstengine.kernels.triton import heads
    res["self_check"] = {str(dt)[6:]: kvcache._heads_checked("cpu", dt, 32) for dt in (torch.bfloat16, torch.float32)}
    real = heads.unpack_write
    heads.unpack_write = lambda every, *a, **k: real(every, *a, **k) * 1.1
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            res["self_check_wrong"] = kvcache._heads_checked("cpu", torch.float16, 32)
        res["self_check_warned"] = any("heads kernel failed its self-check" in str(w.message) for w in seen)
    finally:
        heads.unpack_write = real
    res["tp_decode"] = in_tp_decode()
    print(json.dumps(res))


if __name__ == "__main__":
    sys.exit(main())
