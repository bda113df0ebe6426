"""LoRA: low-rank adapters on the decoder's projections, the base weights frozen.

A target projection ``W`` (``wq wk wv wo`` of attention, ``w1 w2 w3`` of the SwiGLU MLP: HF's
``q_proj k_proj v_proj o_proj gate_proj down_proj up_proj``) becomes a :class:`LoraLinear`::

    y = x W^T (+ b) + (alpha / rank) * B (A (dropout(x)))

``A`` (rank x in) starts kaiming-uniform and ``B`` (out x rank) at zero, as PEFT initialises
them, so a fresh adapter leaves the model's output unchanged.  Every other parameter (the base
projections, norms, embeddings, LM head) is frozen: it keeps no gradient and no optimizer state,
and is stored in the compute dtype (bf16 on GPUs: 2 bytes a parameter where training keeps 16).
The adapters are ``<projection>.lora_A.weight`` / ``.lora_B.weight``: the names PEFT gives them
under the projection's HF module (:func:`peft_name`).

Dropout (``dropout`` > 0) draws from torch's RNG: policies that run a layer again in backward
replay it (``full``, ``selective``: torch's checkpoint; the tiled MLP: its own); ``sequence``,
``pointwise`` and ``offload`` do not and are refused with it (:func:`dropout_conflict`).  The
``pointwise`` Functions (:mod:`.pointwise`) run each adapter's ``A`` on the input they recompute,
beside the base projection, so the adapter's contribution is in them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .families import family

# our projection -> the submodule of a Block that holds it
TARGETS = {"wq": "attention", "wk": "attention", "wv": "attention", "wo": "attention",
           "w1": "feed_forward", "w2": "feed_forward", "w3": "feed_forward"}
# policies that run a layer's adapters again without replaying torch's RNG
NO_RNG_REPLAY = ("sequence", "pointwise", "offload")


@dataclass
class LoraArgs:
    rank: int = 0                    # adapter rank r; 0 = no LoRA (every parameter trains)
    alpha: float = 16.0              # the adapter's output is scaled by alpha / rank
    dropout: float = 0.0             # dropout on the adapter's input only
    targets: str = "wq,wk,wv,wo,w1,w2,w3"  # projections given adapters (HF names q_proj, ... also read)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def target_list(self, arch: str = "llama") -> list[str]:
        """Our names of the targets (HF module names of family ``arch`` read too), in TARGETS' order."""
        hf = {hf_module(arch, t): t for t in TARGETS}
        names = [s.strip() for s in self.targets.split(",") if s.strip()]
        bad = [n for n in names if n not in TARGETS and n not in hf]
        if bad or not names:
            raise ValueError(f"lora.targets must name some of {list(TARGETS)} (or their HF names "
                             f"{list(hf)}), got {self.targets!r}")
        mine = {hf.get(n, n) for n in names}
        return [t for t in TARGETS if t in mine]

    def validate(self, arch: str = "llama") -> None:
        if isinstance(self.rank, bool) or self.rank < 0:
            raise ValueError(f"lora.rank must be >= 0 (0 = no LoRA), got {self.rank}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"lora.alpha must be a finite number > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        self.target_list(arch)


def hf_module(arch: str, target: str) -> str:
    """The HF module name of our projection ``target`` in family ``arch`` (``wq`` -> ``q_proj``)."""
    hf = family(arch).table.hf_of(f"layers.0.{TARGETS[target]}.{target}.weight")
    return hf.rsplit(".", 2)[-2]


def dropout_conflict(spec: LoraArgs, policy: str) -> str | None:
    """Why ``policy`` cannot run adapters with ``spec``'s dropout (one line), else None."""
    if spec.enabled and spec.dropout > 0 and policy in NO_RNG_REPLAY:
        return (f"lora.dropout={spec.dropout} needs a checkpoint policy that replays the RNG when it recomputes; "
                f"activation_checkpoint={policy!r} does not: use none, full, selective or auto, or lora.dropout=0")
    return None


class LoraLinear(nn.Linear):
    """``nn.Linear`` (its frozen ``weight`` and ``bias``) plus the adapter ``lora_B(lora_A(dropout(x)))``
    scaled by ``scale``."""

    @classmethod
    def wrap(cls, base: nn.Linear, rank: int, scale: float, dropout: float) -> "LoraLinear":
        """``base`` with an adapter: its own parameters (no copy), adapters in float32 on its device."""
        lin = cls.__new__(cls)
        nn.Module.__init__(lin)
        lin.in_features, lin.out_features = base.in_features, base.out_features
        lin.weight = base.weight
        lin.register_parameter("bias", base.bias)
        dev = base.weight.device
        lin.lora_A = nn.Linear(base.in_features, rank, bias=False, device=dev, dtype=torch.float32)
        lin.lora_B = nn.Linear(rank, base.out_features, bias=False, device=dev, dtype=torch.float32)
        lin.scale, lin.p = scale, dropout
        return lin

    def drop(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.p, self.training) if self.p else x

    def adapt(self, y: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        """The output from the base projection's ``y`` and ``a`` = lora_A(dropout(x))."""
        return y + self.scale * self.lora_B(a)

    def forward(self, x):
        return self.adapt(F.linear(x, self.weight, self.bias), self.lora_A(self.drop(x)))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_A.out_features}, scale={self.scale}, dropout={self.p}"


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` is a LoRA adapter's."""
    return ".lora_A." in name or ".lora_B." in name


def apply(model, spec: LoraArgs, frozen_dtype: torch.dtype | None = None):
    """Give ``model`` (a Transformer, unsharded, any device, meta included) adapters on
    ``spec``'s targets and freeze every other parameter (stored as ``frozen_dtype`` when given).
    Returns the model."""
    targets = spec.target_list(model.args.arch)
    for block in model.layers:
        for t in targets:
            parent = getattr(block, TARGETS[t])
            setattr(parent, t, LoraLinear.wrap(getattr(parent, t), spec.rank, spec.scale, spec.dropout))
        block.random = spec.dropout > 0
    for name, p in model.named_parameters():
        if is_adapter(name):
            continue
        p.requires_grad_(False)
        if frozen_dtype is not None and p.dtype != frozen_dtype:
            p.data = p.data.to(frozen_dtype)
    model.lora = spec
    return model


def adapters(model) -> dict[str, nn.Parameter]:
    """The model's adapter parameters by name."""
    return {n: p for n, p in model.named_parameters() if is_adapter(n)}


def peft_name(arch: str, name: str) -> str:
    """The name PEFT saves our adapter parameter ``name`` under (``layers.0.attention.wq.lora_A.weight``
    -> ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), through family ``arch``'s
    weight table; a ValueError where the projection is part of a fused HF tensor (one PEFT adapter
    there would be one low-rank update of the fused weight, not one per part)."""
    base, _, which = name.rpartition(".lora_")
    table = family(arch).table
    weight = f"{base}.weight"
    hf = table.hf_of(weight)
    if hf is None:
        raise ValueError(f"no HF name for {weight!r}")
    if len(table.ours_of(hf)) > 1:
        raise ValueError(f"{weight} is part of the fused HF tensor {hf!r}: a PEFT adapter cannot be written for it "
                         f"(export the merged model instead)")
    return f"base_model.model.{hf[:-len('.weight')]}.lora_{which}"


def merged(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """A base projection's weight with its adapter merged in (float32): W + scale * B A."""
    return weight.float() + scale * (b.float() @ a.float())
