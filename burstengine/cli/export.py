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

The checkpoint is verified first against the SHA-256s recorded at save, as ``train --resume``
does: a damaged newest checkpoint of a run falls back to the newest intact one (said in a
note), a damaged checkpoint named directly is refused.  OUT_DIR is written whole or not at all
(a temporary directory beside it, swapped in at the end: a killed export leaves an earlier one
intact); one holding anything but an earlier export needs --overwrite.
"""
from __future__ import annotations

import argparse
import sys

from ..bench.records import write_record
from ..train.export import export

HELP = "write a training checkpoint as a Hugging Face model directory (config.json + safetensors)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="a run directory (its latest checkpoint) or one checkpoint directory (step_N)")
    p.add_argument("out_dir", help="the HF model directory to write")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="weights' dtype; auto = the init model's (torch_dtype of its config.json), else float32 "
                        "[%(default)s]")
    p.add_argument("--max-shard-gb", type=float, default=5.0,
                   help="largest safetensors file before the weights are split with an index [%(default)s]")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an out_dir that holds something other than an earlier export (it is replaced whole)")
    p.add_argument("--record", metavar="NAME", default=None,
                   help="also write the summary (time, peak host RSS, sizes) as benchmarks/results/NAME.json")


def run(args) -> int:
    if not args.max_shard_gb > 0:
        print(f"burstengine export: error: --max-shard-gb must be > 0, got {args.max_shard_gb}", file=sys.stderr)
        return 2
    try:
        res = export(args.source, args.out_dir, args.dtype, int(args.max_shard_gb * 2 ** 30), overwrite=args.overwrite,
                     say=lambda line: print(f"burstengine export: note: {line}", file=sys.stderr))
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
