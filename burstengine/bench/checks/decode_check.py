"""`burstengine bench decode --check`: the decode path's correctness on this device, in seconds,
before it is timed.

1. Decode attention (``inference.kvcache.shard_attention``: on CUDA the Triton flash-decoding
   kernel, kernels/triton/decode.py) against the float64 math path on the same inputs: bf16
   (and fp16), GQA ratios 1/4/8, head dims 64/128, capacities that divide no tile up to ~40K
   slots (many splits), per-sequence valid counts (one sequence empty), with and without a
   visibility mask and a sliding window.  Normwise error of out, largest error of lse; out = 0 and
   lse = -inf exactly where nothing is visible.  The same over an FP8 cache, against the float64
   math path over its dequantized rows (whatever --kv-cache says): bf16 queries, GQA and MHA, every
   mask; fp16 queries over V rows of ~1e-3.
2. Generation with two small random models (one with a sliding window), three prompts of
   different lengths (visibility masks in the cache), greedy: the tokens with the decode step
   replayed from a CUDA graph equal those of the step launched op by op, and in float32 both
   equal the float64 model's (whose attention is the math path); every decode step's logits
   too, float32 within float32 rounding of float64's (1e-4 relative, largest over the
   vocabulary) and the graph's within 1e-5 of op by op (the same kernels: 0 expected), bf16
   loosely (5e-2 of float64's, 1e-2 between graph and op by op).  The LM head is scaled up so
   that no greedy choice is a near-tie, and a token that differs is a defect, not rounding.  Run
   on several ranks (under torchrun), the same over the ranks: the step whole on every rank and
   tensor-parallel, each with and without the graph (its collectives captured), against the
   float64 model decoded whole.

On CPU the graph and kernel parts have nothing to run (the math path is the oracle there); the
rest runs, which is what the CPU test covers.
"""
from __future__ import annotations

import copy
import time

import torch

from ...comm.dist import world_of
from ...inference.generate import generate
from ...inference.kvcache import dequantize, quantize_kv, shard_attention
from ...inference.models import OurLlama, random_llama
from ...model import ModelArgs
from ...model.tensor_parallel import refuses

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}
# largest logit error / largest logit, by (dtype, against float64 or else the same dtype op by op):
# float32 decoding (the kernel's IEEE dots on CUDA) is float64's up to float32 rounding; the graph
# replays the kernels op by op runs (0 expected); bf16 is bounded loosely, its kernel is checked
# above
_LOGITS_TOL = {("float32", True): 1e-4, ("float32", False): 1e-5, ("bfloat16", True): 5e-2,
               ("bfloat16", False): 1e-2, ("fp8kv", False): 1e-2}


def _attention_case(device, dtype, H, Hkv, D, cap, mask, seed, fp8: bool = False, v_mag: float = 1.0):
    g = torch.Generator(device=device).manual_seed(seed)
    B = 2
    q = torch.randn(B, H, D, device=device, generator=g).to(dtype)
    k = torch.randn(B, Hkv, cap + 1, D, device=device, generator=g).to(dtype)
    v = (torch.randn(B, Hkv, cap + 1, D, device=device, generator=g) * v_mag).to(dtype)
    valid = torch.tensor([cap, (2 * cap) // 3 if seed % 3 else 0], device=device)
    if q.is_cuda:  # never to be read by the kernel (the math path reads them, times p = 0: CPU only)
        for b in range(B):
            k[b, :, int(valid[b]):] = float("nan")
            v[b, :, int(valid[b]):] = float("nan")
    visible = window = qpos = kpos = None
    if "vis" in mask:
        visible = torch.rand(B, cap + 1, device=device, generator=g) < 0.7
    if "win" in mask:
        window = max(1, cap // 5)
        kpos = torch.stack([torch.randperm(cap + 1, device=device, generator=g) for _ in range(B)])
        qpos = torch.full((B,), cap, device=device)
    scales = {}
    if fp8:  # an FP8 cache (a NaN tail quantizes to NaN rows and scales: still never read)
        k, ks, v, vs = quantize_kv(k, v)
        scales = dict(k_scale=ks, v_scale=vs)
    out, lse = shard_attention(q, k, v, D ** -0.5, valid, visible, window, qpos, kpos, **scales)
    if fp8:  # the oracle reads the rows the kernel reads: the dequantized ones
        k, v = dequantize(k, ks, torch.float64), dequantize(v, vs, torch.float64)
    # the oracle: float64, the math path, with the never-read tail zeroed (it multiplies p = 0)
    k64, v64 = k.double().nan_to_num(0.0), v.double().nan_to_num(0.0)
    ro, rl = shard_attention(q.double(), k64, v64, D ** -0.5, valid, visible, window, qpos, kpos)
    seen = torch.isfinite(rl)
    err = float((out.double() - ro.double()).norm() / ro.double().norm().clamp_min(1e-30)) if seen.any() else 0.0
    lse_err = float((lse - rl)[seen].abs().max()) if seen.any() else 0.0
    exact = bool((out[~seen] == 0).all() and (lse[~seen] == float("-inf")).all())
    ok = err <= TOL[dtype] and lse_err <= 1e-3 and exact and not bool(torch.isnan(out).any())
    return dict(dtype=str(dtype)[6:], cache="fp8" if fp8 else str(dtype)[6:], heads=H, kv_heads=Hkv, head_dim=D,
                capacity=cap, mask=mask or "none", v_magnitude=v_mag,
                valid=valid.tolist(), out_err=err, lse_err=lse_err, unseen=int((~seen).sum()), unseen_exact=exact,
                ok=ok)


def check_attention(device) -> list[dict]:
    rows = []
    # ~40K slots: dozens of splits of many tiles (a second on a GPU; the CPU runs the math path
    # on both sides, on small ones)
    caps = (1, 997, 40003) if torch.device(device).type == "cuda" else (1, 97, 403)
    i = 0
    # every mask in bf16, the two extremes in fp16 (each (dtype, D, mask) is one more compile)
    for dtype, masks in ((torch.bfloat16, ("", "vis", "win", "vis+win")), (torch.float16, ("", "vis+win"))):
        for H, Hkv in ((8, 8), (32, 8), (32, 4)):
            for D in (64, 128):
                for mask in masks:
                    rows.append(_attention_case(device, dtype, H, Hkv, D, caps[i % 3], mask, seed=i))
                    i += 1
    # an FP8 cache under bf16 queries: GQA and MHA, every mask, d 128 (against its dequantized rows)
    for H, Hkv in ((32, 8), (8, 8)):
        for mask in ("", "vis", "win", "vis+win"):
            rows.append(_attention_case(device, torch.bfloat16, H, Hkv, 128, caps[i % 3], mask, seed=i, fp8=True))
            i += 1
    # and under fp16 queries with V's rows ~1e-3 (their scales ~1e-5: the kernel must not scale P,
    # which fp16 holds only down to 6e-5, by them)
    for mask in ("", "vis+win"):
        rows.append(_attention_case(device, torch.float16, 32, 8, 128, caps[i % 3], mask, seed=i, fp8=True,
                                    v_mag=1e-3))
        i += 1
    return rows


def _models(device, window: int):
    """float64, float32 and bf16 copies of one small random model (the same weights, rounded);
    its 4 heads, 2 kv heads, ffn 512 and vocabulary 512 split over 2 ranks (tensor parallelism)."""
    args = ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512, ffn_dim=512, window=window)
    m64 = random_llama(args, device, torch.float64, seed=3)
    with torch.no_grad():
        m64.output.weight.mul_(50.0)  # logits ~N(0, 10): greedy choices are far from ties
    m32 = copy.deepcopy(m64).float()
    m16 = copy.deepcopy(m64).to(torch.bfloat16)
    return {k: OurLlama(m, f"check model ({k}, window {window})") for k, m in
            (("float64", m64), ("float32", m32), ("bfloat16", m16))}


def _run(model, prompts, new, **kw):
    """(greedy tokens, every decode step's logits (B, steps, V) float64 on the CPU; None on ranks
    but 0, which see no logits)."""
    seen = []
    out = generate(model, prompts, new, on_logits=lambda i, x: seen.append(x.double().cpu()) if i else None, **kw)
    return out.tokens, (torch.stack(seen, 1) if seen else None)


def _rel_while_same(a, b, tokens_a, tokens_b) -> tuple[float, int]:
    """max |a - b| / max |b| over the decode steps whose context is the same in both runs: row r's
    logits up to its first differing token (a step's logits choose the next token, so they see
    only tokens before it).  After two greedy runs part (bf16 beside float64 can, at a near tie) they score
    different texts, and comparing those logits says nothing.  Returns (error, steps compared)."""
    worst, n = 0.0, 0
    scale = float(b.abs().max())
    for r, (ta, tb) in enumerate(zip(tokens_a, tokens_b)):
        j = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))
        k = min(j, a.shape[1])  # entry k is decode step k + 1, which chose token k + 1
        if k:
            worst = max(worst, float((a[r, :k] - b[r, :k]).abs().max()) / scale)
            n += k
    return worst, n


def check_tokens(device, lengths=(300, 137, 61), new: int = 12, graphs: bool | None = None) -> list[dict]:
    """Every rank of the default group (when one is initialised) runs it: with more than one, the
    decode step over the ranks (the all-gather merge, captured in the graph on CUDA), whole and
    tensor-parallel ("_tp").  ``graphs``: the graph rows too (None: on CUDA)."""
    cuda = torch.device(device).type == "cuda" if graphs is None else graphs
    world = world_of()
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lengths]
    rows = []
    for window in (0, 48):
        models = _models(device, window)
        splits = [False] + ([True] if world > 1 and not refuses(models["float64"].model.args, world) else [])
        # the prefill's attention in float32 / float64 runs in the reference kernel (the fused
        # SDPA kernels take fp16 / bf16 only); the decode step is what is checked
        ref, ref_logits = _run(models["float64"], prompts, new, kernel="reference", graphs="off",
                               tensor_parallel=False)
        got, err, compared, failed = {}, {}, {}, {}

        def vs(name, logits, tokens, base_logits, base_tokens):
            if logits is not None:  # rank 0 compares the logits; every rank the tokens
                err[name], compared[name] = _rel_while_same(logits, base_logits, tokens, base_tokens)

        # (name, model, prefill kernel, KV cache dtype): float32 and bf16 against float64 too; on
        # CUDA an FP8 cache under bf16, whose graph must replay what op by op runs (its error is the tests')
        runs = [("float32", "float32", "reference", None), ("bfloat16", "bfloat16", None, None)]
        runs += [("fp8kv", "bfloat16", None, "fp8")] if cuda else []
        for name, dt, kern, kv in runs:
            for tp in splits:
                d = f"{name}_tp" if tp else name
                got[f"{d}_eager"], eager_logits = _run(models[dt], prompts, new, kernel=kern, graphs="off",
                                                       tensor_parallel=tp, kv_dtype=kv)
                if kv is None:
                    vs(f"{d}_eager vs float64", eager_logits, got[f"{d}_eager"], ref_logits, ref)
                if cuda:
                    try:
                        got[f"{d}_graph"], logits = _run(models[dt], prompts, new, kernel=kern, graphs="on",
                                                         tensor_parallel=tp, kv_dtype=kv)
                    except RuntimeError as e:  # the capture failed (on every rank alike): recorded, a failure
                        failed[f"{d}_graph"] = (str(e).splitlines() or [""])[0][:300]
                        got[f"{d}_graph"] = None
                        continue
                    if kv is None:
                        vs(f"{d}_graph vs float64", logits, got[f"{d}_graph"], ref_logits, ref)
                    vs(f"{d}_graph vs {d}_eager", logits, got[f"{d}_graph"], eager_logits, got[f"{d}_eager"])
        same = {f"{k} == float64": t == ref for k, t in got.items() if k.startswith("float32")}
        if cuda:
            for tp in splits:
                for dt in ("bfloat16", "fp8kv"):
                    d = f"{dt}_tp" if tp else dt
                    same[f"{d}_graph == {d}_eager"] = got[f"{d}_graph"] == got[f"{d}_eager"]
        close = all(v < _LOGITS_TOL[(k.split("_")[0], k.endswith("float64"))] for k, v in err.items())
        # float32 must choose float64's tokens; bf16 is held to its logits while the texts agree
        # (its graph and op-by-op runs to the same tokens), and must agree for at least one step
        some = all(n > 0 for n in compared.values())
        rows.append(dict(window=window, lengths=list(lengths), new_tokens=new, equal=same, logits_err=err,
                         steps_compared=compared, ok=all(same.values()) and close and some and not failed,
                         capture_failed=failed, float64=ref, **got))
    return rows


def _cuda_seconds(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        fn()
    t1.record()
    t1.synchronize()
    return t0.elapsed_time(t1) / 1e3 / reps


def _speed_row(device, cap: int, B: int) -> dict:
    from ...kernels.triton.decode import decode_attention  # imports triton: CUDA only, here

    q = torch.randn(B, 32, 128, device=device, dtype=torch.bfloat16)
    k = torch.randn(B, 8, cap, 128, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    valid = torch.full((B,), cap, device=device)
    vis = torch.ones(B, cap, device=device, dtype=torch.bool)
    nbytes = 2 * k.numel() * k.element_size()
    row = dict(capacity=cap, batch=B, bytes=nbytes)
    k8, ks, v8, vs = quantize_kv(k, v)
    row["fp8_bytes"] = 2 * (k8.numel() + ks.numel() * 4)
    calls = {"triton": lambda: decode_attention(q, k, v, 0.088, valid),
             "triton_masked": lambda: decode_attention(q, k, v, 0.088, valid, vis),
             "triton_fp8": lambda: decode_attention(q, k8, v8, 0.088, valid, k_scale=ks, v_scale=vs)}
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
    if flash is not None:
        calls["torch_flash"] = lambda: flash(q.view(B, 8, 4, 128), k, v, 0.0, False, False, scale=0.088)
    for name, fn in calls.items():
        try:
            sec = _cuda_seconds(fn)
            row[f"{name}_s"], row[f"{name}_GBps"] = sec, row["fp8_bytes" if "fp8" in name else "bytes"] / sec / 1e9
        except RuntimeError as e:
            row[f"{name}_error"] = str(e).splitlines()[0][:200]
    return row


def kernel_speed(device, caps=(32768, 131072), batches=(1, 8)) -> list[dict]:
    """Not a check: the decode attention's time on one layer of Llama-3.1-8B's shape (32 heads,
    8 kv heads, head dim 128, bf16), unmasked and with a visibility mask, as read bandwidth (K and
    V bytes / time), beside torch's fused flash kernel on the same cache where it runs; for
    tuning the kernel, recorded beside the check.  CUDA only."""
    return [_speed_row(device, cap, B) for cap in caps for B in batches if B * cap <= 8 * 32768]


def _everywhere(ok: bool, device) -> bool:
    """``ok`` on every rank of the default group (rank 0 alone compares logits)."""
    if world_of() == 1:
        return ok
    import torch.distributed as dist

    t = torch.tensor([int(ok)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def check(device, log=print) -> dict:
    """Both checks on ``device``; ``ok`` is whether every case passed."""
    t0 = time.perf_counter()
    att = check_attention(device)
    bad = [r for r in att if not r["ok"]]
    log(f"check: decode attention, {len(att)} cases vs float64: worst out error "
        f"{max(r['out_err'] for r in att):.1e}, worst lse error {max(r['lse_err'] for r in att):.1e}; "
        f"{'all pass' if not bad else f'{len(bad)} FAIL: {bad[:3]}'}")
    small = torch.device(device).type != "cuda"  # the CPU test's: a few seconds
    tok = check_tokens(device, (61, 37, 13), 5) if small else check_tokens(device)
    for r in tok:
        log(f"check: greedy tokens, window {r['window']}: " +
            ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in r["equal"].items()) + "; logits max rel. error " +
            ", ".join(f"{k} {v:.1e} ({r['steps_compared'][k]} steps)" for k, v in r["logits_err"].items()) +
            "".join(f"; {k}: CAPTURE FAILED: {v}" for k, v in r["capture_failed"].items()))
    ok = _everywhere(not bad and all(r["ok"] for r in tok), device)
    log(f"check {'PASSED' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f}s")
    out = dict(ok=ok, attention=att, tokens=tok, seconds=time.perf_counter() - t0)
    if torch.device(device).type == "cuda":
        try:  # a measurement beside the check: it never stops the run
            speed = kernel_speed(device)
        except Exception as e:  # noqa: BLE001
            speed = [dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")]
            log(f"decode attention timing failed: {speed[0]['error']}")
        out["kernel_speed"] = speed
        for r in speed:
            if "capacity" not in r:
                continue
            times = [f"{n} {r[n + '_s'] * 1e6:.0f} us ({r[n + '_GBps']:.0f} GB/s)"
                     for n in ("triton", "triton_masked", "triton_fp8", "torch_flash") if n + "_s" in r]
            log(f"decode attention, one 8B layer, {r['capacity']} slots x batch {r['batch']}: {', '.join(times)}")
    # the check's models took their share of dynamo's recompile limit for the fused ops
    # (model/fused.py): the model measured next compiles them afresh
    torch._dynamo.reset()
    return out
