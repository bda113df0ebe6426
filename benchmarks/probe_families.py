"""Every model family on the GPU kernels: our bf16 logits beside transformers' (bf16 and float32).

    python3 benchmarks/probe_families.py --seq 8192 --out $OUT/results          # one GPU
    python3 benchmarks/probe_families.py --device cpu --seq 256 --layers 2      # a smoke run here

The CPU suite proves each family against transformers in float64; this probe runs what the CPU
cannot: the families' features (Gemma 3's sliding/full layers, attention scale and two RoPE bases,
Phi-3's LongRoPE past its original context, Qwen's biases and q/k norms, Mistral's window) through
the attention kernels a GPU picks, in bf16.  For each family a random-weight HF directory of its
hub shape cut to ``--layers`` layers is written and read back twice: by transformers in float32
(eager attention: the reference) and in bf16 (SDPA), and by us in bf16.  The record holds
||x - ref|| / ||ref|| of the last position's and of all logits for both, and whether the greedy
next tokens agree; a family passes when our error is at most 2x transformers' bf16 error (+1e-3).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

from burstengine.model import ModelArgs
from burstengine.model.hf_dir import CONFIGS, hf_config_from_args, load_hf_model, write_random_hf_dir

# the hub shapes of the families CONFIGS lacks, as our args (written as each family's config.json)
_EXTRA = {
    "qwen2": dict(arch="qwen2", dim=3584, n_heads=28, n_kv_heads=4, ffn_dim=18944, vocab_size=152064,
                  qkv_bias=True, rope_theta=1e6),
    "qwen3": dict(arch="qwen3", dim=4096, n_heads=32, n_kv_heads=8, head_size=128, ffn_dim=12288,
                  vocab_size=151936, qk_norm=True, rope_theta=1e6),
    "mistral": dict(arch="mistral", dim=4096, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=32768,
                    window=4096),
}


def configs(layers: int, seq: int) -> dict[str, dict]:
    out = {}
    for name, cfg in CONFIGS.items():
        cfg = dict(cfg, num_hidden_layers=layers)
        if "layer_types" in cfg:  # Gemma 3: keep the pattern's first layers (sliding ones, then a full one)
            types = list(cfg["layer_types"])
            cfg["layer_types"] = (types[5:6] + types[:5])[:layers] if layers < 6 else types[:layers]
        if cfg.get("sliding_window"):
            cfg["sliding_window"] = min(cfg["sliding_window"], seq // 4)  # the window bites inside --seq
        out[name] = cfg
    for name, kw in _EXTRA.items():
        a = ModelArgs(n_layers=layers, **kw)
        if a.window:
            a = ModelArgs(n_layers=layers, **dict(kw, window=seq // 4))
        out[name] = hf_config_from_args(a)
    return out


def _err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def run_family(name: str, cfg: dict, seq: int, device: str, seed: int) -> dict:
    from transformers import AutoModelForCausalLM

    row = {"family": name, "model_type": cfg.get("model_type"), "layers": cfg["num_hidden_layers"], "seq": seq}
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        write_random_hf_dir(d, cfg, seed=seed, dtype="bfloat16", device=device)
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, cfg["vocab_size"], (1, seq), generator=g).to(device)
        logits = {}
        for label, dtype, attn in (("ref", torch.float32, "eager"), ("hf_bf16", torch.bfloat16, "sdpa")):
            hf = AutoModelForCausalLM.from_pretrained(d, dtype=dtype, attn_implementation=attn).to(device).eval()
            with torch.no_grad():
                logits[label] = hf(tokens).logits[0].float()
            del hf
        ours = load_hf_model(d, device, torch.bfloat16).eval()
        with torch.no_grad():
            h = ours.hidden(tokens, torch.arange(seq, device=device))
            logits["ours_bf16"] = ours.logits(h)[0].float()
        del ours
        row["seconds"] = round(time.perf_counter() - t0, 2)
    ref = logits["ref"]
    for k in ("hf_bf16", "ours_bf16"):
        row[f"{k}_err"] = _err(logits[k], ref)
        row[f"{k}_last_err"] = _err(logits[k][-1], ref[-1])
        row[f"{k}_argmax_agree"] = float((logits[k].argmax(-1) == ref.argmax(-1)).float().mean())
    row["pass"] = row["ours_bf16_err"] <= 2 * row["hf_bf16_err"] + 1e-3
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--families", default="all", help="comma-separated names (%s)" % ", ".join(configs(2, 64)))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("BURST_RESULTS", "burst-results"))
    p.add_argument("--name", default=None)
    a = p.parse_args(argv)
    cfgs = configs(a.layers, a.seq)
    names = list(cfgs) if a.families == "all" else a.families.split(",")
    bad = [n for n in names if n not in cfgs]
    if bad:
        print(f"probe_families: unknown families {bad}; known: {list(cfgs)}", file=sys.stderr)
        return 2
    rows = []
    for n in names:
        try:
            rows.append(run_family(n, cfgs[n], a.seq, a.device, a.seed))
        except Exception as e:  # one family's failure is a row, not the end of the probe
            rows.append({"family": n, "error": f"{type(e).__name__}: {e}"[:400], "pass": False})
        r = rows[-1]
        print(f"{n:16s} " + ("ERROR " + r["error"] if "error" in r else
              f"ours {r['ours_bf16_err']:.2e} (last {r['ours_bf16_last_err']:.2e}, argmax {r['ours_bf16_argmax_agree']:.3f})"
              f"  hf bf16 {r['hf_bf16_err']:.2e} (argmax {r['hf_bf16_argmax_agree']:.3f})  "
              f"{'pass' if r['pass'] else 'FAIL'}  {r['seconds']} s"), flush=True)
    import transformers

    from burstengine.bench.records import write_record

    path = write_record(a.name or f"probe_families_{a.device}",
                        {"bench": "probe_families", "transformers": transformers.__version__, "seq": a.seq,
                         "layers": a.layers, "rows": rows}, a.out)
    print("record:", path)
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
