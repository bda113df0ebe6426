"""Checkpoints with torch.distributed.checkpoint: model, optimizer, data position, RNG.

Layout under ``<run_dir>/checkpoints``::

    step_00000100/          a finished checkpoint: DCP shards of model + optimizer,
        meta.json           step, data position, config, size + SHA-256 of every other file
                            (written last, by rank 0)
        rng_<rank>.pt       each rank's torch / numpy / python RNG states
    step_00000200.tmp/      a save in progress (or killed): never read

A save writes everything into ``step_N.tmp`` and rank 0 renames it to ``step_N`` only after
every rank has finished, so a job killed mid-save leaves the previous checkpoint as the
latest one.  A resume verifies every file against meta.json first (the ranks share the
hashing) and falls back to the newest intact checkpoint, saying which file was bad, so a flipped,
truncated or deleted shard never becomes the state a run continues from.  Model and optimizer state are saved sharded (each rank writes its FSDP shards),
so a run can resume on a different number of ranks (RNG states then start fresh).  A model with
frozen parameters (LoRA) saves only the trainable ones (the adapters) and their optimizer state:
its base comes from ``init`` (or the seed) again on resume and export.
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

from .digest import file_sha256
from .diskfull import full_disk, nearly_full, no_space

_STEP_DIR = re.compile(r"^step_(\d{8})$")


def finished(ckpt_dir: str) -> list[str]:
    """The finished checkpoints in ``ckpt_dir``, newest first."""
    if not os.path.isdir(ckpt_dir):
        return []
    done = sorted(d for d in os.listdir(ckpt_dir)
                  if _STEP_DIR.match(d) and os.path.exists(os.path.join(ckpt_dir, d, "meta.json")))
    return [os.path.join(ckpt_dir, d) for d in reversed(done)]


def latest(ckpt_dir: str) -> str | None:
    """The newest finished checkpoint in ``ckpt_dir`` (None if there is none)."""
    done = finished(ckpt_dir)
    return done[0] if done else None


# the ``group`` of a check run by this process alone (``burstengine export``, even inside a job)
ONE_PROCESS = "this process alone"


def _alone(group) -> bool:
    """No collective to share the work over: ``ONE_PROCESS``, or no job at all."""
    return group is ONE_PROCESS or (group is None and not dist.is_initialized())


def _share(names: list[str], group) -> list[str]:
    """This rank's share of ``names`` (sorted, dealt round-robin): hashing is split over the ranks."""
    if _alone(group):
        return sorted(names)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return sorted(names)[rank::world]


def _gather(obj, group) -> list:
    if _alone(group):
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _checksums(path: str, group) -> dict:
    """{file name: {"bytes", "sha256"}} of every file of a checkpoint but meta.json."""
    names = [n for n in os.listdir(path) if n != "meta.json"]
    mine = {n: {"bytes": os.path.getsize(os.path.join(path, n)), "sha256": file_sha256(os.path.join(path, n))}
            for n in _share(names, group)}
    return {n: v for part in _gather(mine, group) for n, v in part.items()}


def read_meta(path: str) -> dict:
    """A checkpoint's meta.json; ValueError naming the file when it is unreadable."""
    f = os.path.join(path, "meta.json")
    try:
        with open(f) as fh:
            meta = json.load(fh)
        if not isinstance(meta, dict) or not isinstance(meta.get("step"), int):
            raise ValueError("no integer 'step'")
        return meta
    except (OSError, ValueError) as e:
        raise ValueError(f"{f} is corrupt ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None


def verify(path: str, group=None) -> str | None:
    """None when every file of the checkpoint at ``path`` matches the size and SHA-256 recorded at
    save (or the checkpoint predates checksums), else one line naming the first bad file.  The
    same answer on every rank (each hashes its share, the verdicts are gathered); ``group``
    :data:`ONE_PROCESS`: this process hashes every file, with no collective."""
    try:
        files = read_meta(path).get("files")
        problem = None
    except ValueError as e:
        files, problem = None, str(e)
    if problem is None and files is not None:
        problem = _bad_file(path, files, _share(list(files), group))
    problems = [p for p in _gather(problem, group) if p]
    return min(problems) if problems else None


def verify_sizes(path: str) -> str | None:
    """:func:`verify` in this process alone (no collective: export runs inside any job or none),
    by the sizes recorded at save only: export reads a fraction of the files, and checks that
    none is missing or cut short without reading them all."""
    files = read_meta(path).get("files")
    return _bad_file(path, files, sorted(files), digest=False) if files is not None else None


def _bad_file(path: str, files: dict, names, digest: bool = True) -> str | None:
    """One line about the first of ``names`` that does not match ``files`` (meta.json's record of
    each: bytes, sha256; ``digest=False``: the bytes only), else None."""
    for n in names:
        f = os.path.join(path, n)
        if not os.path.exists(f):
            return f"{f} is missing"
        if os.path.getsize(f) != files[n]["bytes"]:
            return f"{f} has {os.path.getsize(f)} bytes, {files[n]['bytes']} were saved (truncated?)"
        if digest and file_sha256(f) != files[n]["sha256"]:
            return f"{f} does not match its SHA-256 recorded at save (corrupted)"
    return None


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


def _options(model):
    """DCP's state-dict options for ``model``: only the trainable parameters when some are frozen."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=False) if frozen else None


def save(ckpt_dir: str, step: int, model, optimizer, extra: dict, group=None, keep: int = 2,
         kill_in_save: int | None = None) -> str:
    """Save at ``step`` (the number of steps done); returns the checkpoint's path.  ``optimizer``
    None saves the weights only (a step-0 checkpoint for `burstengine export`: an 8B model's AdamW
    moments would triple its size, and at step 0 they are zeros a resume makes afresh).
    ``kill_in_save`` (tests): rank 0 SIGKILLs itself inside the save of that step."""
    import torch.distributed.checkpoint as dcp  # heavy: only when a checkpoint is saved
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None and step != 0:  # the same on every rank, before any collective
        raise ValueError(f"a checkpoint without optimizer state is a step-0 checkpoint; step {step} was asked for")
    rank = dist.get_rank(group)
    final = os.path.join(ckpt_dir, f"step_{step:08d}")
    tmp = final + ".tmp"

    def start():
        os.makedirs(ckpt_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save that was killed earlier
        os.makedirs(tmp)

    opts = _options(model)

    # every write below is followed by one collective that shares its failure: a full disk, on
    # whichever rank, is the same one-line error on every rank, never a rank left waiting
    _shared_write_error(_attempt(start) if rank == 0 else None, tmp, group)  # a barrier too
    if optimizer is None:
        state = {"model": get_model_state_dict(model, options=opts)}
    else:
        msd, osd = get_state_dict(model, optimizer, options=opts)
        state = {"model": msd, "optim": osd}
    try:
        dcp.save(state, checkpoint_id=tmp, process_group=group)  # DCP shares its ranks' failures: all raise
    except CheckpointException as e:
        stopped = [f[0] for f in e.failures.values() if not isinstance(f[0], Exception)]
        if stopped:  # a rank told to stop mid-save (the launcher's SIGTERM on Ctrl-C): no write failed
            raise stopped[0] from None
        _shared_write_error(e, tmp, group, shared=True)
    _shared_write_error(_attempt(lambda: torch.save(_rng_state(), os.path.join(tmp, f"rng_{rank}.pt"))), tmp, group)
    if kill_in_save == step and rank == 0:
        os.kill(os.getpid(), 9)
    files = _checksums(tmp, group)
    # LoRA: the dtype its frozen base trained in, which an export of the adapters merges them into
    frozen = {str(p.dtype).removeprefix("torch.") for p in model.parameters() if not p.requires_grad}

    def publish():
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"step": step, "world": dist.get_world_size(group), "optimizer": optimizer is not None,
                       **extra, **({"frozen_dtype": min(frozen)} if frozen else {}), "files": files}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):  # the same step saved again (after a resume)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(ckpt_dir)
        _prune(ckpt_dir, keep)

    _shared_write_error(_attempt(publish) if rank == 0 else None, tmp, group)  # also the save's last barrier
    return final


def _attempt(write) -> Exception | None:
    """The error of a local write (torch.save's C++ writer raises RuntimeError), None when it worked."""
    try:
        write()
    except (OSError, RuntimeError) as e:
        return e
    return None


def _shared_write_error(exc: BaseException | None, tmp: str, group, shared: bool = False) -> None:
    """Every rank learns of any rank's failed write into the save ``tmp`` (one small all-gather,
    which is also a barrier; none when ``shared``: DCP has told every rank already) and raises
    the same error: a full disk as the one line "no space left on <dir>" (the partial save
    removed, to give the space back), other failures naming the rank.  Returns when no rank
    failed."""
    def summary(e):
        last = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
        return full_disk(e)[0] or nearly_full(tmp), last if last.startswith(type(e).__name__) else \
            f"{type(e).__name__}: {last}"

    if shared:  # CheckpointException: {rank: (exception, traceback)}
        rows = {r: summary(v[0]) for r, v in sorted(exc.failures.items())}
    else:
        rows = dict(enumerate(_gather(None if exc is None else summary(exc), group)))
    bad = [(r, row) for r, row in rows.items() if row is not None]
    if not bad:
        return
    if _alone(group) or dist.get_rank(group) == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if any(full for _, (full, _) in bad):
        raise no_space(os.path.dirname(tmp)) from None
    r, (_, text) = bad[0]
    raise ValueError(f"rank {r} could not write the checkpoint {tmp} ({text})") from None


def load(path: str, model, optimizer, group=None) -> dict:
    """Load ``path`` into the (sharded) model and optimizer; returns its meta.json.  A weights-only
    checkpoint (step 0, see :func:`save`) leaves the optimizer untouched: fresh, as at step 0."""
    # heavy: only when a checkpoint is loaded
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                         set_model_state_dict, set_state_dict)

    meta = read_meta(path)
    weights_only = meta.get("optimizer") is False
    if weights_only and meta.get("step") != 0:  # save() writes none such: a resumed run would lose its moments
        raise ValueError(f"checkpoint {path} holds no optimizer state but says step {meta.get('step')!r}; "
                         "only a step-0 checkpoint may be weights-only")
    opts = _options(model)
    if weights_only:  # not get_state_dict: it would give the fresh optimizer a state (step 1)
        state = {"model": get_model_state_dict(model, options=opts)}
    else:
        msd, osd = get_state_dict(model, optimizer, options=opts)
        state = {"model": msd, "optim": osd}
    try:
        dcp.load(state, checkpoint_id=path, process_group=group)
    except Exception as e:  # DCP's own errors are multi-rank tracebacks; say which checkpoint
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise ValueError(f"checkpoint {path} could not be loaded ({type(e).__name__}: {first})") from None
    if weights_only:
        set_model_state_dict(model, state["model"], options=opts)
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=opts)
    rng = os.path.join(path, f"rng_{dist.get_rank(group)}.pt")
    if meta.get("world") == dist.get_world_size(group) and os.path.exists(rng):
        _set_rng_state(torch.load(rng, weights_only=False))
    return meta


def newest_intact(paths: list[str], group=None, say=print, verb: str = "resuming from") -> tuple[str | None, list[str]]:
    """The first of ``paths`` (checkpoints, newest first) that passes :func:`verify`, saying
    which ones were skipped and why, and "<verb> <path> instead" when one was; (None, ...) when
    none is intact.  Also returns one "<name>: <problem>" per skipped checkpoint.  The same
    answer on every rank of ``group`` (or in one process without a job)."""
    bad = []
    for path in paths:
        problem = verify(path, group)
        if problem is None:
            if bad:
                say(f"{verb} {path} instead, the newest intact checkpoint")
            return path, bad
        say(f"checkpoint {path} is not intact: {problem}")
        bad.append(f"{os.path.basename(path)}: {problem}")
    return None, bad


def load_intact(ckpt_dir: str, model, optimizer, group=None, say=print, accept=None) -> tuple[str, dict] | None:
    """Load the newest checkpoint in ``ckpt_dir`` that passes :func:`verify` (saying which ones
    were skipped and why); returns (its path, its meta.json), None when there is none at all;
    ValueError when none is intact.  ``accept(meta)`` runs before the load and may raise
    ValueError (a checkpoint of another run: same on every rank, as meta.json is shared)."""
    path, bad = newest_intact(finished(ckpt_dir), group, say)
    if path is not None:
        if accept is not None:
            accept(read_meta(path))
        return path, load(path, model, optimizer, group)
    if bad:
        raise ValueError(f"no intact checkpoint in {ckpt_dir} to resume from ({'; '.join(bad)}); "
                         "start again with --overwrite")
    return None


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
