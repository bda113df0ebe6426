"""The FP8 forward (kernels/fp8.py) on one GPU: correctness, speed beside bf16, and its error in a model.

    burstengine bench fp8 [--stages check,speed,model] [--seqs 8192,32768,131072] [--sweep]

check: ``forward_into`` onto a running state poisoned where it is empty, and the plain forward, for
every mask kind, head dims 64/128, GQA 1-8 and lengths that divide nothing, against float64 and
against the same quantization done in torch (kernels/fp8.emulate; the plain forward of a block of
at most one tile rounds P exactly as it does).
speed: the plain forward at each length, causal and full, 32 q / 8 kv heads, d=128 (Llama-3.1-8B's
attention), bf16 inputs: cuDNN, ours in bf16 (kernel "triton": the Gluon forward on Hopper), FP8 with
its quantization of Q, K and V, and the FP8 kernel alone; TFLOP/s (dense bf16 peak 989, FP8 1979).
``--sweep`` first times tile shapes of the FP8 kernel at the middle length and keeps the fastest.
model: Llama-3.1-8B's shape cut to ``--layers`` layers, random weights, in float64 and in bf16: the
prefill's next-token logits of a ``--model-seq``-token prompt with bf16 attention ("auto") and with
FP8 attention, each against float64's; then ``--new`` greedy tokens after it (only the prefill
differs between the two bf16 runs: decoding reads the same bf16 cache kernel).
Writes fp8_<gpu>.json (--name) to --out-dir.
"""
from __future__ import annotations

import copy
import statistics

import torch

from ...inference import generate, prefill
from ...inference.models import OurLlama, random_llama
from ...kernels import KERNELS
from ...kernels.fp8 import Fp8Kernel, emulate
from ...kernels.triton.kernel import Tiles
from ...kernels.verify import run_forward_case
from ...masks import CAUSAL, FULL, STRICT, MaskSpec
from ...model import PRESETS
from ...testing import fro_err
from ...timing import timed
from ..records import OUT_DIR_HELP, write_record
from ..tables import Section, device_of, num, record, table
from ..usage import command_parser

def _masks(S: int):
    g = torch.Generator().manual_seed(S)
    lens = (torch.rand(S // 50 + 2, generator=g) * 300).long() + 1
    docs = torch.repeat_interleave(torch.arange(lens.numel()), lens)[:S]
    bm = torch.rand(-(-S // 128), -(-S // 128), generator=g) < 0.5
    return {"full": FULL, "causal": CAUSAL, "strict": STRICT, "window": MaskSpec(causal=True, window=300),
            "docs": MaskSpec(causal=True, q_doc=docs, k_doc=docs), "block": MaskSpec(block_mask=bm, block_size=128)}


def check(device) -> list[dict]:
    kern = Fp8Kernel()
    rows = []
    for i, (S, D, hkv) in enumerate([(1000, 128, 8), (1024, 64, 2), (777, 128, 1), (1536, 128, 4)]):
        for name, mask in _masks(S).items():
            def oracle(q, k, v, scale, m):
                return emulate(kern.quantize(q, k, v), scale, m, q.shape[1], k.shape[1])

            r = run_forward_case(kern, 1 + i % 2, S, S, 8, hkv, D, torch.bfloat16, mask, device, seed=i,
                                 oracle=oracle)
            q = torch.empty(1, S, 8, D, device=device, dtype=torch.bfloat16)
            rows.append(dict(r, case=f"{name}-d{D}-gqa{8 // hkv}-S{S}", triton=kern.runs_triton(q, q, q, mask)))
    # the plain forward of one tile's worth of keys: no running maximum, P rounds as the emulation's
    g = torch.Generator().manual_seed(7)
    for mask in (FULL, CAUSAL):
        q, k, v = (torch.randn(2, 128, h, 128, generator=g).to(device, torch.bfloat16) for h in (8, 2, 2))
        o, lse = kern.forward(q, k, v, 128 ** -0.5, mask)
        eo, el = emulate(kern.quantize(q, k, v), 128 ** -0.5, mask, 128, 128)
        ro, rl = KERNELS["reference"].forward(q.double(), k.double(), v.double(), 128 ** -0.5, mask)
        rows.append(dict(case=f"plain-one-tile-{mask}", out=fro_err(o, ro), lse=fro_err(lse, rl),
                         out_oracle=fro_err(o.float(), eo), lse_oracle=fro_err(lse, el), nan=False,
                         triton=kern.runs_triton(q, k, v, mask)))
    return rows


def _inputs(S, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    return tuple(torch.randn(1, S, h, 128, device=device, dtype=torch.bfloat16, generator=g) for h in (32, 8, 8))


SWEEP = [Tiles(128, 128, 8, 3, tma=True), Tiles(128, 128, 8, 4, tma=True), Tiles(128, 64, 8, 3, tma=True),
         Tiles(128, 64, 4, 3, tma=True), Tiles(64, 128, 4, 3, tma=True)]


def sweep(S, device) -> tuple[list[dict], Tiles]:
    q, k, v = _inputs(S, device)
    rows = []
    for t in SWEEP:
        kern = Fp8Kernel(tiles={128: t})
        fp = kern.quantize(q, k, v)
        out = torch.empty_like(q)
        lse = torch.empty(1, 32, S, device=device)
        for mask in (CAUSAL, FULL):
            try:
                raw = timed(lambda: kern._triton.launch_forward(fp.q8, fp.k8, fp.vt8, 128 ** -0.5, mask, out, lse,
                                                                True, t, fp), device, warmup=2, iters=5)
            except Exception as e:  # a shape that does not build (shared memory, registers) is a row too
                rows.append(dict(tiles=t.__dict__, mask=mask, error=f"{type(e).__name__}: {str(e)[:200]}"))
                continue
            rows.append(dict(tiles=t.__dict__, mask=mask, raw=raw, s=statistics.median(raw)))
            print(f"[bench fp8] sweep {t} {mask}: {statistics.median(raw) * 1e3:.2f} ms", flush=True)
    ok = [r for r in rows if "s" in r]
    best = min(SWEEP, key=lambda t: sum(r["s"] for r in ok if r["tiles"] == t.__dict__)
               if sum(r["tiles"] == t.__dict__ for r in ok) == 2 else float("inf"))
    return rows, best


def speed(seqs, device, tiles: Tiles | None) -> list[dict]:
    fp8 = Fp8Kernel(tiles=None if tiles is None else {128: tiles, 64: tiles})
    ours = KERNELS["triton"]
    cudnn = KERNELS["cudnn"]
    rows = []
    for S in seqs:
        q, k, v = _inputs(S, device)
        fp = fp8.quantize(q, k, v)
        out = torch.empty_like(q)
        lse = torch.empty(1, 32, S, device=device)
        for mask in (CAUSAL, FULL):
            flops = 4 * 32 * S * S * 128 * (0.5 if mask == CAUSAL else 1.0)
            t = fp8.tiles[128]
            runs = {"cudnn": lambda: cudnn.forward(q, k, v, 128 ** -0.5, mask),
                    "ours_bf16": lambda: ours.forward(q, k, v, 128 ** -0.5, mask),
                    "fp8": lambda: fp8.forward(q, k, v, 128 ** -0.5, mask),
                    "fp8_kernel": lambda: fp8._triton.launch_forward(fp.q8, fp.k8, fp.vt8, 128 ** -0.5, mask, out,
                                                                     lse, True, t, fp),
                    "quantize": lambda: fp8.quantize(q, k, v)}
            row = dict(S=S, mask=mask, flops=flops)
            for name, fn in runs.items():
                raw = timed(fn, device, warmup=2, iters=5)
                row[name] = dict(raw=raw, s=statistics.median(raw))
                if name != "quantize":
                    row[name]["tflops"] = flops / row[name]["s"] / 1e12
            row["fp8_vs_cudnn"] = row["cudnn"]["s"] / row["fp8"]["s"]
            row["fp8_vs_ours_bf16"] = row["ours_bf16"]["s"] / row["fp8"]["s"]
            rows.append(row)
            print(f"[bench fp8] S={S} {mask}: cuDNN {row['cudnn']['tflops']:.0f}, ours bf16 "
                  f"{row['ours_bf16']['tflops']:.0f}, fp8 {row['fp8']['tflops']:.0f} (kernel alone "
                  f"{row['fp8_kernel']['tflops']:.0f}) TFLOP/s; quantize {row['quantize']['s'] * 1e3:.2f} ms",
                  flush=True)
        del q, k, v, fp, out, lse
        torch.cuda.empty_cache()
    return rows


def _same_prefix(a, b) -> int:
    """How many tokens two greedy runs chose alike before they first differ."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def model_error(device, layers: int, S: int, new: int, seed: int = 0, preset: str = "llama-8b") -> dict:
    args = copy.deepcopy(PRESETS[preset])
    args.n_layers = layers
    raw = random_llama(args, device, torch.float64, seed)
    m64, m16 = OurLlama(raw, preset), OurLlama(copy.deepcopy(raw).to(torch.bfloat16), preset)
    ids = torch.randint(0, args.vocab_size, (1, S), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ref = prefill(m64, ids.to(device), kernel="reference").logits.double()
        res = dict(preset=preset, layers=layers, S=S, new=new)
        for name, kernel in (("bf16", None), ("fp8", "fp8")):
            got = prefill(m16, ids.to(device), kernel=kernel).logits.double()
            top = ref.topk(10, -1).indices
            res[name] = dict(logits_rel_err=fro_err(got, ref), top1_same=bool((got.argmax(-1) == ref.argmax(-1)).all()),
                             top10_overlap=len(set(got.topk(10, -1).indices[0].tolist()) & set(top[0].tolist())))
        toks = {}
        for name, model, kernel in (("float64", m64, "reference"), ("bf16", m16, None), ("fp8", m16, "fp8")):
            try:
                toks[name] = generate(model, ids.to(device), new, kernel=kernel).tokens[0]
            except Exception as e:  # float64 decoding may not run everywhere: say so in the record
                res[f"generate_{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        for name, t in toks.items():
            res.setdefault(name, {})["tokens"] = [int(x) for x in t]
        base = toks.get("float64")
        for name in ("bf16", "fp8"):
            if base is not None and name in toks:
                res[name]["tokens_same_prefix"] = _same_prefix(toks[name], base)
        if "bf16" in toks and "fp8" in toks:
            res["fp8_vs_bf16_same_prefix"] = _same_prefix(toks["bf16"], toks["fp8"])
    return res


def main(argv=None):
    ap = command_parser("burstengine bench fp8", __doc__)
    ap.add_argument("--stages", default="check,speed,model")
    ap.add_argument("--seqs", default="8192,32768,131072")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--model-seq", type=int, default=16384)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--name", default=None)
    ap.add_argument("--out-dir", default=None, help=OUT_DIR_HELP)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.exit(2, "burstengine bench fp8: needs a CUDA GPU\n")
    device = torch.device("cuda")
    stages = args.stages.split(",")
    rec = dict(stages=stages)
    if "check" in stages:
        rec["check"] = check(device)
        worst = max(rec["check"], key=lambda r: r["out"])
        print(f"[bench fp8] check: {len(rec['check'])} cases, worst out {worst['out']:.4f} ({worst['case']}), "
              f"worst vs emulation {max(r['out_oracle'] for r in rec['check']):.4f}, "
              f"NaN in {sum(r['nan'] for r in rec['check'])}", flush=True)
    tiles = None
    seqs = [int(s) for s in args.seqs.split(",")]
    if args.sweep:
        rec["sweep"], tiles = sweep(seqs[len(seqs) // 2], device)
        rec["tiles"] = tiles.__dict__
        print(f"[bench fp8] sweep: {tiles}", flush=True)
    if "speed" in stages:
        rec["speed"] = speed(seqs, device, tiles)
    if "model" in stages:
        rec["model"] = model_error(device, args.layers, args.model_seq, args.new)
        print(f"[bench fp8] model: {rec['model']}", flush=True)
    name = args.name or "fp8_" + torch.cuda.get_device_name().split()[1].lower()
    print("wrote", write_record(name, rec, args.out_dir))


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec) -> list[str]:
    if not rec.get("speed"):
        return ["(no speed rows)", ""]
    return table(["S", "mask", "cuDNN bf16", "ours bf16", "FP8 (with quantization)", "FP8 kernel alone",
                          "FP8 / cuDNN", "quantize ms"],
                         [[r["S"], r["mask"], num(r["cudnn"]["tflops"], 3), num(r["ours_bf16"]["tflops"], 3),
                           num(r["fp8"]["tflops"], 3), num(r["fp8_kernel"]["tflops"], 3), f"{r['fp8_vs_cudnn']:.2f}×",
                           f"{r['quantize']['s'] * 1e3:.2f}"] for r in rec["speed"]])


SECTIONS = (Section("FP8 forward", r"^fp8_", render,
                    "`burstengine bench fp8`: the plain attention forward in TFLOP/s (bf16 inputs, 32 q / 8 kv "
                    "heads, d=128), one GPU."),)


def block_fp8(records):
    """docs/kernels.md: speed and checks (fp8_h100_final.json), the model's error (fp8_h100.json), the
    1M-token prompt over 4 GPUs (prefill_8b_4gpu_1m_fp8.json), and all three stages on H200 (fp8_h200.json)."""
    sp = record(records, "fp8_h100_final.json")
    md = record(records, "fp8_h100.json")
    pf = record(records, "prefill_8b_4gpu_1m_fp8.json")
    chk = sp["check"]
    m = md["model"]
    rows = {r["method"]: r for r in pf["rows"]}
    b, f, t = (rows[n]["median_s"] for n in ("burst", "burst-fp8", "torch-cp"))
    return "\n".join([
        f"On {device_of(sp)} (`fp8_h100_final.json`, commit {sp['commit'][:7]}; bf16 inputs, 32 q / 8 kv heads, "
        f"d=128, TFLOP/s of the plain forward, median of 5; FP8 includes quantizing Q, K and V):",
        "", *render(sp),
        f"The check of the same launch: {len(chk)} cases (every mask kind, d 64/128, GQA 1-8, lengths that divide "
        f"nothing), worst normwise error {max(r['out'] for r in chk):.3f} against float64 "
        f"({max(r['out_oracle'] for r in chk):.3f} against the torch emulation of the same quantization), "
        f"{sum(r['nan'] for r in chk)} with NaN.",
        "",
        f"In a model (`fp8_h100.json`): Llama-3.1-8B's shape cut to {m['layers']} layers, random weights, a "
        f"{m['S']:,}-token prompt; next-token logits against the float64 model: bf16 attention "
        f"{m['bf16']['logits_rel_err']:.3f}, FP8 attention {m['fp8']['logits_rel_err']:.3f} (normwise; top-10 "
        f"tokens shared with float64's: {m['bf16']['top10_overlap']} and {m['fp8']['top10_overlap']}); of "
        f"{m['new']} greedy tokens after the prompt, bf16 and FP8 chose the same first "
        f"{m['fp8_vs_bf16_same_prefix']}, both the same first {m['bf16']['tokens_same_prefix']} as float64.",
        "",
        f"A 1M-token prompt of llama-3.1-8b over {pf['world']} GPUs (`prefill_8b_4gpu_1m_fp8.json`, each method's "
        f"first call at 1M in one launch): burst {b:.1f} s, burst on the FP8 forward {f:.1f} s, torch-CP {t:.1f} s "
        f"(FP8 {t / f:.2f}× torch-CP, bf16 burst {t / b:.2f}×); FP8's logits differ from bf16 burst's by "
        f"{rows['burst-fp8']['logits_rel_diff_vs_burst']:.3f}.",
        "", *_h200(record(records, "fp8_h200.json")),
    ])


def _h200(rec) -> list[str]:
    # the same three stages in one launch on the other Hopper card
    chk, m = rec["check"], rec["model"]
    return [f"On {device_of(rec)} (`fp8_h200.json`, commit {rec['commit'][:7]}; the check, speed and model stages "
            "of one launch):", "", *render(rec),
            f"Its check: {len(chk)} cases, worst normwise error {max(r['out'] for r in chk):.3f} against float64, "
            f"{sum(r['nan'] for r in chk)} with NaN. Its model: logits against float64 bf16 "
            f"{m['bf16']['logits_rel_err']:.3f}, FP8 {m['fp8']['logits_rel_err']:.3f}; bf16 and FP8 chose the same "
            f"first {m['fp8_vs_bf16_same_prefix']} of {m['new']} greedy tokens, both the same first "
            f"{m['bf16']['tokens_same_prefix']} as float64."]


BLOCKS = {"fp8": block_fp8}
