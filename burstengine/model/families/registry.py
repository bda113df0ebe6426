"""The model families read from and written back to Hugging Face directories, by name
(``ModelArgs.arch``), HF architecture and model_type.  Adding a family: its file in this package
and one line in ``FAMILIES``."""
from __future__ import annotations

import dataclasses

from . import gemma3, llama, mistral, phi3, qwen2, qwen3
from .base import Family, full_hf_name, unexpected

FAMILIES: dict[str, Family] = {f.name: f for f in (llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, mistral.FAMILY,
                                                   gemma3.FAMILY, phi3.FAMILY)}
ARCHS = tuple(FAMILIES)  # the values ModelArgs.arch takes
BY_ARCHITECTURE = {a: f for f in FAMILIES.values() for a in f.architectures}
BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES.values()}


def architectures() -> list[str]:
    return list(BY_ARCHITECTURE)


def family(arch: str) -> Family:
    """The family named ``arch`` (a ModelArgs.arch)."""
    if arch not in FAMILIES:
        raise ValueError(f"model.arch must be one of {list(ARCHS)}, got {arch!r}")
    return FAMILIES[arch]


def from_config(cfg: dict, where: str = "config.json") -> Family:
    """The family of an HF config.json (its first architecture, else its model_type), or a
    ValueError listing the registry."""
    archs = cfg.get("architectures") or []
    if archs:
        name, found = archs[0], BY_ARCHITECTURE.get(archs[0])
    else:
        found = BY_MODEL_TYPE.get(cfg.get("model_type"))
        name = found.architectures[0] if found else cfg.get("model_type")
    if found is None:
        listing = ", ".join(f"{a} (model_type {f.model_type!r})" for a, f in BY_ARCHITECTURE.items())
        raise ValueError(f"{where}: architecture {name!r} is not supported; burstengine's model reproduces {listing}")
    return found


def writer(args) -> Family:
    """The family ``args`` is written back as, or a ValueError naming the option of ``args`` (set
    apart from its default) or the rope scaling its config.json cannot carry and the families whose
    can."""
    f = family(args.arch)
    rope = args.rope_scaling.type
    if rope not in f.rope_types.values():
        can = " or ".join(g.title for g in FAMILIES.values() if rope in g.rope_types.values())
        raise ValueError(f"{rope} rope scaling (model.rope_scaling.type) can only be written as a {can} model, not "
                         f"{args.arch!r}")
    defaults = {x.name: x.default for x in dataclasses.fields(args)}
    for g in FAMILIES.values():
        for key, what in g.expresses.items():
            value = getattr(args, key)
            if value != defaults[key] and key not in f.expresses:
                can = " or ".join(h.title for h in FAMILIES.values() if key in h.expresses)
                raise ValueError(f"{what} (model.{key}={value}) can only be written as a {can} model, not "
                                 f"{args.arch!r}")
    return f


def hf_parameter(name: str) -> bool:
    """Whether HF tensor ``name`` is a parameter of some family's model (False: a buffer our model
    recomputes); a ValueError when no family has it."""
    full = full_hf_name(name)
    for f in FAMILIES.values():
        try:
            return f.ours_of(full) is not None
        except ValueError:
            continue
    raise unexpected(full, architectures())
