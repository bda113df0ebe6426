"""`burstengine bench finetune`: the pieces of fine-tuning a pretrained model, measured.

    # a random-weight HF directory with Llama-3.1-8B's exact config (weights made on the GPU)
    burstengine bench finetune make --config llama-3.1-8b --out /tmp/l8b --device cuda
    # load it into the FSDP2-sharded model (each rank reads only its rows): time, peak host RSS,
    # peak GPU memory; --save also writes a DCP checkpoint that `burstengine export` reads
    torchrun --nproc_per_node 2 -m burstengine bench finetune load --init /tmp/l8b --save /tmp/l8b-run
    # an exported directory in transformers vs the engine on the same tokens: logits
    burstengine bench finetune compare --model /tmp/l8b-export --seq 8192

Each writes a JSON record (``--record NAME``: benchmarks/results/NAME.json, or $BURST_RESULTS).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from ..model.hf import CONFIGS, write_random_hf_dir
from ..launch import init_from_env, under_launcher
from ..model.hf import peak_rss_gib
from ..train import checkpoint as ckpt
from ..train.config import load as load_config
from ..train.loop import default_device
from ..train.parallel import build_mesh, build_model
from ..inference.weights import load_hf_llama
from ..records import write_record


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="burstengine bench finetune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    m = sub.add_parser("make", help="write a random-weight HF model directory of a known config")
    m.add_argument("--config", required=True, help="one of burstengine.model.hf.CONFIGS, or a config.json path")
    m.add_argument("--out", required=True)
    m.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    m.add_argument("--device", default="cpu", help="where the random numbers are drawn (cuda is much faster)")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--shard-gb", type=float, default=2.0)
    m.add_argument("--record", default=None)
    ld = sub.add_parser("load", help="load an HF directory into the FSDP2-sharded model (under torchrun or alone)")
    ld.add_argument("--init", required=True)
    ld.add_argument("--save", default=None, metavar="RUN_DIR",
                    help="then save it as a step-0 checkpoint of a run in RUN_DIR (for `burstengine export`; "
                         "weights only: a run resumed from it starts a fresh optimizer, as at step 0)")
    ld.add_argument("--seq-len", type=int, default=8192, help="the run's seq_len written with --save")
    ld.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="train config overrides (e.g. model.rope_scaling.factor=16)")
    ld.add_argument("--record", default=None)
    c = sub.add_parser("compare", help="transformers vs the engine on one sequence of an HF directory")
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
