"""Argument checks for burst_attn_func, and every rank's agreement on them.

A distributed call can go wrong in ways no single rank sees: one rank's arguments are bad
while the others' are fine (the others would wait in the ring for it), or each rank's
arguments are fine but they differ (another causal flag, a shard cut for another world size):
the ring then hangs or, worse, returns a wrong answer.  So checking is done in two stages.

1. Local: this rank's own arguments (types, shapes, dtypes, devices, layout, heads, scale,
   backward and, at level ``full``, NaN/inf in q, k, v), then the caller's own (``extra``:
   masks, topology, and the call's plan, kernel included: attention/planning.py).  A group
   that cannot be used at all (not a process group, torch.distributed not initialised, this
   rank not a member) raises here at once: no collective is possible over it.
2. Agreement: one all-gather over the group of a fixed-size int64 signature holding this
   rank's verdict (its error message, if any) and every value the ranks must share (local
   shapes, dtype, device type, causal, layout, the planned backward scheme, softmax scale, the
   check level, BURST_TIMEOUT, whether autograd records the call; and the caller's: the sparse
   mask, the planned ring from topology / BURST_TOPOLOGY / LOCAL_WORLD_SIZE, BURST_CLUSTER).  If any rank
   failed or any value differs, every rank raises the same ValueError naming the ranks and
   what they passed.  It is the only communication before the ring, so a bad call, made
   alike on every rank or not, leaves no rank waiting and the group in step.

The rule, then: a bad call raises on every rank after exactly one small collective (none with
one rank, none at level ``local``), never in the middle of the ring.  The kernel is not
agreed on: it is local work and may differ between ranks.

Levels (env ``BURST_CHECKS``, read by attention/planning.py, or ``with arg_checks(level):``),
the same on every rank:

* ``full`` (default): local checks, a NaN/inf scan of q, k, v (one ``aminmax`` pass, no
  temporaries; on a NCCL group its result rides in the signature, so it adds no host sync of
  its own) and the agreement.  Non-finite inputs raise instead of propagating.
* ``once``: as ``full`` for the first call of each distinct signature on a group (or on one
  rank); a later call with a remembered signature skips the all-gather and the scan (no
  collective, no host read).
  A rank whose call differs from the one the others repeat is not caught here: on gloo each
  call's ring messages carry a tag made from its signature and number (:func:`call_tag`), so
  such ranks never exchange data and end in the ring's deadline (RankLost); NCCL ignores tags
  (docs/faults.md says what that leaves).  ``burstengine train`` uses it.
* ``agree``: no NaN/inf scan.  Non-finite inputs then propagate as IEEE arithmetic makes them:
  a NaN makes NaN every output row that sees it, an inf gives NaN or a key of weight 0 (a row
  whose every score is -inf comes out as zeros), and rows that cannot see the bad entry under
  the mask are unaffected.
* ``local``: no collective at all.  A bad argument on some ranks only leaves the others
  waiting in the ring (until ``BURST_TIMEOUT``), and ranks that disagree go undetected.

The levels ``full``, ``once`` and ``agree`` are in the signature, so ranks that mix them raise on
the first call; ``local`` never communicates and must be set on every rank or none.

Cost of the agreement: one all-gather of SIG_LEN (76) int64 per rank per call.  It goes
through the group's CPU backend when it has one (gloo, or the gloo side of
"cpu:gloo,cuda:nccl"); on a NCCL-only group the signature is read back on the host: one host
sync per call (see docs/faults.md).  Gradients (dout) are not checked.

Arguments this module does not know (sparse masks, topology) join both stages through
``check_args(..., extra=fn)``: ``fn(world)`` validates them locally and returns the values the
ranks must agree on; under the key :data:`PLANNED_BACKWARD` it returns the concrete backward
scheme the call will run (``backward="auto"`` resolved once, by attention/planning.py), which is
what the "backward scheme" field then carries.  Without it the field carries the argument as given.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import operator
import pickle
import struct
import zlib
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ..comm import fault
from ..comm.dist import group_info
from ..layout import LAYOUTS
from ..masks import Pattern
from .planning import LEVELS, checks_from_env, configured_timeout

BACKWARDS = ("auto", "burst", "ring")
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DEVICES = ("cpu", "cuda", "meta")

# signature: header, shared values, message bytes (same length on every rank by construction)
_MAGIC = 0x4255525354  # "BURST"
_HEADER = 3  # magic, status (0 ok, 1 local checks failed), non-finite mask (q=1, k=2, v=4)
# (name, width, how to show the ints): every value the ranks of a group must share
_FIELDS = (
    ("q shape (batch, seq_local, heads, head_dim)", 4, lambda x: str(tuple(x))),
    ("k/v shape (batch, seq_local, kv_heads, head_dim)", 4, lambda x: str(tuple(x))),
    ("dtype", 1, lambda x: str(_DTYPES[x[0]]) if 0 <= x[0] < len(_DTYPES) else f"dtype #{x[0]}"),
    ("device type", 1, lambda x: _DEVICES[x[0]] if 0 <= x[0] < len(_DEVICES) else f"device #{x[0]}"),
    ("causal", 1, lambda x: str(bool(x[0]))),
    ("layout", 1, lambda x: repr(LAYOUTS[x[0]])),
    ("backward scheme", 1, lambda x: repr(BACKWARDS[x[0]])),
    ("softmax_scale", 1, lambda x: repr(_as_float(x[0]))),
    ("the check level BURST_CHECKS", 1, lambda x: repr(LEVELS[x[0]]) if 0 <= x[0] < len(LEVELS) else f"#{x[0]}"),
    ("the deadline BURST_TIMEOUT (s)", 1, lambda x: "none" if x[0] == -1 else repr(_as_float(x[0]))),
    ("gradients (autograd records the call: grad mode on and an input that requires grad)", 1,
     lambda x: "yes" if x[0] else "no"),
)
PLANNED_BACKWARD = "backward scheme"  # extra's key for the planned backward (not an extra slot)
_EXTRA = 8  # slots for the caller's own values (check_args(extra=...)): one int64 each
_MSG_WORDS = 48  # 384 bytes of the local error message
SIG_LEN = _HEADER + sum(w for _, w, _ in _FIELDS) + _EXTRA + _MSG_WORDS
_level_override: list[str] = []


def check_level() -> str:
    return _level_override[-1] if _level_override else checks_from_env()


@contextmanager
def arg_checks(level: str):
    """Run the block with burst_attn_func's checks at ``level`` ("full", "agree", "local"),
    overriding env BURST_CHECKS.  Every rank must use the same level: one that skips the
    agreement while another does it would leave the latter waiting."""
    if level not in LEVELS:
        raise ValueError(f"check level must be one of {LEVELS}, got {level!r}")
    _level_override.append(level)
    try:
        yield
    finally:
        _level_override.pop()


def _backends(backend: str) -> dict[str, str]:
    """Device type -> backend of a group: "gloo", "nccl", or a mixed "cpu:gloo,cuda:nccl"."""
    if ":" in backend:
        return dict(part.split(":", 1) for part in backend.split(","))
    return {"cuda": backend} if backend == "nccl" else {"cpu": backend}


def _check_local(q, k, v, world, backend, causal, layout, softmax_scale, backward) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, seq_local, heads, head_dim), got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {q.dtype}; expected one of {_DTYPES}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    B, S, H, D = q.shape
    if k.shape[0] != B:
        raise ValueError(f"batch sizes differ: q has {B}, k/v have {k.shape[0]}")
    if k.shape[1] != S:
        raise ValueError(f"q has {S} local tokens but k/v have {k.shape[1]}: each rank must hold the same shard of q, k, v")
    if k.shape[3] != D:
        raise ValueError(f"head dims differ: q has {D}, k/v have {k.shape[3]}")
    Hkv = k.shape[2]
    if Hkv < 1 or H % Hkv:
        raise ValueError(f"q heads ({H}) must be a multiple of k/v heads ({Hkv})")
    if min(B, S, H, D) < 1:
        raise ValueError(f"empty input: q has shape {tuple(q.shape)}")
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if layout == "zigzag" and S % 2:
        raise ValueError(f"layout 'zigzag' needs an even number of local tokens (2 chunks per rank), got {S}")
    if not isinstance(backward, str) or backward not in BACKWARDS:
        raise ValueError(f"unknown backward {backward!r}; expected one of {BACKWARDS}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be a bool, got {causal!r}")
    if softmax_scale is not None:
        scale = scale_value(softmax_scale)
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"softmax_scale must be a positive finite number, got {scale!r}")
    if world > 1 and q.device.type not in _backends(backend):
        if backend == "nccl":
            raise ValueError(f"the group uses NCCL but the tensors are on {q.device}; move them to CUDA")
        if backend == "gloo":
            raise ValueError(f"the group uses gloo but the tensors are on {q.device}; use NCCL for CUDA tensors")
        raise ValueError(f"the group ({backend}) has no backend for tensors on {q.device}")


def scale_value(softmax_scale) -> float:
    """``softmax_scale`` as a float: any real number (int, float, numpy scalar) or a 0-d real
    tensor; ValueError naming the type otherwise (the range is checked by the caller)."""
    if isinstance(softmax_scale, torch.Tensor):
        if softmax_scale.dim() != 0 or softmax_scale.is_complex() or softmax_scale.dtype == torch.bool:
            raise ValueError(f"softmax_scale must be a number or a 0-d real tensor, got a {softmax_scale.dtype} tensor "
                             f"of shape {tuple(softmax_scale.shape)}")
        return float(softmax_scale)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise ValueError(f"softmax_scale must be a number or a 0-d real tensor, got {type(softmax_scale).__name__} "
                         f"{softmax_scale!r}")
    return float(softmax_scale)


def _nonfinite_mask(q, k, v) -> torch.Tensor:
    """int64 0-dim tensor on q's device: bit i set when tensor i of (q, k, v) holds NaN or inf.
    aminmax propagates NaN and reaches +-inf, in one pass and without a bool temporary."""
    bits = [(~torch.isfinite(torch.stack(torch.aminmax(t.detach())))).any().long() << i for i, t in enumerate((q, k, v))]
    return bits[0] | bits[1] | bits[2]


def _nonfinite_text(mask: int) -> str:
    names = [n for i, n in enumerate("qkv") if mask >> i & 1]
    return f"{', '.join(names)} {'contains' if len(names) == 1 else 'contain'} NaN or inf"


def ranks_text(rs) -> str:
    """'rank 3' or 'ranks 0, 1, 2': how every agreement message names ranks."""
    rs = list(rs)
    return f"rank {rs[0]}" if len(rs) == 1 else "ranks " + ", ".join(map(str, rs))


def ranks_by_value(values, ranks) -> dict:
    """{value: [the ranks that hold it]} in first-seen order, from each rank's value."""
    groups: dict = {}
    for r, v in zip(ranks, values):
        groups.setdefault(v, []).append(r)
    return groups


def _as_int(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _as_float(i: int) -> float:
    return struct.unpack("<d", struct.pack("<q", i))[0]


def _shared_values(q, k, v, causal, layout, scale, backward, level, timeout) -> list[int]:
    dev = _DEVICES.index(q.device.type) if q.device.type in _DEVICES else len(_DEVICES)
    return [*q.shape, *k.shape, _DTYPES.index(q.dtype), dev, int(causal), LAYOUTS.index(layout),
            BACKWARDS.index(backward), _as_int(scale), LEVELS.index(level),
            -1 if timeout is None else _as_int(float(timeout)),
            int(torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)))]


def digest(value) -> int:
    """One int64 standing for ``value`` in the signature: small ints as themselves, None as -1,
    anything else (floats, strings, tensors, sequences, dataclasses) as a checksum of its content."""
    if value is None:
        return -1
    if isinstance(value, (bool, int)) and -(1 << 62) < value < (1 << 62):
        return int(value)
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        raw = repr((str(t.dtype), tuple(t.shape))).encode() + data
    elif isinstance(value, (list, tuple)):
        raw = repr([digest(x) for x in value]).encode()
    elif dataclasses.is_dataclass(value):
        raw = repr([digest(getattr(value, f.name)) for f in dataclasses.fields(value)]).encode()
    else:
        raw = repr(value).encode()
    return (zlib.crc32(raw) << 31) ^ zlib.adler32(raw)


def _show_extra(v: int) -> str:
    return str(v) if -(1 << 31) < v < (1 << 31) else f"checksum {v & ((1 << 64) - 1):#x}"


def _checksummed(rows, ranks, extra_names) -> list[str]:
    """The caller's values that differ between ranks and are shown as checksums: their values
    are gathered (:func:`_gather_values`) so the message can show them.  From the rows alone:
    the same list on every rank."""
    off = _HEADER + sum(w for _, w, _ in _FIELDS)
    if any(row[0] != _MAGIC or row[1] or row[2] for row in rows):
        return []
    out = []
    for i, name in enumerate(extra_names):
        vals = {row[off + i] for row in rows}
        if len(vals) > 1 and any(_show_extra(v).startswith("checksum") for v in vals):
            out.append(name)
    return out


_WHOLE = 1 << 22  # a tensor value up to this many elements is sent whole to show where it differs


def _portable(value):
    """A value as sent to the other ranks to show it: tensors on the CPU (a big one as its shape
    and one digest per row), dataclasses by their name when they have one."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        if t.numel() <= _WHOLE:
            return t
        return ("rows", tuple(t.shape), [digest(r) for r in t])
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return getattr(value, "name", None) or repr(value)
    return value


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            a.dtype == b.dtype and bool(torch.equal(a, b))
    return a == b


def _show_one(v) -> str:
    if isinstance(v, torch.Tensor):
        return "x".join(map(str, v.shape)) + (" blocks" if v.dim() == 2 else "")
    if isinstance(v, tuple) and len(v) == 3 and v[0] == "rows":
        return "x".join(map(str, v[1])) + " blocks"
    if isinstance(v, (list, tuple)):
        return _short(tuple(v)).replace("[", "(").replace("]", ")") if len(v) > 12 else str(tuple(v))
    return "none" if v is None else str(v)


def _show_values(name: str, vals: list, ranks: list[int]) -> str:
    """``name: <value> on ranks .., <value> on rank ..``, and where the values have one shape,
    the first place they differ (the index of a sequence, the block of a block mask)."""
    groups: list[tuple[object, list[int]]] = []
    for r, v in zip(ranks, vals):
        for g in groups:
            if _same(g[0], v):
                g[1].append(r)
                break
        else:
            groups.append((v, [r]))
    first = groups[0][0]
    if all(isinstance(v, torch.Tensor) for v, _ in groups) and len({tuple(v.shape) for v, _ in groups}) == 1:
        # one shape: the first element (row-major) where any rank's mask differs from the first's
        at = min(tuple(int(i) for i in (v != first).nonzero()[0]) for v, _ in groups[1:])
        where = "block" if first.dim() == 2 else "index"
        return (f"{name}: {_show_one(first)}, first difference at {where} {at if len(at) > 1 else at[0]}: " +
                ", ".join(f"{v[at].item()} on {ranks_text(rs)}" for v, rs in groups))
    if all(isinstance(v, tuple) and len(v) == 3 and v[0] == "rows" for v, _ in groups) and \
            len({v[1] for v, _ in groups}) == 1:
        row = min(next(i for i, (a, b) in enumerate(zip(first[2], v[2])) if a != b) for v, _ in groups[1:])
        return f"{name}: {_show_one(first)}, first difference in block row {row}: " + \
            ", ".join(f"row checksum {v[2][row] & ((1 << 64) - 1):#x} on {ranks_text(rs)}" for v, rs in groups)
    text = f"{name}: " + ", ".join(f"{_show_one(v)} on {ranks_text(rs)}" for v, rs in groups)
    if all(isinstance(v, (list, tuple)) and not (len(v) == 3 and v[0] == "rows") for v, _ in groups) and \
            len({len(v) for v, _ in groups}) == 1:
        at = min(next(i for i, (a, b) in enumerate(zip(first, v)) if a != b) for v, _ in groups[1:])
        text += f" (first difference at index {at})"
    return text


def _gather_bytes(data: bytes, group, dev, world: int, op) -> list[bytes]:
    """Every rank's ``data``: an all-gather of the lengths, then of the padded bytes."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    lens = torch.empty(world, dtype=torch.int64, device=dev)
    fault.wait([fault.post(lambda: gather(lens, n, group=group, async_op=True), op)], op)
    lens = lens.tolist()
    buf = torch.zeros(max(lens), dtype=torch.uint8)
    buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
    buf = buf.to(dev)
    out = torch.empty(world * max(lens), dtype=torch.uint8, device=dev)
    fault.wait([fault.post(lambda: gather(out, buf, group=group, async_op=True), op)], op)
    out = out.cpu().view(world, max(lens))
    return [bytes(out[i, :lens[i]].numpy().tobytes()) for i in range(world)]


def _gather_values(names, values, group, dev, world, op) -> dict[str, list]:
    """name -> every rank's value (for the error message only, so every rank calls it when the
    gathered rows say so)."""
    mine = pickle.dumps({nm: _portable(values[nm]) for nm in names})
    rows = [pickle.loads(b) for b in _gather_bytes(mine, group, dev, world, op)]
    return {nm: [row[nm] for row in rows] for nm in names}


def _pack(msg: str) -> list[int]:
    raw = msg.encode()[: 8 * _MSG_WORDS].ljust(8 * _MSG_WORDS, b"\0")
    return list(struct.unpack(f"<{_MSG_WORDS}q", raw))


def _unpack(words) -> str:
    return struct.pack(f"<{_MSG_WORDS}q", *words).rstrip(b"\0").decode(errors="ignore")


def _verdict(rows: list[list[int]], ranks: list[int], extra_names=(), details=None) -> str | None:
    """The error every rank raises for the gathered signatures, or None if the call is good.
    Built from the gathered rows alone (and ``details``: name -> every rank's value of the
    caller's values that differ as checksums, gathered too), so it is the same string on
    every rank."""
    bad = [r for r, row in zip(ranks, rows) if row[0] != _MAGIC]
    if bad:
        return (f"burst_attn_func's argument check got garbage from {ranks_text(bad)}: the ranks are out of step "
                f"(a rank is inside another collective on this group)")
    failed: dict[str, list[int]] = {}
    for r, row in zip(ranks, rows):
        if row[1]:
            failed.setdefault(_unpack(row[-_MSG_WORDS:]), []).append(r)
        elif row[2]:
            failed.setdefault(_nonfinite_text(row[2]), []).append(r)
    if failed:
        if len(failed) == 1 and len(next(iter(failed.values()))) == len(ranks):
            return next(iter(failed))  # every rank failed alike: its own message, unchanged
        passed = [r for r, row in zip(ranks, rows) if not row[1] and not row[2]]
        parts = [f"on {ranks_text(rs)}: {m}" for m, rs in failed.items()]
        tail = f" ({ranks_text(passed)} passed {'their' if len(passed) > 1 else 'its'} own checks)" if passed else ""
        return "burst_attn_func arguments rejected " + "; ".join(parts) + tail
    diffs, off = [], _HEADER
    for name, width, show in _FIELDS:
        groups = ranks_by_value((tuple(row[off:off + width]) for row in rows), ranks)
        if len(groups) > 1:
            diffs.append(f"{name}: " + ", ".join(f"{show(val)} on {ranks_text(rs)}" for val, rs in groups.items()))
        off += width
    for i, name in enumerate(extra_names):
        groups = ranks_by_value((row[off + i] for row in rows), ranks)
        if len(groups) > 1:
            if details and name in details:
                diffs.append(_show_values(name, details[name], ranks))
            else:
                diffs.append(f"{name}: " + ", ".join(f"{_show_extra(val)} on {ranks_text(rs)}"
                                                     for val, rs in groups.items()))
    if diffs:
        return ("burst_attn_func: the ranks of the group disagree on " + "; ".join(diffs) +
                ". Every rank must pass its shard of the same global q, k, v with the same options")
    return None


_CALLS: dict = {}  # group -> calls checked on it so far (every rank counts alike)
_AGREED: dict = {}  # group -> signatures the ranks agreed on (level "once"), oldest first
_AGREED_MAX = 64  # distinct signatures remembered per group (a model has a few: one per mask / shape)


def _group_key(group, ranks) -> tuple:
    default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    return id(default), tuple(ranks)


def call_tag(sig, calls: int) -> int:
    """The P2P tag of a call's ring messages: from its signature and its number on the group,
    so that on gloo ranks running different calls (one skipped a call, or passed other
    arguments while the check was skipped: level "once") never exchange messages, and time
    out naming each other instead of computing a wrong answer."""
    return zlib.crc32(struct.pack(f"<{len(sig) + 1}q", *sig, calls)) & 0x7FFFFFFF


def _call_values(q, k, v, causal, layout, softmax_scale, planned, level, timeout, values) -> list[int]:
    """A valid call's part of the signature: what the ranks must share (:func:`_shared_values`),
    then the caller's values as digests, padded to :data:`_EXTRA`."""
    scale = scale_value(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    mine = [digest(x) for x in (values or {}).values()]
    return [*_shared_values(q, k, v, causal, layout, scale, planned, level, timeout), *mine,
            *[0] * (_EXTRA - len(mine))]


def _remember(agreed: dict, sig) -> None:
    """Level "once": ``sig`` was checked (and agreed on); the oldest goes past :data:`_AGREED_MAX`."""
    if sig not in agreed and len(agreed) >= _AGREED_MAX:
        agreed.pop(next(iter(agreed)))
    agreed[sig] = True


def check_args(q, k, v, group, causal, layout, softmax_scale, backward, extra=None, out=None):
    """Raise ValueError on every rank of ``group`` if any rank's call is bad or the ranks'
    calls disagree (see the module docstring for the levels and the rule).

    ``extra``: optional ``extra(world) -> dict`` for arguments this module does not know (masks,
    topology...).  It runs in the local stage, after the built-in checks pass: a ValueError it
    raises is this rank's verdict, and the values it returns (at most 8; ints, None, floats,
    strings, tensors, sequences, dataclasses; same keys on every rank) must agree across the
    group; where they differ, the message shows them.  Its value under
    :data:`PLANNED_BACKWARD`, the planned scheme, is signed in place of ``backward``.
    ``out``: a dict that receives "tag", the P2P tag of this call's ring messages
    (:func:`call_tag`).  Returns the extra values (None without ``extra``)."""
    rank, world, backend = group_info(group)
    values = None
    planned = backward
    level, timeout = "full", None
    try:
        level = check_level()
        timeout = configured_timeout()
        _check_local(q, k, v, world, backend, causal, layout, softmax_scale, backward)
        if extra is not None:
            values = dict(extra(world))
            planned = values.pop(PLANNED_BACKWARD, backward)
            if len(values) > _EXTRA:
                raise RuntimeError(f"check_args(extra=...) returned {len(values)} values, at most {_EXTRA} fit")
        error = None
    except ValueError as e:
        error = str(e)
    except Exception as e:  # a check that crashed on this rank's odd input must not strand the others
        error = f"argument check failed: {type(e).__name__}: {e}"
    scan = level in ("full", "once") and error is None and q.device.type != "meta"
    if world == 1 or level == "local":
        seen, sig = None, None
        if scan and level == "once":
            # as on a group: a call like one already scanned is not scanned again.  The scan's
            # result is read on the host (a stream sync), and one in every layer of every step
            # stalled one-GPU training: the host cannot run ahead of the device, and with
            # activation offload the read waited behind the layer's copies to the host
            sig = tuple(_call_values(q, k, v, causal, layout, softmax_scale, planned, level, timeout, values))
            seen = _AGREED.setdefault(("one rank", q.device.type), {})
            scan = sig not in seen
        mask = int(_nonfinite_mask(q, k, v)) if scan else 0
        if mask:
            error = _nonfinite_text(mask)
        if error is not None:
            raise ValueError(error)
        if seen is not None:
            _remember(seen, sig)
        if out is not None:
            out["tag"] = 0
        return values
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    key = _group_key(group, ranks)
    calls = _CALLS.get(key, 0)
    _CALLS[key] = calls + 1
    if error is None:
        host = [_MAGIC, 0, 0, *_call_values(q, k, v, causal, layout, softmax_scale, planned, level, timeout, values),
                *_pack("")]
    else:
        host = [_MAGIC, 1, 0, *[0] * (SIG_LEN - _HEADER - _MSG_WORDS), *_pack(error)]
    sig = tuple(host)  # what level "once" remembers
    if out is not None:
        out["tag"] = call_tag(sig, calls)
    agreed = _AGREED.setdefault(key, {})
    if level == "once" and error is None and sig in agreed:
        # agreed on before: no collective, no scan.  A rank whose call differs from the one the
        # others repeat is caught by the ring's deadline (its messages carry another tag)
        return values
    # the same device on every rank whatever its own tensors are: the CPU side of the group if it
    # has one (no GPU stream sync for the exchange), else CUDA
    dev = torch.device("cpu") if "cpu" in _backends(backend) else torch.device("cuda", torch.cuda.current_device())
    sig_t = torch.tensor(host, dtype=torch.int64)
    # pinned + non_blocking: no stream sync on the way in; reading the result back is the one sync
    sig_t = sig_t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else sig_t
    if scan:
        sig_t[2] = _nonfinite_mask(q, k, v).to(dev)
    gathered = torch.empty(world * SIG_LEN, dtype=torch.int64, device=dev)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    op = fault.Op(f"burst_attn_func's argument check (an all-gather over global ranks {ranks}; a rank that "
                  f"skipped this call or runs BURST_CHECKS=local never joins it)",
                  blocking=dev.type == "cpu", group_ranks=tuple(ranks), deadline=timeout, group=group)
    fault.wait([fault.post(lambda: gather(gathered, sig_t, group=group, async_op=True), op)], op)
    rows = gathered.view(world, SIG_LEN).tolist()
    names = list(values or ())
    shown = _checksummed(rows, ranks, names)
    details = _gather_values(shown, values, group, dev, world, op) if shown else None
    msg = _verdict(rows, ranks, names, details)
    if msg is not None:
        raise ValueError(msg)
    if level == "once":
        _remember(agreed, sig)
    return values


def check_sparse(causal, layout, world, n, window, cu_seqlens, block_mask, block_size):
    """Check the sparse-mask arguments of burst_attn_func and return their schedule.Pattern.

    Every value is global (the whole sequence of ``n * world`` tokens) and must be the same on
    every rank: the ring steps that run are derived from them."""
    S = n * world
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int (keys each query sees), got {window!r}")
        if not causal:
            raise ValueError("window needs causal=True: a sliding window looks back at the W most recent keys")
    cu = None
    if cu_seqlens is not None:
        if isinstance(cu_seqlens, torch.Tensor):
            if cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype == torch.bool:
                raise ValueError(f"cu_seqlens must be a 1-D integer tensor, got {cu_seqlens.dtype} "
                                 f"of shape {tuple(cu_seqlens.shape)}")
            cu = tuple(int(c) for c in cu_seqlens.tolist())
        else:
            try:
                if any(isinstance(c, bool) for c in cu_seqlens):
                    raise TypeError
                cu = tuple(operator.index(c) for c in cu_seqlens)
            except TypeError:
                raise ValueError(f"cu_seqlens must be a sequence of ints, got {_short(cu_seqlens)}") from None
        if len(cu) < 2 or cu[0] != 0 or cu[-1] != S:
            raise ValueError(f"cu_seqlens must run from 0 to the global sequence length {S} "
                             f"({n} local tokens x {world} ranks), got {_short(cu)}")
        if any(b < a for a, b in zip(cu[:-1], cu[1:])):
            raise ValueError(f"cu_seqlens must be non-decreasing, got {_short(cu)}")
    bm, bs = None, 0
    if block_mask is None:
        if block_size is not None:
            raise ValueError("block_size was given without a block_mask")
    else:
        if window is not None or cu is not None:
            raise ValueError("block_mask cannot be combined with window or cu_seqlens; fold them into the block mask")
        if not isinstance(block_mask, torch.Tensor) or block_mask.dtype != torch.bool or block_mask.dim() != 2 \
                or block_mask.shape[0] != block_mask.shape[1] or block_mask.shape[0] < 1:
            raise ValueError("block_mask must be a square 2-D bool tensor (blocks x blocks), got "
                             + (f"{block_mask.dtype} of shape {tuple(block_mask.shape)}"
                                if isinstance(block_mask, torch.Tensor) else type(block_mask).__name__))
        nb = block_mask.shape[0]
        if S % nb:
            raise ValueError(f"block_mask has {nb} blocks per side, which does not divide the global length {S}")
        bs = S // nb
        if block_size is not None and block_size != bs:
            raise ValueError(f"block_size {block_size!r} does not match block_mask: {nb} blocks of a {S}-token "
                             f"sequence are {bs} tokens each")
        if layout == "striped" and bs % world:
            raise ValueError(f"block size {bs} must be a multiple of the world size {world} under layout 'striped' "
                             "(each rank holds the same share of every block)")
        if layout == "contiguous" and n % bs:
            raise ValueError(f"block size {bs} must divide the local length {n} under layout 'contiguous'")
        if layout == "zigzag" and (n // 2) % bs:
            raise ValueError(f"block size {bs} must divide the zigzag chunk of {n // 2} tokens under layout 'zigzag'")
        bm = block_mask.detach().to("cpu")
    return Pattern(causal=causal, window=window, cu_seqlens=cu, block_mask=bm, block_size=bs)


def _short(seq, k=6):
    try:
        seq = list(seq)
    except TypeError:
        return repr(seq)
    return str(seq) if len(seq) <= 2 * k else f"[{', '.join(map(str, seq[:k]))}, ..., {', '.join(map(str, seq[-k:]))}]"
