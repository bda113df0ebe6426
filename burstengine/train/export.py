"""A training checkpoint -> a Hugging Face model directory: what `burstengine export` runs
(burstengine/cli/export.py, whose help says what it writes).  The sharded DCP checkpoint is read
in one process on the CPU, model entries only, one output file of weights at a time."""
from __future__ import annotations

import math
import os
import time
import warnings
from contextlib import contextmanager

from .checkpoint import ONE_PROCESS, finished, newest_intact, read_meta, verify
from .diskfull import full_disk
from .swapdir import refusal, replacing
from ..model.hf_dir import DTYPES, SHARD_BYTES, hf_config_from_args, hf_tensors, peak_rss_gib, read_config, \
    shard_plan, write_hf_dir
from ..model import ModelArgs


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


def export(source: str, out_dir: str, dtype: str = "auto", max_shard_bytes: int | None = None,
           overwrite: bool = False, say=None) -> dict:
    """Write the checkpoint ``source`` names as an HF model directory; returns a summary.  The
    directory is written whole or not at all (train/swapdir.py: an ``out_dir`` holding anything
    but an earlier export needs ``overwrite``); ``say(line)`` hears about skipped checkpoints."""
    import torch
    import torch.distributed.checkpoint as dcp


    t0 = time.perf_counter()
    problem = refusal(out_dir, overwrite)  # before any reading
    if problem:
        raise ValueError(problem)
    ckpt = find_checkpoint(source, say)
    if os.path.realpath(ckpt).startswith(os.path.join(os.path.realpath(out_dir), "")):
        raise ValueError(f"out_dir {out_dir} holds the checkpoint {ckpt} being exported: name another directory")
    meta = read_meta(ckpt)
    cfg = meta["config"]
    args = ModelArgs.from_dict(cfg["model"])
    init = cfg.get("init") or ""
    base = read_config(init) if init and os.path.isfile(os.path.join(init, "config.json")) else None
    if dtype == "auto":
        dtype = (base or {}).get("torch_dtype") or (base or {}).get("dtype") or "float32"
        dtype = dtype if dtype in DTYPES else "float32"
    dt = DTYPES[dtype]

    with unreadable(ckpt):  # a checkpoint saved before checksums has only DCP's own checks
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
            with warnings.catch_warnings(), unreadable(ckpt):  # "assuming ... a single process": it is
                warnings.simplefilter("ignore", UserWarning)
                dcp.load(state, checkpoint_id=ckpt, no_dist=True)  # only these entries are read
            yield {hf: want.join(hf, lambda name: state[ours[name]]).to(dt) for hf in names}

    config = hf_config_from_args(args, seq_len=int(cfg.get("seq_len") or 0), base=base, dtype=dtype)
    with replacing(out_dir, overwrite, note={"checkpoint": os.path.abspath(ckpt), "step": meta.get("step")}) as tmp:
        info = write_hf_dir(tmp, config, groups(), len(plan), source_dir=init or None)
    return {"checkpoint": ckpt, "step": meta.get("step"), "out_dir": out_dir, "dtype": dtype,
            "export_s": time.perf_counter() - t0, "peak_rss_gib": peak_rss_gib(),
            "max_position_embeddings": config["max_position_embeddings"],
            "rope_scaling": config["rope_scaling"], **info}


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
