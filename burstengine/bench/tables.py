"""Markdown for `burstengine report`: the number formats and tables every record renderer uses,
and :class:`Section`, one family of records on docs/results.md.

A module whose runs write records declares ``SECTIONS`` (each names the records it renders by a
file-name pattern and renders one record as Markdown lines) and may declare ``BLOCKS`` (name ->
function of all the records: the text of a ``<!-- report:NAME -->`` block in the docs).  A
renderer that raises KeyError, TypeError, ... on a record leaves it to the report's generic
table, so a new record shape is listed rather than breaking the report.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

GIB = 1024 ** 3
MIB = 1024 ** 2


@dataclass(frozen=True)
class Section:
    title: str
    pattern: str  # regular expression matched at the start of a record's file name
    render: Callable[[dict], list[str]]
    what: str  # one line: the command that writes these records


def med(xs) -> float:
    return statistics.median(xs)


def num(x, digits: int = 3) -> str:
    """A number with ``digits`` significant digits (no exponent for ordinary magnitudes)."""
    if x is None:
        return "—"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if x == 0:
        return "0"
    if abs(x) < 1e-3 or abs(x) >= 1e7:
        return f"{x:.{max(digits - 1, 0)}e}"
    return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:.0f}"


def fixed(x, places: int = 2) -> str:
    return "—" if x is None else f"{x:.{places}f}"


def ms(seconds) -> str:
    return "—" if seconds is None else num(seconds * 1e3, 4)


def gib(nbytes) -> str:
    return "—" if nbytes is None else f"{nbytes / GIB:.1f}"


def rate(flops_per_s) -> str:
    """FLOP/s in the unit that shows its digits: a CPU's "3.1 GF/s", not "0.0 TF/s"."""
    if flops_per_s is None:
        return "—"
    for unit, scale in (("TF/s", 1e12), ("GF/s", 1e9)):
        if flops_per_s >= 0.1 * scale:
            return f"{flops_per_s / scale:.1f} {unit}"
    return f"{flops_per_s / 1e6:.1f} MF/s"


def memory(nbytes) -> str:
    """Bytes as GiB, or MiB below a tenth of one; "n/a" when nothing was measured (0 or None:
    the device's allocator counts, a CPU's does not)."""
    if not nbytes:
        return "n/a"
    return f"{nbytes / GIB:.1f} GiB" if nbytes >= 0.1 * GIB else f"{nbytes / MIB:.0f} MiB"


def ratio(a, b, places: int = 2) -> str:
    return "—" if a is None or b in (None, 0) else f"{a / b:.{places}f}"


def span(values, places: int = 2) -> str:
    """'lo–hi' of some ratios (one value when they agree to the places shown)."""
    lo, hi = f"{min(values):.{places}f}", f"{max(values):.{places}f}"
    return lo if lo == hi else f"{lo}–{hi}"


def table(header, rows) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return out + [""]


def keyed(rows, *keys) -> dict:
    """Rows by the tuple of their ``keys`` (the last row wins)."""
    out = {}
    for r in rows:
        out[tuple(r[k] for k in keys)] = r
    return out


def device_of(rec) -> str:
    env = rec.get("env", {})
    dev = env.get("device", "?")
    count = env.get("device_count")
    if dev != "cpu" and count and count > 1:
        used = rec.get("world") or rec.get("env", {}).get("WORLD_SIZE")
        if used and int(used) < count:
            return f"{int(used)}× {dev} (of {count})"
        return f"{count}× {dev}"
    return dev


def record(records, name: str) -> dict:
    """The record ``name`` (a file name) of ``records`` [(name, record)]; KeyError when missing."""
    for n, r in records:
        if n == name:
            return r
    raise KeyError(f"record {name} is missing")
