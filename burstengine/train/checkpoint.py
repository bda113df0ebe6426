"""Checkpoints with torch.distributed.checkpoint: model, optimizer, data position, RNG.

Layout under ``<run_dir>/checkpoints``::

    step_00000100/          a finished checkpoint: DCP shards of model + optimizer,
        meta.json           step, data position, config (written last, by rank 0)
        rng_<rank>.pt       each rank's torch / numpy / python RNG states
    step_00000200.tmp/      a save in progress (or killed): never read

A save writes everything into ``step_N.tmp`` and rank 0 renames it to ``step_N`` only after
every rank has finished, so a job killed mid-save leaves the previous checkpoint as the
latest one.  Model and optimizer state are saved sharded (each rank writes its FSDP shards),
so a run can resume on a different number of ranks (RNG states then start fresh).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def latest(ckpt_dir: str) -> str | None:
    """The newest finished checkpoint in ``ckpt_dir`` (None if there is none)."""
    if not os.path.isdir(ckpt_dir):
        return None
    done = sorted(d for d in os.listdir(ckpt_dir)
                  if _STEP_DIR.match(d) and os.path.exists(os.path.join(ckpt_dir, d, "meta.json")))
    return os.path.join(ckpt_dir, done[-1]) if done else None


def _rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state(st["cuda"])


def save(ckpt_dir: str, step: int, model, optimizer, extra: dict, group=None, keep: int = 2,
         kill_in_save: int | None = None) -> str:
    """Save at ``step`` (the number of steps done); returns the checkpoint's path.  ``kill_in_save``
    (tests): rank 0 SIGKILLs itself inside the save of that step."""
    import torch.distributed.checkpoint as dcp  # heavy: only when a checkpoint is saved
    from torch.distributed.checkpoint.state_dict import get_state_dict  # heavy: only when a checkpoint is saved

    rank = dist.get_rank(group)
    final = os.path.join(ckpt_dir, f"step_{step:08d}")
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save that was killed earlier
        os.makedirs(tmp)
    dist.barrier(group)
    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp, process_group=group)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_{rank}.pt"))
    if kill_in_save == step and rank == 0:
        os.kill(os.getpid(), 9)
    dist.barrier(group)
    if rank == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"step": step, "world": dist.get_world_size(group), **extra}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):  # the same step saved again (after a resume)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(ckpt_dir)
        _prune(ckpt_dir, keep)
    dist.barrier(group)
    return final


def load(path: str, model, optimizer, group=None) -> dict:
    """Load ``path`` into the (sharded) model and optimizer; returns its meta.json."""
    # heavy: only when a checkpoint is loaded
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    msd, osd = get_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path, process_group=group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rng = os.path.join(path, f"rng_{dist.get_rank(group)}.pt")
    if meta.get("world") == dist.get_world_size(group) and os.path.exists(rng):
        _set_rng_state(torch.load(rng, weights_only=False))
    return meta


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(ckpt_dir: str, keep: int) -> None:
    done = sorted(d for d in os.listdir(ckpt_dir) if _STEP_DIR.match(d))
    for d in done[:-keep]:
        shutil.rmtree(os.path.join(ckpt_dir, d), ignore_errors=True)
