"""Every rank's agreement on one attention call: the collective comparison of the ranks'
signatures, the signatures remembered at check level "once", and the messages that name the
ranks at fault.

A distributed call can go wrong in ways no single rank sees: one rank's arguments are bad
while the others' are fine (the others would wait in the ring for it), or each rank's
arguments are fine but they differ (another causal flag, a shard cut for another world size):
the ring then hangs or, worse, returns a wrong answer.  So after the local checks
(attention/checks.py) the ranks agree: one all-gather over the group of a fixed-size int64
signature holding this rank's verdict (its error message, if any) and every value the ranks
must share (local shapes, dtype, device type, causal, layout, the planned backward scheme,
softmax scale, the check level, BURST_TIMEOUT, whether autograd records the call; and the
caller's named values: the sparse mask, the planned ring from topology / BURST_TOPOLOGY /
LOCAL_WORLD_SIZE, BURST_CLUSTER...).  If any rank failed or any value differs, every rank
raises the same ValueError naming the ranks and what they passed.  It is the only
communication before the ring, so a bad call, made alike on every rank or not, leaves no rank
waiting and the group in step.  A group that cannot be used at all (not a process group,
torch.distributed not initialised, this rank not a member) raises before this, at once: no
collective is possible over it.

The rule, then: a bad call raises on every rank after exactly one small collective (none with
one rank, none at level ``local``; the levels are in attention/checks.py), never in the middle
of the ring.  The kernel is not agreed on: it is local work and may differ between ranks.

Cost: one all-gather of SIG_LEN (76) int64 per rank per call.  It goes through the group's CPU
backend when it has one (gloo, or the gloo side of "cpu:gloo,cuda:nccl"); on a NCCL-only group
the signature is read back on the host: one host sync per call (see docs/faults.md).
"""
from __future__ import annotations

import dataclasses
import pickle
import struct
import zlib

import torch
import torch.distributed as dist

from ..comm import fault
from ..layout import LAYOUTS
from . import checks
from .call import AttnCall
from .checks import BACKWARDS, DEVICES, DTYPES, backends, nonfinite_text, shorten
from .planning import LEVELS, softmax_scale_of

# signature: header, shared values, message bytes (same length on every rank by construction)
_MAGIC = 0x4255525354  # "BURST"
_HEADER = 3  # magic, status (0 ok, 1 local checks failed), non-finite mask (q=1, k=2, v=4)
# (name, width, how to show the ints): every value the ranks of a group must share
_FIELDS = (
    ("q shape (batch, seq_local, heads, head_dim)", 4, lambda x: str(tuple(x))),
    ("k/v shape (batch, seq_local, kv_heads, head_dim)", 4, lambda x: str(tuple(x))),
    ("dtype", 1, lambda x: str(DTYPES[x[0]]) if 0 <= x[0] < len(DTYPES) else f"dtype #{x[0]}"),
    ("device type", 1, lambda x: DEVICES[x[0]] if 0 <= x[0] < len(DEVICES) else f"device #{x[0]}"),
    ("causal", 1, lambda x: str(bool(x[0]))),
    ("layout", 1, lambda x: repr(LAYOUTS[x[0]])),
    ("backward scheme", 1, lambda x: repr(BACKWARDS[x[0]])),
    ("softmax_scale", 1, lambda x: repr(_as_float(x[0]))),
    ("the check level BURST_CHECKS", 1, lambda x: repr(LEVELS[x[0]]) if 0 <= x[0] < len(LEVELS) else f"#{x[0]}"),
    ("the deadline BURST_TIMEOUT (s)", 1, lambda x: "none" if x[0] == -1 else repr(_as_float(x[0]))),
    ("gradients (autograd records the call: grad mode on and an input that requires grad)", 1,
     lambda x: "yes" if x[0] else "no"),
)
SHARED_SLOTS = 8  # the caller's named values (agree's ``shared``): one int64 each
_MSG_WORDS = 48  # 384 bytes of the local error message
SIG_LEN = _HEADER + sum(w for _, w, _ in _FIELDS) + SHARED_SLOTS + _MSG_WORDS


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


def digest(value) -> int:
    """One int64 standing for ``value`` in the signature: small ints as themselves, None as -1,
    anything else (floats, strings, tensors, sequences, dataclasses) as a checksum of its content."""
    if value is None:
        return -1
    if isinstance(value, (bool, int)) and -(1 << 62) < value < (1 << 62):
        return int(value)
    if isinstance(value, float):
        return _as_int(value)
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


def _show_shared(v: int) -> str:
    return str(v) if -(1 << 31) < v < (1 << 31) else f"checksum {v & ((1 << 64) - 1):#x}"


def _checksummed(rows, ranks, shared_names) -> list[str]:
    """The caller's values that differ between ranks and are shown as checksums: their values
    are gathered (:func:`_gather_values`) so the message can show them.  From the rows alone:
    the same list on every rank."""
    off = _HEADER + sum(w for _, w, _ in _FIELDS)
    if any(row[0] != _MAGIC or row[1] or row[2] for row in rows):
        return []
    out = []
    for i, name in enumerate(shared_names):
        vals = {row[off + i] for row in rows}
        if len(vals) > 1 and any(_show_shared(v).startswith("checksum") for v in vals):
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
        return shorten(tuple(v)).replace("[", "(").replace("]", ")") if len(v) > 12 else str(tuple(v))
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


def _verdict(rows: list[list[int]], ranks: list[int], shared_names=(), details=None) -> str | None:
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
            failed.setdefault(nonfinite_text(row[2]), []).append(r)
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
    for i, name in enumerate(shared_names):
        groups = ranks_by_value((row[off + i] for row in rows), ranks)
        if len(groups) > 1:
            if details and name in details:
                diffs.append(_show_values(name, details[name], ranks))
            else:
                diffs.append(f"{name}: " + ", ".join(f"{_show_shared(val)} on {ranks_text(rs)}"
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


def _call_values(q, k, v, call: AttnCall, planned: str, level: str, timeout, shared: dict) -> list[int]:
    """A valid call's part of the signature: every value of :data:`_FIELDS`, then the caller's
    named values as digests, padded to :data:`SHARED_SLOTS`."""
    dev = DEVICES.index(q.device.type) if q.device.type in DEVICES else len(DEVICES)
    mine = [digest(x) for x in shared.values()]
    return [*q.shape, *k.shape, DTYPES.index(q.dtype), dev, int(call.mask.causal), LAYOUTS.index(call.layout),
            BACKWARDS.index(planned), _as_int(softmax_scale_of(q, call.softmax_scale)), LEVELS.index(level),
            -1 if timeout is None else _as_int(float(timeout)),
            int(torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))),
            *mine, *[0] * (SHARED_SLOTS - len(mine))]


def _remember(agreed: dict, sig) -> None:
    """Level "once": ``sig`` was checked (and agreed on); the oldest goes past :data:`_AGREED_MAX`."""
    if sig not in agreed and len(agreed) >= _AGREED_MAX:
        agreed.pop(next(iter(agreed)))
    agreed[sig] = True



def agree(q, k, v, call: AttnCall, world: int, backend: str, *, planned: str, shared: dict, error: str | None,
          level: str, timeout) -> int:
    """Settle one call on every rank of ``call.group`` (``world`` ranks on ``backend``) after
    this rank's local checks: raise the same ValueError on every rank if any rank's checks
    failed (``error``: this rank's message, None if they passed), its q, k, v hold NaN or inf
    (levels full and once), or the ranks' signatures differ; else return the P2P tag of the
    call's ring messages (:func:`call_tag`; 0 with one rank or at level local).

    ``planned``: the backward scheme the call will run (its plan's), signed as "backward
    scheme"; ``shared``: the caller's named values the ranks must agree on (at most
    :data:`SHARED_SLOTS`; ints, None, floats, strings, tensors, sequences, dataclasses; the same
    names on every rank); where they differ, the message shows them."""
    group = call.group
    scan = level in ("full", "once") and error is None and q.device.type != "meta"
    if world == 1 or level == "local":
        seen, sig = None, None
        if scan and level == "once":
            # as on a group: a call like one already scanned is not scanned again.  The scan's
            # result is read on the host (a stream sync), and one in every layer of every step
            # stalled one-GPU training: the host cannot run ahead of the device, and with
            # activation offload the read waited behind the layer's copies to the host
            sig = tuple(_call_values(q, k, v, call, planned, level, timeout, shared))
            seen = _AGREED.setdefault(("one rank", q.device.type), {})
            scan = sig not in seen
        mask = int(checks.nonfinite_mask(q, k, v)) if scan else 0
        if mask:
            error = nonfinite_text(mask)
        if error is not None:
            raise ValueError(error)
        if seen is not None:
            _remember(seen, sig)
        return 0
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    key = _group_key(group, ranks)
    calls = _CALLS.get(key, 0)
    _CALLS[key] = calls + 1
    if error is None:
        host = [_MAGIC, 0, 0, *_call_values(q, k, v, call, planned, level, timeout, shared), *_pack("")]
    else:
        host = [_MAGIC, 1, 0, *[0] * (SIG_LEN - _HEADER - _MSG_WORDS), *_pack(error)]
    sig = tuple(host)  # what level "once" remembers
    tag = call_tag(sig, calls)
    agreed = _AGREED.setdefault(key, {})
    if level == "once" and error is None and sig in agreed:
        # agreed on before: no collective, no scan.  A rank whose call differs from the one the
        # others repeat is caught by the ring's deadline (its messages carry another tag)
        return tag
    # the same device on every rank whatever its own tensors are: the CPU side of the group if it
    # has one (no GPU stream sync for the exchange), else CUDA
    dev = torch.device("cpu") if "cpu" in backends(backend) else torch.device("cuda", torch.cuda.current_device())
    sig_t = torch.tensor(host, dtype=torch.int64)
    # pinned + non_blocking: no stream sync on the way in; reading the result back is the one sync
    sig_t = sig_t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else sig_t
    if scan:
        sig_t[2] = checks.nonfinite_mask(q, k, v).to(dev)
    gathered = torch.empty(world * SIG_LEN, dtype=torch.int64, device=dev)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    op = fault.Op(f"burst_attn_func's argument check (an all-gather over global ranks {ranks}; a rank that "
                  f"skipped this call or runs BURST_CHECKS=local never joins it)",
                  blocking=dev.type == "cpu", group_ranks=tuple(ranks), deadline=timeout, group=group)
    fault.wait([fault.post(lambda: gather(gathered, sig_t, group=group, async_op=True), op)], op)
    rows = gathered.view(world, SIG_LEN).tolist()
    names = list(shared)
    shown = _checksummed(rows, ranks, names)
    details = _gather_values(shown, shared, group, dev, world, op) if shown else None
    msg = _verdict(rows, ranks, names, details)
    if msg is not None:
        raise ValueError(msg)
    if level == "once":
        _remember(agreed, sig)
    return tag
