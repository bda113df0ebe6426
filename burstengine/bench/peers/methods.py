"""Every method the peer benches time, one entry each: which attention runs (ours or a peer's),
on which kernel and sequence layout, and which benches take it by name.

Benches look a method up by its name and run it by its ``attention`` (the family of
implementation); a name a bench does not list in ``benches`` is unknown to it.  The names are
the ones the records hold (``burst-zigzag`` in `bench attention`, ``burst`` in `bench prefill`
and `bench train`, ...).

=============  ======================================================================================
attention      what runs
=============  ======================================================================================
burst          burst_attn_func: our ring over the sequence shards (``layout``, ``backward``), the
               local kernel --kernel (auto: cuDNN on GPUs); in prefill and train the model's
torch-cp       SDPA inside torch.distributed.tensor.experimental.context_parallel (its own head-tail
               balancing of the shards); CUDA only: torch has no CPU rule for it
ulysses        DeepSpeed-Ulysses: all-to-all to head shards, SDPA over the whole sequence, back
megatron-tp    Megatron-style tensor-parallel attention (sequence-parallel collectives, no
               projections): a timing peer of one attention call (peer_attention.megatron_tp)
megatron       the Megatron tensor-parallel LLaMA of the same weights (tp_llama): ``mode`` v3 with
               sequence parallelism, v1 with all-reduces
single-gpu     SDPA on one GPU over the per-GPU work of the distributed call (S / sqrt(G) tokens)
plain          the same model written the plain-PyTorch way on one GPU (plain_llama)
=============  ======================================================================================

``sdpa``: the SDPA backend the method is pinned to (cudnn, flash, math); None where the bench's
own flag decides (--kernel for ours, --sdpa for the prefill peers).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...layout import LAYOUTS

SDPA = ("cudnn", "flash", "math")


@dataclass(frozen=True)
class Method:
    name: str
    attention: str  # the family of implementation (see the module's table)
    what: str
    benches: tuple[str, ...]  # the benches that take this name
    layout: str | None = None  # burstengine's sequence layout of the shards (None: the method shards otherwise)
    backward: str | None = None  # burst: the ring's backward scheme ("burst": Q, dO, D, lse, dQ travel; "ring": K, V)
    sdpa: str | None = None
    mode: str | None = None  # megatron: v1 or v3
    kernel: str | None = None  # burst: the local kernel this method pins (None: the bench's --kernel)

    @property
    def cuda_only(self) -> bool:
        """torch's CP has no CPU rule; the cuDNN and flash SDPA backends have no CPU kernels."""
        return self.attention == "torch-cp" or self.sdpa in ("cudnn", "flash")


def _methods() -> dict[str, Method]:
    out = [Method("burst", "burst", "BurstAttention over zigzag shards (the model's own, in train)",
                  ("prefill", "train"), layout="zigzag", backward="burst"),
           Method("torch-cp", "torch-cp", "torch's context parallelism around SDPA (--sdpa's backend in prefill)",
                  ("prefill", "train"), layout="zigzag"),
           Method("burst-fp8", "burst", "BurstAttention over zigzag shards with the FP8 forward (kernel 'fp8')",
                  ("prefill",), layout="zigzag", backward="burst", kernel="fp8"),
           Method("plain", "plain", "the plain-PyTorch model on one GPU, no context parallelism", ("train",)),
           *(Method(f"megatron-{m}", "megatron", f"Megatron tensor-parallel LLaMA, {how}", ("prefill",), mode=m)
             for m, how in (("v3", "sequence parallel"), ("v1", "all-reduce")))]
    for layout in LAYOUTS:
        out.append(Method(f"burst-{layout}", "burst", f"BurstAttention, {layout} layout, burst backward",
                          ("attention", "prefill"), layout=layout, backward="burst"))
        out.append(Method(f"ringbwd-{layout}", "burst", f"BurstAttention, {layout} layout, RingAttention's backward",
                          ("attention",), layout=layout, backward="ring"))
    for b in SDPA:
        out += [Method(f"torch-cp-{b}", "torch-cp", f"torch's context parallelism around SDPA {b}", ("attention",),
                       sdpa=b),
                Method(f"ulysses-{b}", "ulysses", f"Ulysses head parallelism around SDPA {b}", ("attention",), sdpa=b),
                Method(f"megatron-tp-{b}", "megatron-tp", f"Megatron-style TP attention on SDPA {b}", ("attention",),
                       sdpa=b),
                Method(f"single-gpu-{b}", "single-gpu", f"SDPA {b} on one GPU, the per-GPU work", ("attention",),
                       sdpa=b)]
    return {m.name: m for m in out}


METHODS: dict[str, Method] = _methods()


def unknown(bench: str, names) -> list[str]:
    """The names of ``names`` that ``bench`` does not take (empty when it knows them all)."""
    return [n for n in names if n not in METHODS or bench not in METHODS[n].benches]


def method(name: str, bench: str) -> Method:
    m = METHODS.get(name)
    if m is None or bench not in m.benches:
        known = [k for k, v in METHODS.items() if bench in v.benches]
        raise ValueError(f"unknown method {name!r} for bench {bench}; known: {', '.join(known)}")
    return m
