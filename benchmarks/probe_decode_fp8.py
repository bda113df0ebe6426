"""Probe: the decode kernel over an FP8 KV cache (kernels/triton/decode.py), its variants timed
beside the bf16 cache on one layer of Llama-3.1-8B's shape (32 q / 8 kv heads, d=128, bf16 q):
how the tiles widen (``widen`` q: to bf16; f16: to fp16 with q and P rescaled), rows per tile
and warps; each variant's output checked against float64 over the dequantized cache first.

    python benchmarks/probe_decode_fp8.py 32768,131072,524288

Writes decode_fp8.json to $OUT (or /tmp).  At 2e8f6b5 on 2xH200 the FP8 cache decoded slower
than bf16 (7.54 vs 6.90 ms/token at 128K; its kernel 165 vs 131 us a layer): this finds why."""
import os
import sys
import time

import torch

from burstengine.inference.kvcache import _math, dequantize, quantize_kv
from burstengine.kernels.triton.decode import decode_attention
from burstengine.timing import median, timed

dev = "cuda"
H, HKV, D, SCALE = 32, 8, 128, 128 ** -0.5
VARIANTS = [dict(widen=w, bn=bn, warps=nw) for w in ("q", "f16") for bn in (64, 128) for nw in (4, 8)]


def main():
    torch.manual_seed(0)
    caps = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "32768,131072,524288").split(",")]
    rows, t0 = [], time.time()
    for cap in caps:
        for B in (1, 8):
            if B * cap > 8 * 131072:
                continue
            q = torch.randn(B, H, D, device=dev, dtype=torch.bfloat16)
            k = torch.randn(B, HKV, cap, D, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            valid = torch.full((B,), cap, device=dev)
            k8, ks, v8, vs = quantize_kv(k, v)
            bf16_bytes, fp8_bytes = 2 * k.numel() * 2, 2 * (k8.numel() + ks.numel() * 4)
            ref = None
            if B * cap <= 131072:  # float64 over the dequantized cache, the math path's
                ref = _math(q.double(), dequantize(k8, ks, torch.float64), dequantize(v8, vs, torch.float64), SCALE,
                            valid, None, None, None, None)[0]
            cands = {"bf16": (lambda: decode_attention(q, k, v, SCALE, valid), bf16_bytes)}
            for var in VARIANTS:
                name = f"fp8 widen={var['widen']} bn={var['bn']} warps={var['warps']}"
                cands[name] = (lambda var=var: decode_attention(q, k8, v8, SCALE, valid, k_scale=ks, v_scale=vs,
                                                                bn=var["bn"], warps=var["warps"],
                                                                widen=var["widen"]), fp8_bytes)
            for name, (fn, nbytes) in cands.items():
                row = dict(capacity=cap, batch=B, kernel=name, bytes=nbytes)
                try:
                    if ref is not None and name != "bf16":
                        out = fn()[0].double()
                        row["out_err"] = float((out - ref).norm() / ref.norm())
                    ts = timed(fn, dev, warmup=3, iters=20)
                    row.update(times=ts, us=median(ts) * 1e6, GBps=nbytes / median(ts) / 1e9)
                    print(f"cap={cap:>7} B={B} {name:<32} {row['us']:8.1f} us {row['GBps']:6.0f} GB/s"
                          + (f"  err {row['out_err']:.2e}" if "out_err" in row else ""), flush=True)
                except Exception as e:  # noqa: BLE001  (a variant that does not build: say so, go on)
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    print(f"cap={cap:>7} B={B} {name:<32} FAILED {row['error']}", flush=True)
                rows.append(row)
            del q, k, v, k8, v8, ks, vs
            torch.cuda.empty_cache()
    from burstengine.bench.records import write_record
    print(write_record("decode_fp8", dict(device=torch.cuda.get_device_name(), rows=rows,
                                          seconds=time.time() - t0), out_dir=os.environ.get("OUT", "/tmp")))


if __name__ == "__main__":
    main()
