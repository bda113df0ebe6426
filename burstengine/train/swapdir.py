"""An output directory written whole or not at all: what `burstengine export` writes into.

    with replacing(out_dir, overwrite=False, note={"checkpoint": ...}) as tmp:
        ... write every file into tmp ...

The files go to a temporary directory beside ``out_dir`` (``.<name>.export-<pid>-<token>``, on
the same file system), which is swapped in only when everything was written: a command killed
mid-write leaves an earlier ``out_dir`` as it was (and its temporary directory, removed by the
next export into the same place once its process has ended); a failed write removes its
temporary directory, and a full disk is said in one line (:mod:`.diskfull`).

``out_dir`` may be absent, empty, or an earlier directory written this way (it holds
:data:`MARKER`, a small JSON note); anything else, another model's files say, is refused
without ``overwrite`` (a ValueError naming it), checked before writing and again at the swap.
A file is always refused.  Two commands writing the same ``out_dir`` at once both finish, and
it ends up holding one of their outputs, whole.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import time
import uuid
from contextlib import contextmanager

from .diskfull import full_disk, no_space

MARKER = ".burstengine-export.json"


def refusal(out_dir: str, overwrite: bool) -> str | None:
    """Why ``out_dir`` cannot be replaced, or None."""
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        return f"out_dir {out_dir} exists and is not a directory"
    if overwrite or not os.path.isdir(out_dir) or os.path.isfile(os.path.join(out_dir, MARKER)):
        return None
    held = sorted(os.listdir(out_dir))
    if not held:
        return None
    return (f"out_dir {out_dir} is not empty and was not written by burstengine export (it holds "
            f"{', '.join(held[:3])}{', ...' if len(held) > 3 else ''}): pass --overwrite to replace it whole, "
            f"or name another directory")


def _prefix(out_dir: str) -> str:
    parent, name = os.path.split(os.path.abspath(out_dir))
    return os.path.join(parent, f".{name}.export-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _clear_leftovers(out_dir: str) -> None:
    """Temporary directories of earlier writes into ``out_dir`` whose process has ended (killed)."""
    prefix = _prefix(out_dir)
    parent = os.path.dirname(prefix)
    for name in os.listdir(parent):
        path = os.path.join(parent, name)
        if path.startswith(prefix):
            pid = path[len(prefix):].split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(path, ignore_errors=True)


@contextmanager
def replacing(out_dir: str, overwrite: bool = False, note: dict | None = None):
    """Yield a temporary directory to write ``out_dir``'s files into; swap it in when the block
    ends without an error (see the module doc).  ``note``: what :data:`MARKER` records."""
    problem = refusal(out_dir, overwrite)
    if problem:
        raise ValueError(problem)
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    tmp = f"{_prefix(out_dir)}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.makedirs(parent, exist_ok=True)
        _clear_leftovers(out_dir)
        os.mkdir(tmp)
        yield tmp
        with open(os.path.join(tmp, MARKER), "w") as f:
            json.dump(dict(note or {}, written=time.strftime("%Y-%m-%dT%H:%M:%S")), f, indent=1)
        _swap_in(tmp, out_dir, overwrite)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and full_disk(e)[0]:  # said of out_dir, not of the temporary file
            raise no_space(out_dir) from None
        raise


def _swap_in(tmp: str, out_dir: str, overwrite: bool) -> None:
    """Rename ``tmp`` to ``out_dir``, an earlier ``out_dir`` moved aside first and then removed.
    Retried when another writer swaps its own in meanwhile."""
    for _ in range(100):
        aside = None
        if os.path.lexists(out_dir):
            problem = refusal(out_dir, overwrite)  # it may have changed while we wrote
            if problem:
                raise ValueError(problem)
            aside = f"{_prefix(out_dir)}{os.getpid()}-{uuid.uuid4().hex[:8]}.old"
            try:
                os.rename(out_dir, aside)
            except FileNotFoundError:
                continue  # another writer moved it meanwhile
        try:
            os.rename(tmp, out_dir)
            return
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            # another writer put its own in between our two renames: go round again
        finally:
            if aside is not None:
                shutil.rmtree(aside, ignore_errors=True)
    raise ValueError(f"out_dir {out_dir}: other commands keep replacing it; run one at a time")
