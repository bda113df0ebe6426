"""`burstengine export`: a training checkpoint -> a Hugging Face model directory.

    burstengine export runs/my-run out/my-model            # the run's latest checkpoint
    burstengine export runs/my-run/checkpoints/step_00000200 out/my-model --dtype bfloat16

Reads the sharded torch.distributed.checkpoint (DCP) that ``burstengine train`` wrote, in one
process on the CPU, whatever the number of GPUs it was trained on, and only the model's entries
(not the optimizer's), one output file at a time, so host memory holds at most one file of
weights (``--max-shard-gb``).  Writes model.safetensors (sharded with an index above that size),
config.json (the architecture, the rope settings the run trained with and
max_position_embeddings = the trained sequence length when it is longer than the model's),
generation_config.json, and the tokenizer files of the ``init`` directory the run started from.
``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` then loads it with the engine's
logits.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings

from ..records import write_record
from .checkpoint import latest
from ..model.hf_dir import DTYPES, SHARD_BYTES, hf_config_from_args, hf_tensors, peak_rss_gib, read_config, \
    shard_plan, write_hf_dir
from ..model import ModelArgs

HELP = "write a training checkpoint as a Hugging Face model directory (config.json + safetensors)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="a run directory (its latest checkpoint) or one checkpoint directory (step_N)")
    p.add_argument("out_dir", help="the HF model directory to write")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="weights' dtype; auto = the init model's (torch_dtype of its config.json), else float32 "
                        "[%(default)s]")
    p.add_argument("--max-shard-gb", type=float, default=5.0,
                   help="largest safetensors file before the weights are split with an index [%(default)s]")
    p.add_argument("--record", metavar="NAME", default=None,
                   help="also write the summary (time, peak host RSS, sizes) as benchmarks/results/NAME.json")


def find_checkpoint(source: str) -> str:
    """The checkpoint directory that ``source`` names (a run directory: its latest one)."""

    if os.path.isfile(os.path.join(source, "meta.json")):
        return source
    found = latest(os.path.join(source, "checkpoints"))
    if found:
        return found
    raise ValueError(f"{source!r} is neither a checkpoint (a directory with meta.json) nor a run directory with a "
                     f"finished checkpoint under checkpoints/ (set save_every to save some)")


def export(source: str, out_dir: str, dtype: str = "auto", max_shard_bytes: int | None = None) -> dict:
    """Write the checkpoint ``source`` names as an HF model directory; returns a summary."""
    import torch
    import torch.distributed.checkpoint as dcp


    t0 = time.perf_counter()
    ckpt = find_checkpoint(source)
    with open(os.path.join(ckpt, "meta.json")) as f:
        meta = json.load(f)
    cfg = meta["config"]
    args = ModelArgs.from_dict(cfg["model"])
    init = cfg.get("init") or ""
    base = read_config(init) if init and os.path.isfile(os.path.join(init, "config.json")) else None
    if dtype == "auto":
        dtype = (base or {}).get("torch_dtype") or (base or {}).get("dtype") or "float32"
        dtype = dtype if dtype in DTYPES else "float32"
    dt = DTYPES[dtype]

    stored = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    # train/checkpoint.py saves {"model": model state dict, "optim": ...}; DCP flattens the keys
    ours = {k[len("model."):]: k for k in stored if k.startswith("model.")}
    want = hf_tensors(args)  # HF name -> the parameters of ours it is made of
    if set(ours) != set(want.ours):
        raise ValueError(f"{ckpt}: its model entries do not match its config's model (missing "
                         f"{sorted(set(want.ours) - set(ours))[:3]}, unexpected "
                         f"{sorted(set(ours) - set(want.ours))[:3]})")
    for name, shape in want.ours.items():
        if tuple(stored[ours[name]].size) != shape:
            raise ValueError(f"{ckpt}: {name} has shape {tuple(stored[ours[name]].size)}, {shape} expected")
    order = sorted(want.parts, key=_hf_order)
    sizes = {hf: math.prod(want.shapes[hf]) * dt.itemsize for hf in order}
    plan = shard_plan(sizes, int(max_shard_bytes or SHARD_BYTES))

    def groups():
        for names in plan:
            state = {}
            for part in (p for hf in names for p in want.parts[hf]):
                key = ours[part.name]
                state[key] = torch.empty(tuple(stored[key].size), dtype=stored[key].properties.dtype)
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, checkpoint_id=ckpt, no_dist=True)  # only these entries are read
            yield {hf: want.join(hf, lambda name: state[ours[name]]).to(dt) for hf in names}

    config = hf_config_from_args(args, seq_len=int(cfg.get("seq_len") or 0), base=base, dtype=dtype)
    info = write_hf_dir(out_dir, config, groups(), len(plan), source_dir=init or None)
    return {"checkpoint": ckpt, "step": meta.get("step"), "out_dir": out_dir, "dtype": dtype,
            "export_s": time.perf_counter() - t0, "peak_rss_gib": peak_rss_gib(),
            "max_position_embeddings": config["max_position_embeddings"],
            "rope_scaling": config["rope_scaling"], **info}


def _hf_order(name: str):
    # embeddings, layers in numeric order, final norm, head (the order transformers writes)
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        return (1, int(parts[2]), name)
    return (0 if "embed" in name else 2 if name.startswith("model.") else 3, 0, name)


def run(args) -> int:
    if not args.max_shard_gb > 0:
        print(f"burstengine export: error: --max-shard-gb must be > 0, got {args.max_shard_gb}", file=sys.stderr)
        return 2
    try:
        res = export(args.source, args.out_dir, args.dtype, int(args.max_shard_gb * 2 ** 30))
    except ValueError as e:
        print(f"burstengine export: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {res['out_dir']} from {res['checkpoint']} (step {res['step']}): {res['files']} safetensors file(s), "
          f"{res['bytes'] / 2 ** 30:.2f} GiB {res['dtype']}, max_position_embeddings {res['max_position_embeddings']}, "
          f"rope_scaling {res['rope_scaling']}, tokenizer files {res['tokenizer_files'] or 'none'}, "
          f"{res['export_s']:.1f}s, peak host RSS {res['peak_rss_gib']:.2f} GiB")
    if args.record:
        print("record:", write_record(args.record, {"kind": "export", **res}))
    return 0
