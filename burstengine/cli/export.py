"""`burstengine export`: a training checkpoint -> a Hugging Face model directory.

    burstengine export runs/my-run out/my-model            # the run's latest checkpoint
    burstengine export runs/my-run/checkpoints/step_00000200 out/my-model --dtype bfloat16

Reads the sharded torch.distributed.checkpoint (DCP) that ``burstengine train`` wrote, in one
process on the CPU, whatever the number of GPUs it was trained on, and only the model's entries
(not the optimizer's), one output file at a time, so host memory holds at most one file of
weights (``--max-shard-gb``).  Writes model.safetensors (sharded with an index above that size),
config.json (the architecture, the rope settings the run trained with and
max_position_embeddings = the trained sequence length when it is longer than the model's),
generation_config.json, and the tokenizer the run trained with (its ``tokenizer=``, else the
``init`` directory's).  ``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` then loads
it with the engine's logits.

The checkpoint is verified first against the SHA-256s recorded at save, as ``train --resume``
does: a damaged newest checkpoint of a run falls back to the newest intact one (said in a
note), a damaged checkpoint named directly is refused.  OUT_DIR is written whole or not at all
(a temporary directory beside it, swapped in at the end: a killed export leaves an earlier one
intact); one holding anything but an earlier export needs --overwrite.

A LoRA run (``lora.rank`` > 0) exports as the base (``init``) with its adapters merged in, or with
``--adapter`` as a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) that
``peft.PeftModel.from_pretrained(base, OUT_DIR)`` loads onto the base with the merged export's
logits::

    burstengine export runs/my-lora-run out/my-adapter --adapter
"""
from __future__ import annotations

import argparse
import os
import sys

from ..bench.records import write_record
from ..train.export import export, export_adapter

HELP = "write a training checkpoint as a Hugging Face model directory (config.json + safetensors)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("source", help="a run directory (its latest checkpoint) or one checkpoint directory (step_N)")
    p.add_argument("out_dir", help="the HF model directory to write")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="weights' dtype; auto = the init model's (torch_dtype of its config.json), else float32 "
                        "[%(default)s]")
    p.add_argument("--max-shard-gb", type=float, default=5.0,
                   help="largest safetensors file before the weights are split with an index [%(default)s]")
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run: write its adapters as a PEFT adapter directory instead of the merged model "
                        "(--dtype auto = float32 here)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an out_dir that holds something other than an earlier export (it is replaced whole; "
                        "with --adapter: write into it)")
    p.add_argument("--record", metavar="NAME", default=None,
                   help="also write the summary (time, peak host RSS, sizes) as a JSON record NAME.json in $BURST_RESULTS or "
                        "./burst-results (a numbered name if that exists)")


def _out_dir_error(out_dir: str, overwrite: bool) -> str | None:
    """A message when ``out_dir`` is a file, or a folder with files in it and not ``overwrite``
    (as train asks before writing into a run's folder)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        return f"{out_dir!r} is a file, not a folder"
    held = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    if held and not overwrite:
        more = f" and {len(held) - 3} more" if len(held) > 3 else ""
        return f"{out_dir!r} is not empty (it holds {', '.join(held[:3])}{more}); --overwrite writes into it anyway"
    return None


def run(args) -> int:
    if not args.max_shard_gb > 0:
        print(f"burstengine export: error: --max-shard-gb must be > 0, got {args.max_shard_gb}", file=sys.stderr)
        return 2
    msg = _out_dir_error(args.out_dir, args.overwrite) if args.adapter else None  # export() checks its own
    if msg:
        print(f"burstengine export: error: {msg}", file=sys.stderr)
        return 2
    try:
        if args.adapter:
            res = export_adapter(args.source, args.out_dir, "float32" if args.dtype == "auto" else args.dtype)
        else:
            res = export(args.source, args.out_dir, args.dtype, int(args.max_shard_gb * 2 ** 30),
                         overwrite=args.overwrite,
                         say=lambda line: print(f"burstengine export: note: {line}", file=sys.stderr))
    except (ValueError, OSError) as e:  # OSError: a file of a checkpoint that lists none (older ones), a full disk
        print(f"burstengine export: error: {e}", file=sys.stderr)
        return 2
    if args.adapter:
        print(f"wrote the PEFT adapter {res['out_dir']} from {res['checkpoint']} (step {res['step']}): "
              f"{res['tensors']} tensors, {res['bytes'] / 2 ** 20:.2f} MiB {res['dtype']}, target modules "
              f"{','.join(res['target_modules'])}, base {res['base_model']}, {res['export_s']:.1f}s")
    else:
        print(f"wrote {res['out_dir']} from {res['checkpoint']} (step {res['step']}): {res['files']} safetensors "
              f"file(s), {res['bytes'] / 2 ** 30:.2f} GiB {res['dtype']}, max_position_embeddings "
              f"{res['max_position_embeddings']}, rope_scaling {res['rope_scaling']}, tokenizer files "
              f"{res['tokenizer_files'] or 'none'}, {res['export_s']:.1f}s, peak host RSS {res['peak_rss_gib']:.2f} GiB"
              f"{' (LoRA adapters merged)' if res['lora'] else ''}")
    if args.record:
        print("record:", write_record(args.record, {"kind": "export", **res}))
    return 0
