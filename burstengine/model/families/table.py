"""Weight-name tables: which Hugging Face tensor holds which of our parameters, fused ones included.

A family lists its tensors as :class:`Entry` rows, ``{i}`` standing for a layer's index.  An
entry maps one HF tensor to one or several of our parameters: several where HF fuses them
(Phi-3's ``qkv_proj`` holds q, k and v).  The HF tensor is then our parameters concatenated along
dim 0 in the entry's order, each part's rows given by ``rows(args)`` from the config, so a
loading rank reads only the rows of each part it keeps, and export concatenates the parts again.

:class:`Table` looks names up either way; :class:`HFTensors` is one model's tensors: each HF
tensor's shape and the parts (our parameter, first row, rows) it is made of.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

# the first dotted component that is a number: a layer's index
_INDEX = re.compile(r"(?<![^.])(\d+)(?=\.)")


def _pattern(name: str) -> tuple[str, str | None]:
    """(``name`` with its layer index written ``{i}``, the index or None)."""
    m = _INDEX.search(name)
    if m is None:
        return name, None
    return name[:m.start()] + "{i}" + name[m.end():], m.group(1)


@dataclass(frozen=True)
class Entry:
    """One HF tensor and the parameter(s) of ours it holds, ``{i}`` for the layer index."""

    hf: str
    ours: tuple[str, ...]
    # a fused tensor: the rows of each of ``ours`` for a model's ModelArgs (derived from the config)
    rows: Callable | None = None

    def __post_init__(self):
        if len(self.ours) > 1 and self.rows is None:
            raise ValueError(f"fused entry {self.hf!r} needs rows(args) for its {len(self.ours)} parts")


def entry(hf: str, *ours: str, rows: Callable | None = None) -> Entry:
    """``entry(hf, ours)``: one tensor each side; ``entry(hf, a, b, rows=f)``: a fused HF tensor."""
    return Entry(hf, tuple(ours), rows)


@dataclass(frozen=True)
class Part:
    """One of our parameters inside an HF tensor: rows [start, start + rows) of its dim 0."""

    name: str
    start: int
    rows: int


class Table:
    """A family's entries, looked up by name either way (layer names with any index)."""

    def __init__(self, entries):
        self.entries = tuple(entries)
        self.by_hf = {e.hf: e for e in self.entries}
        self.by_ours = {o: e for e in self.entries for o in e.ours}
        if len(self.by_hf) != len(self.entries) or len(self.by_ours) != sum(len(e.ours) for e in self.entries):
            raise ValueError("a weight-name table names a tensor twice")

    def ours_of(self, hf_name: str) -> tuple[str, ...] | None:
        """Our parameters the HF tensor holds (several: a fused one); None: not in the table."""
        key, i = _pattern(hf_name)
        e = self.by_hf.get(key)
        return None if e is None else tuple(o.replace("{i}", i or "") for o in e.ours)

    def hf_of(self, name: str) -> str | None:
        """The HF tensor holding our parameter ``name`` (whole or a part); None: not in the table."""
        key, i = _pattern(name)
        e = self.by_ours.get(key)
        return None if e is None else e.hf.replace("{i}", i or "")

    def tensors(self, args, shapes: dict[str, tuple]) -> "HFTensors":
        """The HF tensors of a model with ``args`` whose parameters have ``shapes`` (our name ->
        shape, in the model's order; HF tensors come in the order of their first part)."""
        groups: dict[str, tuple[Entry, str | None]] = {}
        for name in shapes:
            key, i = _pattern(name)
            e = self.by_ours.get(key)
            if e is None:
                raise ValueError(f"no HF name for {name!r}")
            groups.setdefault(e.hf.replace("{i}", i or ""), (e, i))
        out = {}
        for hf, (e, i) in groups.items():
            names = [o.replace("{i}", i or "") for o in e.ours]
            absent = [n for n in names if n not in shapes]
            if absent:
                raise ValueError(f"the model has {len(names) - len(absent)} of the {len(names)} parameters fused "
                                 f"in {hf!r}: {absent} missing")
            rows = [shapes[n][0] for n in names]
            if e.rows is not None and list(e.rows(args)) != rows:
                raise ValueError(f"{hf!r} splits into rows {list(e.rows(args))} by the config, but the model's "
                                 f"{names} have {rows}")
            tails = {tuple(shapes[n][1:]) for n in names}
            if len(tails) > 1:
                raise ValueError(f"the parameters fused in {hf!r} differ past dim 0: {sorted(tails)}")
            starts = [sum(rows[:k]) for k in range(len(rows))]
            out[hf] = tuple(Part(n, s, r) for n, s, r in zip(names, starts, rows))
        return HFTensors(out, dict(shapes))


class HFTensors:
    """One model's HF tensors: ``parts[hf]`` the pieces of ours it is made of, ``shapes[hf]``
    its shape, ``ours[name]`` our parameter's shape."""

    def __init__(self, parts: dict[str, tuple[Part, ...]], ours: dict[str, tuple]):
        self.parts = parts
        self.ours = ours
        self.shapes = {hf: (sum(p.rows for p in ps), *ours[ps[0].name][1:]) for hf, ps in parts.items()}

    def join(self, hf: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """HF tensor ``hf`` from our parameters (``get(name)``): concatenated when fused."""
        ps = self.parts[hf]
        if len(ps) == 1:
            return get(ps[0].name)
        return torch.cat([get(p.name) for p in ps])
