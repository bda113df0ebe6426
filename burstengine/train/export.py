"""A training checkpoint -> a Hugging Face model directory: what `burstengine export` runs
(burstengine/cli/export.py, whose help says what it writes).  The sharded DCP checkpoint is read
in one process on the CPU, model entries only, one output file of weights at a time.

A LoRA run's checkpoint holds its adapters only: :func:`export` merges them into the base (read
again from ``init``, or drawn again from the seed on the CPU, in the dtype it trained in) and
writes the whole model; :func:`export_adapter` writes them as a PEFT adapter directory
(``adapter_config.json`` + ``adapter_model.safetensors``, named as PEFT names them under the
family's HF modules) that ``peft.PeftModel.from_pretrained(base, OUT_DIR)`` loads onto the base.
"""
from __future__ import annotations

import json
import math
import os
import time
import warnings
from contextlib import contextmanager

from .checkpoint import ONE_PROCESS, finished, newest_intact, read_meta, verify, verify_sizes
from .diskfull import full_disk
from .swapdir import refusal, replacing
from ..model.hf_dir import DTYPES, SHARD_BYTES, hf_config_from_args, hf_tensors, peak_rss_gib, read_config, \
    shard_plan, tensor_files, write_hf_dir
from ..model import ModelArgs, Transformer, lora
from ..model.lora import LoraArgs


def find_checkpoint(source: str, say=None) -> str:
    """The checkpoint directory that ``source`` names (a run directory: its newest intact one,
    saying which newer ones were skipped, as a resume does), verified against the SHA-256s its
    meta.json recorded at save; a ValueError naming the bad file when none is intact."""
    say = say or (lambda msg: None)
    if os.path.isfile(os.path.join(source, "meta.json")):
        problem = verify(source, ONE_PROCESS)
        if problem:
            raise ValueError(f"checkpoint {source} is not intact: {problem}")
        return source
    ckpt_dir = os.path.join(source, "checkpoints")
    found, bad = newest_intact(finished(ckpt_dir), ONE_PROCESS, say, verb="exporting")
    if found:
        return found
    if bad:
        raise ValueError(f"no intact checkpoint in {ckpt_dir} to export ({'; '.join(bad)})")
    raise ValueError(f"{source!r} is neither a checkpoint (a directory with meta.json) nor a run directory with a "
                     f"finished checkpoint under checkpoints/ (set save_every to save some)")


def _read(source: str, say=None):
    """(checkpoint dir, meta.json, its config, ModelArgs, DCP metadata of its entries) of the
    intact checkpoint ``source`` names (:func:`find_checkpoint`)."""
    import torch.distributed.checkpoint as dcp

    ckpt = find_checkpoint(source, say)
    problem = verify_sizes(ckpt)  # a checkpoint saved before checksums: its files' sizes at least
    if problem:
        raise ValueError(f"{problem}: this checkpoint is incomplete; export another one (a step_N folder under its "
                         f"checkpoints/)")
    meta = read_meta(ckpt)
    cfg = meta["config"]
    with unreadable(ckpt):  # a checkpoint saved before checksums has only DCP's own checks
        stored = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
    return ckpt, meta, cfg, ModelArgs.from_dict(cfg["model"]), stored


def _load(ckpt: str, stored, keys) -> dict:
    """The DCP entries ``keys`` of checkpoint ``ckpt`` (only these are read)."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = {k: torch.empty(tuple(stored[k].size), dtype=stored[k].properties.dtype) for k in keys}
    with warnings.catch_warnings(), unreadable(ckpt):  # "assuming ... a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=ckpt, no_dist=True)
    return state


def _lora_of(cfg: dict, args, ckpt: str, stored):
    """(LoraArgs, {adapter name: shape}) of a LoRA run's checkpoint (None, {} otherwise), its
    adapters checked against what the config makes."""
    import torch

    spec = LoraArgs(**(cfg.get("lora") or {}))
    if not spec.enabled:
        return None, {}
    with torch.device("meta"):
        m = lora.apply(Transformer(args), spec)
    shapes = {n: tuple(p.shape) for n, p in lora.adapters(m).items()}
    ours = {k[len("model."):] for k in stored if k.startswith("model.")}
    if ours != set(shapes):
        raise ValueError(f"{ckpt}: its model entries are not the adapters its config's lora table makes (missing "
                         f"{sorted(set(shapes) - ours)[:3]}, unexpected {sorted(ours - set(shapes))[:3]})")
    for name, shape in shapes.items():
        if tuple(stored["model." + name].size) != shape:
            raise ValueError(f"{ckpt}: {name} has shape {tuple(stored['model.' + name].size)}, {shape} expected")
    return spec, shapes


def _base(cfg: dict, args, meta: dict, want):
    """``get(names) -> {name: tensor}``: our base parameters of a LoRA run as it trained on them:
    read from ``init`` (only the rows of each part), or drawn from the seed as training drew them,
    in the frozen dtype of its checkpoint."""
    import torch
    from safetensors import safe_open

    frozen = DTYPES.get(meta.get("frozen_dtype", ""), torch.float32)
    init = cfg.get("init") or ""
    if not init:
        model = Transformer(args)
        model.init_weights(int(cfg.get("seed", 0)))
        params = dict(model.named_parameters())
        return lambda names: {n: params[n].detach().to(frozen) for n in names}
    files = tensor_files(init)
    where = {p.name: (hf, p) for hf, ps in want.parts.items() for p in ps}

    def get(names):
        out = {}
        for n in names:
            hf, part = where[n]
            with safe_open(files[hf], framework="pt") as f:
                out[n] = f.get_slice(hf)[part.start:part.start + part.rows].to(frozen)
        return out

    return get


def export(source: str, out_dir: str, dtype: str = "auto", max_shard_bytes: int | None = None,
           overwrite: bool = False, say=None) -> dict:
    """Write the checkpoint ``source`` names as an HF model directory (a LoRA run's: its adapters
    merged into the base); returns a summary.  The directory is written whole or not at all
    (train/swapdir.py: an ``out_dir`` holding anything but an earlier export needs
    ``overwrite``); ``say(line)`` hears about skipped checkpoints."""
    t0 = time.perf_counter()
    problem = refusal(out_dir, overwrite)  # before any reading
    if problem:
        raise ValueError(problem)
    ckpt, meta, cfg, args, stored = _read(source, say)
    if os.path.realpath(ckpt).startswith(os.path.join(os.path.realpath(out_dir), "")):
        raise ValueError(f"out_dir {out_dir} holds the checkpoint {ckpt} being exported: name another directory")
    init = cfg.get("init") or ""
    base = read_config(init) if init and os.path.isfile(os.path.join(init, "config.json")) else None
    if dtype == "auto":
        dtype = (base or {}).get("torch_dtype") or (base or {}).get("dtype") or "float32"
        dtype = dtype if dtype in DTYPES else "float32"
    dt = DTYPES[dtype]

    # train/checkpoint.py saves {"model": model state dict, "optim": ...}; DCP flattens the keys
    ours = {k[len("model."):]: k for k in stored if k.startswith("model.")}
    want = hf_tensors(args)  # HF name -> the parameters of ours it is made of
    spec, adapters = _lora_of(cfg, args, ckpt, stored)
    if spec is None:
        if set(ours) != set(want.ours):
            raise ValueError(f"{ckpt}: its model entries do not match its config's model (missing "
                             f"{sorted(set(want.ours) - set(ours))[:3]}, unexpected "
                             f"{sorted(set(ours) - set(want.ours))[:3]})")
        for name, shape in want.ours.items():
            if tuple(stored[ours[name]].size) != shape:
                raise ValueError(f"{ckpt}: {name} has shape {tuple(stored[ours[name]].size)}, {shape} expected")

        def values(names):
            state = _load(ckpt, stored, [ours[n] for n in names])
            return {n: state[ours[n]] for n in names}
    else:
        base_of = _base(cfg, args, meta, want)

        def values(names):
            pairs = {n: (n[:-len("weight")] + "lora_A.weight", n[:-len("weight")] + "lora_B.weight") for n in names}
            keys = ["model." + a for ab in pairs.values() for a in ab if a in adapters]
            state = _load(ckpt, stored, keys)
            out = base_of(names)
            for n, (a, b) in pairs.items():
                if a in adapters:
                    out[n] = lora.merged(out[n], state["model." + a], state["model." + b], spec.scale)
            return out

    order = sorted(want.parts, key=_hf_order)
    sizes = {hf: math.prod(want.shapes[hf]) * dt.itemsize for hf in order}
    plan = shard_plan(sizes, int(max_shard_bytes or SHARD_BYTES))

    def groups():
        for names in plan:
            state = values([p.name for hf in names for p in want.parts[hf]])
            yield {hf: want.join(hf, lambda name: state[name]).to(dt) for hf in names}

    config = hf_config_from_args(args, seq_len=int(cfg.get("seq_len") or 0), base=base, dtype=dtype)
    # the tokenizer the run trained with (tokenizer=, else init's): the export reads text as it did
    with replacing(out_dir, overwrite, note={"checkpoint": os.path.abspath(ckpt), "step": meta.get("step")}) as tmp:
        info = write_hf_dir(tmp, config, groups(), len(plan), source_dir=init or None,
                            tokenizer=cfg.get("tokenizer") or None)
    return {"checkpoint": ckpt, "step": meta.get("step"), "out_dir": out_dir, "dtype": dtype,
            "export_s": time.perf_counter() - t0, "peak_rss_gib": peak_rss_gib(),
            "max_position_embeddings": config["max_position_embeddings"],
            "rope_scaling": config["rope_scaling"], "lora": spec is not None, **info}


def export_adapter(source: str, out_dir: str, dtype: str = "float32") -> dict:
    """Write a LoRA run's checkpoint ``source`` names as a PEFT adapter directory: its adapters
    under the names PEFT gives them (:func:`burstengine.model.lora.peft_name`) in
    adapter_model.safetensors, and adapter_config.json (rank, alpha, dropout, the HF modules
    targeted, ``init`` as the base model); returns a summary."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    ckpt, meta, cfg, args, stored = _read(source)
    spec, adapters = _lora_of(cfg, args, ckpt, stored)
    if spec is None:
        raise ValueError(f"{ckpt} is not a LoRA run's (lora.rank = 0): export the whole model, without --adapter")
    names = {n: lora.peft_name(args.arch, n) for n in sorted(adapters)}
    state = _load(ckpt, stored, ["model." + n for n in names])
    tensors = {peft: state["model." + n].to(DTYPES[dtype]).contiguous() for n, peft in names.items()}
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    init = cfg.get("init") or None
    alpha = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": alpha,
              "lora_dropout": spec.dropout, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
              "init_lora_weights": True, "use_rslora": False, "use_dora": False, "lora_bias": False,
              "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
              "alpha_pattern": {}, "revision": None, "base_model_name_or_path": init,
              "target_modules": sorted(lora.hf_module(args.arch, t) for t in spec.target_list(args.arch))}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    return {"checkpoint": ckpt, "step": meta.get("step"), "out_dir": out_dir, "dtype": dtype, "adapter": True,
            "tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            "target_modules": config["target_modules"], "base_model": init, "export_s": time.perf_counter() - t0}


@contextmanager
def unreadable(ckpt: str):
    """DCP's errors reading ``ckpt`` (a missing or truncated .metadata or shard) as one ValueError
    naming the checkpoint; a full disk is not this checkpoint's fault and goes up as it is."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException: named to be caught

    try:
        yield
    except (Exception, CheckpointException) as e:
        if isinstance(e, ValueError) or full_disk(e)[0]:
            raise
        text = str(e).strip().splitlines()
        raise ValueError(f"checkpoint {ckpt} could not be read ({type(e).__name__}: "
                         f"{(text[-1] if text else '')[:200]})") from None


def _hf_order(name: str):
    # embeddings, layers in numeric order, final norm, head (the order transformers writes)
    parts = name.split(".")
    if parts[:2] == ["model", "layers"]:
        return (1, int(parts[2]), name)
    return (0 if "embed" in name else 2 if name.startswith("model.") else 3, 0, name)
