"""`burstengine bench finetune`: the pieces of fine-tuning a pretrained model, measured.

    # a random-weight HF directory with Llama-3.1-8B's exact config (weights made on the GPU)
    burstengine bench finetune make --config llama-3.1-8b --out /tmp/l8b --device cuda
    # load it into the FSDP2-sharded model (each rank reads only its rows): time, peak host RSS,
    # peak GPU memory; --save also writes a DCP checkpoint that `burstengine export` reads
    torchrun --nproc_per_node 2 -m burstengine bench finetune load --init /tmp/l8b --save /tmp/l8b-run
    # an exported directory in transformers vs the engine on the same tokens: logits
    burstengine bench finetune compare --model /tmp/l8b-export --seq 8192

Each writes a JSON record (``--record NAME``: NAME.json in $BURST_RESULTS or ./burst-results).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ...model.hf_dir import CONFIGS, peak_rss_gib, write_random_hf_dir
from ...model.hf_dir import load_hf_model as load_hf_llama
from ...train import checkpoint as ckpt
from ...train.config import load as load_config
from ...train.loop import default_device
from ...train.parallel import build_mesh, build_model
from ..launch import init_from_env, under_launcher
from ..records import write_record
from ..tables import Section, device_of, fixed, num, record, table
from ..usage import HelpFormatter, command_parser


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or command_parser("burstengine bench finetune", __doc__)
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("make", formatter_class=HelpFormatter, help="write a random-weight HF model directory of a known config")
    m.add_argument("--config", required=True, help="one of burstengine.model.hf_dir.CONFIGS, or a config.json path")
    m.add_argument("--out", required=True)
    m.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    m.add_argument("--device", default="cpu", help="where the random numbers are drawn (cuda is much faster)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--shard-gb", type=float, default=2.0)
    m.add_argument("--record", default=None)
    ld = sub.add_parser("load", formatter_class=HelpFormatter, help="load an HF directory into the FSDP2-sharded model (under torchrun or alone)")
    ld.add_argument("--init", required=True)
    ld.add_argument("--save", default=None, metavar="RUN_DIR",
                    help="then save it as a step-0 checkpoint of a run in RUN_DIR (for `burstengine export`; "
                         "weights only: a run resumed from it starts a fresh optimizer, as at step 0)")
    ld.add_argument("--seq-len", type=int, default=8192, help="the run's seq_len written with --save")
    ld.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="train config overrides (e.g. model.rope_scaling.factor=16)")
    ld.add_argument("--record", default=None)
    c = sub.add_parser("compare", formatter_class=HelpFormatter, help="transformers vs the engine on one sequence of an HF directory")
    c.add_argument("--model", required=True)
    c.add_argument("--seq", type=int, default=4096)
    c.add_argument("--rows", type=int, default=512, help="positions whose logits are compared (the last ones)")
    c.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    c.add_argument("--record", default=None)
    return p


def _record(name, payload):
    if name:

        print("record:", write_record(name, payload))


def make(args) -> dict:
    if args.config in CONFIGS:
        config = CONFIGS[args.config]
    else:
        with open(args.config) as f:
            config = json.load(f)
    t0 = time.perf_counter()
    info = write_random_hf_dir(args.out, config, seed=args.seed, dtype=args.dtype, device=args.device,
                               max_shard_bytes=int(args.shard_gb * 2 ** 30))
    return {"kind": "make", "config": args.config, "out": args.out, "write_s": time.perf_counter() - t0, **info}


def load(args, group=None) -> dict:
    """``group``: run on a subgroup of an initialised world (tests); None: the whole job, started
    here as a group of one when not under a launcher."""
    import torch
    import torch.distributed as dist


    if group is None and not under_launcher():  # one process: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29531"))
    own = group is None and init_from_env(1800.0)
    try:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        cfg = load_config("tiny", [f"init={args.init}", "cp=1", f"seq_len={args.seq_len}", "progress=false",
                                   *(["out_dir=" + args.save] if args.save else []), *args.overrides])
        device = default_device()
        mesh = build_mesh(world, 1, device, group)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        rss0 = peak_rss_gib()
        dist.barrier(group)
        t0 = time.perf_counter()
        model = build_model(cfg, mesh)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier(group)
        wall = time.perf_counter() - t0
        st = model.load_stats
        mine = torch.tensor([st["peak_rss_gib"], st["read_gib"], st["load_s"],
                             torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else 0.0],
                            dtype=torch.float64, device=device)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=group)
        res = {"kind": "load", "init": args.init, "world": world, "device": device.type, "load_wall_s": wall,
               "load_s_max_rank": mine[2].item(), "peak_host_rss_gib_max_rank": mine[0].item(),
               "host_rss_before_gib": rss0, "read_gib_max_rank": mine[1].item(), "peak_gpu_gib": mine[3].item(),
               "params": cfg.model.num_params(), "param_dtype": str(next(model.parameters()).dtype)}
        if args.save:
            t1 = time.perf_counter()
            path = ckpt.save(os.path.join(cfg.run_dir, "checkpoints"), 0, model, None,
                             {"data": {"next_step": 0, "next_sequence": 0}, "config": cfg.to_dict()},
                             group=group, keep=1)
            res.update(saved=path, save_s=time.perf_counter() - t1)
        return res if rank == 0 else {}
    finally:
        if own:
            dist.destroy_process_group()


def compare(args) -> dict:
    """The exported directory in transformers (sdpa) and in the engine (one GPU, whole sequence):
    logits of the last ``rows`` positions of one random sequence."""
    import torch
    from transformers import AutoModelForCausalLM


    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = getattr(torch, args.dtype)
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dt, attn_implementation="sdpa").to(dev).eval()
    hf_load = time.perf_counter() - t0
    V = hf.config.vocab_size
    ids = torch.randint(0, V, (1, args.seq), generator=torch.Generator().manual_seed(0)).to(dev)
    with torch.no_grad():
        h = hf.model(input_ids=ids, use_cache=False).last_hidden_state[:, -args.rows:]
        ref = hf.lm_head(h).float()
    del hf, h
    torch.cuda.empty_cache() if dev.type == "cuda" else None
    t1 = time.perf_counter()
    ours = load_hf_llama(args.model, dev, dt)
    our_load = time.perf_counter() - t1
    with torch.no_grad():
        h = ours(ids, torch.arange(args.seq, device=dev))[:, -args.rows:]
        got = (h @ ours.head_weight.to(h.dtype).t()).float()
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    return {"kind": "compare", "model": args.model, "seq": args.seq, "rows": args.rows, "dtype": args.dtype,
            "max_rel_err": err, "argmax_agreement": agree, "hf_load_s": hf_load, "engine_load_s": our_load}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        res = {"make": make, "load": load, "compare": compare}[args.what](args)
    except ValueError as e:
        print(f"burstengine bench finetune: error: {e}", file=sys.stderr)
        return 2
    if res:
        print(json.dumps(res, indent=1))
        _record(args.record, res)
    return 0


# --- docs/results.md ----------------------------------------------------------------------------

def render(rec):
    """One line per fine-tuning record, whatever its kind (make / load / train / export / compare)."""
    kind = rec.get("kind") or ("train" if "summary" in rec else "?")
    if kind == "train":
        t, c = rec["summary"], rec["config"]
        cells = [("sequence", c["seq_len"]), ("doc_mask", c.get("doc_mask")), ("steps", t["steps"]),
                 ("tokens/s/GPU", f"{t['mean_tokens_per_s_per_gpu']:,.0f}"), ("step s", fixed(t["mean_step_time_s"], 2)),
                 ("MFU (document-masked FLOPs)", f"{100 * t['mean_mfu']:.1f}%" if t.get("mean_mfu") else "—"),
                 ("peak GiB", fixed(t["peak_mem_gib"], 1)), ("loss first → last", f"{t['first_loss']:.4f} → {t['final_loss']:.4f}")]
    elif kind == "load":
        cells = [("parameters", f"{rec['params'] / 1e9:.2f}B"), ("ranks", rec["world"]),
                 ("load s (slowest rank)", fixed(rec["load_s_max_rank"], 1)),
                 ("GiB read (most by a rank)", fixed(rec["read_gib_max_rank"], 1)),
                 ("peak host RSS GiB", fixed(rec["peak_host_rss_gib_max_rank"], 2)), ("peak GPU GiB", fixed(rec["peak_gpu_gib"], 1))]
    elif kind == "export":
        cells = [("step", rec["step"]), ("dtype", rec["dtype"]), ("GiB", fixed(rec["bytes"] / 2**30, 2)),
                 ("files", rec["files"]), ("export s", fixed(rec["export_s"], 1)),
                 ("peak host RSS GiB", fixed(rec["peak_rss_gib"], 2)),
                 ("max_position_embeddings", rec["max_position_embeddings"])]
    elif kind == "compare":
        cells = [("sequence", rec["seq"]), ("positions compared", rec["rows"]), ("dtype", rec["dtype"]),
                 ("max relative logit error", num(rec["max_rel_err"])), ("argmax agreement", fixed(rec["argmax_agreement"], 3))]
    elif kind == "make":
        cells = [("config", rec["config"]), ("GiB written", fixed(rec["bytes"] / 2**30, 2)), ("files", rec["files"]),
                 ("write s", fixed(rec["write_s"], 1))]
    else:
        raise KeyError(kind)
    return [f"{kind}:", ""] + table([k for k, _ in cells], [[v for _, v in cells]])


def block_finetune_gpu(records):
    """docs/training.md: the fine-tuning path on one H200, from the ft_* records."""
    rows = []
    for S in (65536, 131072):
        t = record(records, f"ft_train_3b_{S}.json")
        e = record(records, f"ft_export_3b_{S}.json")
        c = record(records, f"ft_compare_3b_{S}.json")
        sm = t["summary"]
        rows.append([f"3B, {S // 1024}K, doc_mask", sm["steps"], f"{sm['mean_tokens_per_s_per_gpu']:,.0f}",
                     f"{100 * sm['mean_mfu']:.1f}%", fixed(sm["peak_mem_gib"], 1), "—", fixed(e["export_s"], 1),
                     num(c["max_rel_err"]), fixed(c["argmax_agreement"], 2)])
    ld, ex, c8 = (record(records, n) for n in ("ft_load_8b.json", "ft_export_8b.json", "ft_compare_8b.json"))
    rows.append(["8B, load + save + export", "—", "—", "—", fixed(ld["peak_gpu_gib"], 1),
                 f"{fixed(ld['load_s_max_rank'], 1)} ({fixed(ld['peak_host_rss_gib_max_rank'], 1)} GiB host)",
                 fixed(ex["export_s"], 1), num(c8["max_rel_err"]), fixed(c8["argmax_agreement"], 2)])
    dev = device_of(ld)
    return "\n".join([f"On {dev} (`benchmarks/finetune_h200.sh`; records `ft_*.json`; MFU counts the document-masked "
                      "attention FLOPs; logits of the export in transformers vs the engine, both bf16, on "
                      f"{c['rows']} positions of one random sequence at the trained length, 8K for the 8B):", ""]
                     + table(["run", "steps", "tokens/s/GPU", "MFU", "peak GPU GiB", "load s", "export s",
                              "max rel. logit error", "argmax agreement"], rows))


SECTIONS = (Section("Fine-tuning a pretrained model", r"^ft_", render,
                    "`benchmarks/finetune_h200.sh` (`burstengine bench finetune`, `train --set init=...`, `export`): "
                    "random-weight HF directories with real architectures' configs, loaded sharded, trained with "
                    "packed documents, exported, compared with transformers."),)
BLOCKS = {"finetune-gpu": block_finetune_gpu}
